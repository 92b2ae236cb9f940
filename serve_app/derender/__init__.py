"""Derender: generated token ids -> OpenAI responses.

Two deployments share this package: :class:`~serve_app.derender.plain.PlainDerender`
(detokenization only, ``tokenizers`` + pydantic, no vLLM) and
:class:`~serve_app.derender.parser.ParserDerender` (vLLM's tool and reasoning parsers).
"""

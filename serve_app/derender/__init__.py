"""Derender: generated token ids -> OpenAI responses.

Two deployments share this package: :class:`~serve_app.derender.plain.PlainDerender`
(detokenization only, ``tokenizers`` + pydantic, no vLLM) and
:class:`~serve_app.derender.parser.ParserDerender` (vLLM's tool and reasoning parsers). Each is a
Serve shell over a service that checks a request and dispatches it (``plain_service.py``,
``parser_service.py``). The work is shared by both paths:

* ``model.py``: the model as derender sees it, its limits, the off-loop worker thread;
* ``request.py``: what a request decides (one ``RequestConfig``), the parser path's request cache;
* ``streams.py``: one choice's stream, ``open`` / ``feed`` / ``state`` (plain, and through parsers);
* ``whole.py``: non-streaming answers; ``responses.py``: every response, chunk and choice dict;
* ``checks.py``, ``detokenize.py``, ``logprobs.py``, ``stop.py``, ``tokenizer.py``, ``sessions.py``.
"""

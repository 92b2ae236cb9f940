"""``python -m serve_app check CONFIG.yaml``: what a config will serve, checked without a GPU or network.

For each ``serve_app`` application it prints the resolved model (hub commit and snapshot), the parser
and template flags, every deployment's CPUs / GPUs per replica and the totals at ``max_replicas``
(options merged as :func:`serve_app.app.build_app` and then Serve merge them), and vLLM's verdict on the
engine arguments (its own parser, then ``create_engine_config`` on this machine's platform against the
cached config; no weights, no device, no Ray). Exit 0 when all is well, else 1 with a one-line reason.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serve_app.config import AppArgs, ResolvedModel

__all__ = ["CheckFailed", "check_config", "main"]

IMPORT_PATH = "serve_app.app:build_app"


class CheckFailed(Exception):
    """The one-line reason ``check`` exits non-zero."""


def _deployment_classes(args: AppArgs) -> dict[str, tuple[Any, str]]:
    """The graph build_app binds: Serve name -> (class, key under ``args.deployments``)."""
    from serve_app.derender.parser import ParserDerender
    from serve_app.derender.plain import PlainDerender
    from serve_app.ingress import Ingress
    from serve_app.render import Render

    graph: dict[str, tuple[Any, str]] = {
        "Ingress": (Ingress, "ingress"),
        "Render": (Render, "render"),
        "PlainDerender": (PlainDerender, "plain_derender"),
    }
    if args.has_parser:
        graph["ParserDerender"] = (ParserDerender, "parser_derender")
    if args.engine.enabled:
        from serve_app.engine import Engine

        graph["Engine"] = (Engine, "engine")
    return graph


def deployment_plan(args: AppArgs, serve_overrides: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each deployment's options as Serve will run them: build_app's defaults with ``args.deployments``
    deep-merged over them (and the Engine's placement group, where build_app adds one), then the
    config's ``deployments:`` entries, whose keys Serve replaces whole."""
    from serve_app.app import merge_options

    plan = {}
    for name, (cls, key) in _deployment_classes(args).items():
        user = getattr(args.deployments, key)
        opts = merge_options(cls.func_or_class.deployment_options(args), user)
        with_placement = getattr(cls.func_or_class, "with_placement", None)
        if with_placement is not None:
            opts = with_placement(args, opts)
        override = {k: v for k, v in serve_overrides.get(name, {}).items() if k != "name"}
        if "num_replicas" in override and "autoscaling_config" not in override:
            opts.pop("autoscaling_config", None)
        if "autoscaling_config" in override and "num_replicas" not in override:
            opts.pop("num_replicas", None)
        plan[name] = {**opts, **override}
    return plan


def replica_resources(options: dict[str, Any]) -> tuple[int, float, float]:
    """(replicas at most, CPUs per replica, GPUs per replica): a placement group's bundles when the
    deployment has one (bundle 0 holds the replica itself), else its ``ray_actor_options``."""
    scaling = options.get("autoscaling_config") or {}
    replicas = int(scaling.get("max_replicas") or options.get("num_replicas") or 1)
    bundles = options.get("placement_group_bundles")
    if bundles:
        return replicas, sum(b.get("CPU", 0) for b in bundles), sum(b.get("GPU", 0) for b in bundles)
    actor = options.get("ray_actor_options") or {}
    return replicas, float(actor.get("num_cpus", 1)), float(actor.get("num_gpus", 0))


def _parser_flags(args: AppArgs, model: ResolvedModel) -> str:
    from serve_app._vllm import vllm_cli_args

    argv = vllm_cli_args(args, model)
    skip = {"--model", "--tokenizer", "--served-model-name", "--max-model-len", "--max-logprobs"}
    out, i = [], 0
    while i < len(argv):
        if argv[i] in skip:
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
            continue
        if argv[i] == "--chat-template":
            source = f"file {args.chat_template}" if model.chat_template else args.chat_template
            out.append(f"--chat-template <{source}>")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return " ".join(out)


def _check_chat_template(args: AppArgs, model: ResolvedModel) -> None:
    """vLLM loads the template as it will at render start (a file is read already; a name is one of vLLM's)."""
    if not args.chat_template or model.chat_template:
        return
    from serve_app._vllm import load_chat_template

    try:
        load_chat_template(args.chat_template)
    except Exception as exc:
        where = f"not a file here (cwd {os.getcwd()}) nor a template vLLM ships"
        raise CheckFailed(f"chat_template {args.chat_template!r}: {where}: {exc}") from None


def check_app(app: dict[str, Any], out: Any) -> None:
    from pydantic import ValidationError

    from serve_app._vllm import engine_cli_args, engine_config_verdict
    from serve_app.config import AppArgs, ConfigError
    from serve_app.model_source import ModelSourceError, hub_cache_dir

    name = app.get("name", "?")
    try:
        args = AppArgs.model_validate(app.get("args") or {})
    except ValidationError as exc:
        err = exc.errors()[0]
        raise CheckFailed(f"{name}: args.{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    # The engine's own verdict is asked for below, on this platform whatever it is.
    plain = args.model_copy(update={"engine": args.engine.model_copy(update={"enabled": False})})
    try:
        model = plain.resolve()
    except ModelSourceError as exc:
        raise CheckFailed(f"not cached: {exc}") from None
    print(f"application {name}", file=out)
    if model.hub_id:
        print(f"  model: {args.model} (hub id, commit {model.revision}; cache {hub_cache_dir(args.download_dir)})", file=out)
    else:
        from serve_app.models import is_builtin

        print(f"  model: {args.model} ({'builtin' if is_builtin(args.model) else 'local directory'})", file=out)
    print(f"  snapshot: {model.model_dir}", file=out)
    if model.tokenizer_dir != model.model_dir:
        print(f"  tokenizer: {args.tokenizer} (commit {model.tokenizer_revision}) at {model.tokenizer_dir}", file=out)
    print(f"  served model names: {', '.join(model.served_model_names)}; max_model_len {model.max_model_len}", file=out)
    _check_chat_template(args, model)
    print(f"  render / derender flags: {_parser_flags(args, model)}", file=out)

    config = None
    if args.engine.enabled:  # first: the deployment options read engine args (max_num_seqs)
        try:
            config = engine_config_verdict(args, model)
        except ConfigError as exc:
            raise CheckFailed(f"{name}: {exc}") from None

    serve_overrides = {d["name"]: d for d in app.get("deployments") or []}
    try:
        plan = deployment_plan(args, serve_overrides)
    except ValueError as exc:
        raise CheckFailed(f"{name}: deployments: {exc}") from None
    unknown = set(serve_overrides) - set(plan)
    if unknown:
        raise CheckFailed(f"{name}: deployments: {', '.join(sorted(unknown))} not in the graph (it has {', '.join(plan)})")
    total_cpu = total_gpu = 0.0
    print("  deployments (at most replicas x per replica):", file=out)
    for dep, options in plan.items():
        n, cpus, gpus = replica_resources(options)
        total_cpu, total_gpu = total_cpu + n * cpus, total_gpu + n * gpus
        print(f"    {dep:<15} {n:>3} x {cpus:g} CPU, {gpus:g} GPU", file=out)
    print(f"  total at max_replicas: {total_cpu:g} CPU, {total_gpu:g} GPU", file=out)

    if config is None:
        print("  engine: not in this app (engine.enabled: false)", file=out)
        return
    print(f"  engine: vllm serve {' '.join(engine_cli_args(args, model))}", file=out)
    pc, sc = config.parallel_config, config.scheduler_config
    print(
        f"  vLLM ({config.device_config.device_type} platform here): engine args ok; tensor_parallel_size "
        f"{pc.tensor_parallel_size}, pipeline_parallel_size {pc.pipeline_parallel_size}, max_num_seqs "
        f"{sc.max_num_seqs} (as chosen on this platform), dtype {config.model_config.dtype}",
        file=out,
    )


def check_config(path: str | Path, out: Any = None) -> None:
    """Check every serve_app application of the Serve config at ``path`` (report to ``out``, default
    stdout); raises :class:`CheckFailed`."""
    out = out or sys.stdout
    import yaml
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        data = yaml.safe_load(Path(path).read_text())
        schema = ServeDeploySchema.model_validate(data)
    except (OSError, yaml.YAMLError) as exc:
        raise CheckFailed(f"{path}: {exc}") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        raise CheckFailed(f"{path}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    apps = [a for a in data.get("applications") or [] if a.get("import_path") == IMPORT_PATH]
    if not apps:
        raise CheckFailed(f"{path}: no application with import_path {IMPORT_PATH}")
    print(f"config: {path} ({len(schema.applications)} application(s))", file=out)
    for app in apps:
        check_app(app, out)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m serve_app check", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a Serve config (serve_config.yaml, configs/*.yaml)")
    opts = parser.parse_args(argv)
    try:
        check_config(opts.config)
    except CheckFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("ok")
    return 0

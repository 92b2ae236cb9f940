"""The deployment graph, bound in one place: ``Ingress -> (Render, PlainDerender, ParserDerender, Engine)``.

``serve_config.yaml`` points at :func:`build_app` (``import_path: serve_app.app:build_app``); Serve
validates its ``args`` into :class:`~serve_app.config.AppArgs` because of the annotation.
"""

# No `from __future__ import annotations` here: Serve reads build_app's annotation at run time to
# validate the YAML args into AppArgs, and a string annotation would hand us a plain dict.
from typing import Any

from ray.serve import Application

from serve_app.config import AppArgs
from serve_app.derender.parser import ParserDerender
from serve_app.derender.plain import PlainDerender
from serve_app.ingress import Ingress
from serve_app.render import Render

__all__ = ["build_app", "merge_options"]


def merge_options(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge user deployment options over a deployment's defaults."""
    merged = dict(defaults)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_options(merged[key], value)
        else:
            merged[key] = value
    # Serve rejects both together: the one the user set wins over the default's other.
    if "autoscaling_config" in overrides and "num_replicas" not in overrides:
        merged.pop("num_replicas", None)
    if "num_replicas" in overrides and "autoscaling_config" not in overrides:
        merged.pop("autoscaling_config", None)
    return merged


def build_app(args: AppArgs) -> Application:
    """Build the application from validated args; the model directory is resolved once, here.

    A stage listed in ``args.colocate_in_ingress`` also runs inside the Ingress, which serves HTTP with
    it in-process; its own deployment stays up for callers by handle.
    """
    model = args.resolve()

    def bind(deployment: Any, overrides: dict[str, Any], *bind_args: Any, **bind_kwargs: Any) -> Any:
        """The deployment with its defaults, the user's overrides merged over them, bound to its arguments."""
        opts = merge_options(deployment.func_or_class.deployment_options(args), overrides)
        return deployment.options(**opts).bind(*bind_args, **bind_kwargs)

    options = args.deployments
    # The replicas get the args without their deployment options: those reach Serve as options, so
    # rescaling one stage is Serve's lightweight update, not a new version of every deployment.
    args = args.model_copy(update={"deployments": type(options)()})
    render = bind(Render, options.render, args, model)
    plain = bind(PlainDerender, options.plain_derender, args, model)
    parser = bind(ParserDerender, options.parser_derender, args, model) if args.has_parser else None
    engine = None
    if args.engine.enabled:
        from serve_app.engine import Engine

        # Its placement group holds the replica's own resources: built over the merged options.
        deployment: Any = Engine
        shell = deployment.func_or_class
        engine_options = shell.with_placement(args, merge_options(shell.deployment_options(args), options.engine))
        engine = deployment.options(**engine_options).bind(args, model)
    return bind(Ingress, options.ingress, args, model, render, plain, parser, engine=engine)

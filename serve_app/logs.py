"""Module loggers under Ray Serve's, so a replica's log lines carry the request they belong to.

Serve configures the ``ray.serve`` logger in every replica (its log file, level, TEXT or JSON encoding
from the deployment's ``logging_config``) with a filter that adds the request's id, route and
application to each record. A logger below it inherits all of that; ``logging.getLogger(__name__)``
would not. Ray Serve LLM does the same (``ray/llm/_internal/serve/observability/logging``:
``get_logger`` returns ``ray.serve.<name>``). Outside a replica the records reach the root logger
as usual.
"""

from __future__ import annotations

import logging

__all__ = ["get_logger"]

SERVE_LOGGER = "ray.serve"  # ray.serve._private.constants.SERVE_LOGGER_NAME


def get_logger(name: str) -> logging.Logger:
    """The logger for module ``name`` (pass ``__name__``): ``ray.serve.<name>``."""
    return logging.getLogger(f"{SERVE_LOGGER}.{name}")

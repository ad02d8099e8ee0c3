"""``execpool serve``: one pool behind HTTP, run in the service's process.
app.py is the ASGI app (``create_app``), command.py the command that
listens and shuts down; settings.py holds what a request does not say,
admission.py the slots and queue, metrics.py the Prometheus metrics,
files.py the files into and out of a job's directory.

The service's stack (Starlette, uvicorn, prometheus-client) is the
``serve`` extra: importing ``create_app`` without it raises an ImportError
that says what to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import settings

if TYPE_CHECKING:
    from .app import create_app

__all__ = ["create_app"]

def __getattr__(name: str) -> object:
    if name != "create_app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        app = importlib.import_module(".app", __name__)
    except ImportError as exc:
        if not settings.stack_missing(exc):
            raise
        raise ImportError(f"{settings.INSTALL_HINT} ({exc})", name=exc.name) from exc
    return app.create_app

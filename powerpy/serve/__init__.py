"""``powerpy serve``: an OpenAI-compatible HTTP server (FastAPI, uvicorn, server-sent events).

The HTTP layer only: requests are checked here and run by :class:`powerpy.scheduler.Scheduler`,
which holds the session slots and runs all model work on its own thread. Needs the ``serve``
extra (``pip install 'powerpy[serve]'``).
"""

from powerpy.serve.app import create_app
from powerpy.serve.service import ServeConfig

__all__ = ["ServeConfig", "create_app"]

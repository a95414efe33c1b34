"""Run the app with uvicorn; the first Ctrl-C (SIGINT or SIGTERM) drains, the second quits.

Draining: new requests get 503, the running and queued ones finish and their responses are
sent, then the server exits with status 0.
"""

from __future__ import annotations

import logging
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from powerpy.scheduler import Scheduler

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose exit signal first lets the running requests finish."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, app: FastAPI) -> None:
        super().__init__(config)
        self.scheduler, self.app = scheduler, app
        self.draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining or self.should_exit:  # the second signal: quit now
            self.should_exit = self.force_exit = True
            return
        self.draining = True
        self.scheduler.drain()
        snap = self.scheduler.snapshot()
        log.warning(
            "%s: finishing %d running and %d queued requests (again to quit now)",
            signal.Signals(sig).name,
            snap["slots_busy"],
            snap["queue_depth"],
        )

    @property
    def drained(self) -> bool:
        return self.scheduler.idle and self.app.state.service.open_generations == 0

    async def on_tick(self, counter: int) -> bool:
        if self.draining and not self.should_exit and self.drained:
            self.should_exit = True
        return await super().on_tick(counter)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port).

    Raises:
        OSError: the address is taken or invalid.
    """
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run(app: FastAPI, scheduler: Scheduler, sock: socket.socket, *, verbose: bool = False) -> None:
    """Serve ``app`` on the bound ``sock`` until drained after a signal; close the scheduler."""
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info" if verbose else "warning",
        access_log=verbose,
        lifespan="off",
        timeout_graceful_shutdown=None,
    )
    server = DrainingServer(config, scheduler, app)
    try:
        server.run(sockets=[sock])
    finally:
        scheduler.close()

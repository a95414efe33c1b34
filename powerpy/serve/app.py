"""The FastAPI app: routes, the API key and body-size guard, OpenAI error JSON for every error,
``/health`` and ``/metrics``."""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from powerpy.scheduler import Scheduler
from powerpy.serve.errors import APIError
from powerpy.serve.llama_routes import router as llama_router
from powerpy.serve.metrics import CONTENT_TYPE_LATEST, Metrics
from powerpy.serve.openai_routes import router as openai_router
from powerpy.serve.service import ServeConfig, Service

log = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/health"})  # answered without the API key


class Guard:
    """ASGI middleware: the Bearer key, the body-size limit, and response counts per endpoint."""

    def __init__(self, app: ASGIApp, config: ServeConfig, metrics: Metrics, paths: set[str]):
        self.app, self.config, self.metrics, self.paths = app, config, metrics, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in self.paths else "other"

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http.labels(endpoint, str(message["status"])).inc()
            await send(message)

        error = self.check(scope, path)
        if error is not None:
            await error.response()(scope, receive, counted_send)
            return
        limit, seen = self.config.max_body_bytes, 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise APIError(413, f"the request body exceeds {limit} bytes")
            return message

        await self.app(scope, limited_receive, counted_send)

    def check(self, scope: Scope, path: str) -> APIError | None:
        headers = dict(scope["headers"])
        key = self.config.api_key
        if key and path not in PUBLIC_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), key.encode()
            ):
                msg = "Incorrect API key provided" if given else "Missing API key: send "
                msg += "" if given else "'Authorization: Bearer KEY'"
                return APIError(401, msg, code="invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return APIError(400, "invalid Content-Length")
            if n > self.config.max_body_bytes:
                return APIError(413, f"the request body exceeds {self.config.max_body_bytes} bytes")
        return None


def create_app(scheduler: Scheduler, config: ServeConfig | None = None) -> FastAPI:
    """The server app over a started ``scheduler``."""
    config = config or ServeConfig()
    app = FastAPI(title="powerpy", docs_url=None, redoc_url=None, openapi_url=None)
    service = Service(scheduler, config)
    metrics = Metrics(scheduler)
    app.state.service = service
    app.include_router(openai_router)
    app.include_router(llama_router)

    @app.get("/health")
    async def health():
        snap = scheduler.snapshot()
        if snap["draining"]:
            return APIError(503, "the server is shutting down", code="shutting_down").response()
        problem = await run_in_threadpool(scheduler.health)  # a pipeline pings its stages
        if problem is not None:
            msg = problem.get("message", "the engine is unavailable")
            body = APIError(503, msg, code="engine_unavailable").body()
            body["error"].update({k: v for k, v in problem.items() if k != "message"})
            return JSONResponse(body, status_code=503)
        return {
            "status": "ok",
            "slots_idle": snap["slots_total"] - snap["slots_busy"],
            "slots_processing": snap["slots_busy"],
            "queue_depth": snap["queue_depth"],
        }

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(APIError)
    async def api_error(request: HTTPRequest, exc: APIError):
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, exc: HTTPException):
        message = {404: f"no such endpoint: {request.url.path}"}.get(exc.status_code, exc.detail)
        return APIError(exc.status_code, str(message)).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: HTTPRequest, exc: RequestValidationError):
        return APIError(400, f"invalid request: {exc.errors()[:1]}").response()

    @app.exception_handler(Exception)
    async def internal_error(request: HTTPRequest, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(
            APIError(500, f"internal error: {type(exc).__name__}").body(), status_code=500
        )

    routers = (openai_router, llama_router)
    paths = {r.path for router in routers for r in router.routes} | {"/health", "/metrics"}
    app.add_middleware(Guard, config=config, metrics=metrics, paths=paths)
    return app

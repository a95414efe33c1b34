"""OpenAI's error JSON, ``{"error": {"message", "type", "param", "code"}}``, with its status."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

DEFAULT_TYPES = ("invalid_request_error", "server_error")  # 4xx, 5xx
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error answered as OpenAI's error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        """The HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {...}}`` for ``status`` (also sent as the data of an SSE error event)."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, DEFAULT_TYPES[status >= 500]),
            "param": param,
            "code": code,
        }
    }


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)

"""Errors in OpenAI's schema: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

Every rejection the server makes goes through `APIError`, so clients (the official `openai` package
included) map them to their typed exceptions (BadRequestError, AuthenticationError, NotFoundError, ...).
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError",
    429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.code if self.code is not None else self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def param_of(message: str, candidates: tuple[str, ...]) -> str | None:
    """SamplingParams' messages start with the field's name: report it as OpenAI's `param`."""
    for name in candidates:
        if message.startswith(name):
            return name
    return None

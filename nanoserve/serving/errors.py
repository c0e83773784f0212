"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}: the app's handlers for
what the routes raise (APIError), what FastAPI's validation refuses, and unknown routes; and the API
key's check."""
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from nanoserve.serving.protocol import APIError


class APIKeyMiddleware:
    """Every /v1 route needs `Authorization: Bearer KEY` (plain ASGI, so that streams pass through
    untouched)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}"

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and \
                Headers(scope=scope).get("authorization") != self.expected:
            error = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer KEY`",
                             code="invalid_api_key")
            return await JSONResponse(error.body(), 401)(scope, receive, send)
        await self.app(scope, receive, send)


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), e.status_code)

    # malformed JSON, missing fields, wrong types
    @app.exception_handler(RequestValidationError)
    async def invalid_request(_, e: RequestValidationError):
        # each with a `loc` such as ("body", "prompt") or, for malformed JSON, ("body", 15)
        errors = e.errors()
        loc = errors[0]["loc"][1:] if errors else ()
        param = next((part for part in loc if isinstance(part, str)), None)
        message = "; ".join(map(describe, errors)) or "invalid request"
        return await api_error(None, APIError(400, message, param))

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):  # an unknown route (404), a wrong method (405)
        return await api_error(None,
                               APIError(e.status_code, str(e.detail), code=str(e.status_code)))


def describe(error: dict) -> str:
    """One of pydantic's validation errors as a line that names the field."""
    if error["type"] == "json_invalid":
        reason = error.get("ctx", {}).get("error", "")
        return f"body: malformed JSON at character {error['loc'][-1]}: {reason}"
    if error["type"] == "extra_forbidden":  # (protocol.RequestModel)
        return f"{'.'.join(map(str, error['loc'][1:]))}: nanoserve does not support this field"
    return f"{'.'.join(map(str, error['loc'][1:])) or 'body'}: {error['msg']}"

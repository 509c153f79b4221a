"""The OpenAI error envelope (API.md §1.2) and the app's exception handlers.

Every error the gateway answers is `{"error": {"message", "type", "param", "code"}}` with all four
keys present; `type` is `invalid_request_error` for 4xx and `server_error` for 5xx. Handlers here
replace FastAPI's 422 validation body (400 instead), its 404/405 bodies and anything unexpected.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("gateway.errors")


class EnvelopeResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote the caller's value, and a lone
    surrogate in it (legal in JSON input) cannot be encoded as UTF-8 output."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class ApiError(Exception):
    """An error answered to the client as the §1.2 envelope."""

    def __init__(self, status: int, code: str | None, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.headers = dict(headers or {})
        if status in (409, 500):
            # The OpenAI client would otherwise retry these (API.md §1.2).
            self.headers.setdefault("x-should-retry", "false")

    @property
    def type(self) -> str:
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return EnvelopeResponse(self.body(), status_code=self.status, headers=self.headers)

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.code!r}, {self.message!r}, param={self.param!r})"


# Constructors for the errors the gateway raises in several places; message templates follow
# OpenAI's wording (API.md §1.2).

def invalid_json() -> ApiError:
    return ApiError(400, "invalid_json", "We could not parse the JSON body of your request.")


def missing(param: str) -> ApiError:
    return ApiError(400, "missing_required_parameter", f"Missing required parameter: '{param}'.", param)


def unknown(param: str) -> ApiError:
    return ApiError(400, "unknown_parameter", f"Unrecognized request argument supplied: {param}", param)


def invalid_type(param: str, expected: str, got: str) -> ApiError:
    return ApiError(400, "invalid_type",
                    f"Invalid type for '{param}': expected {expected}, but got {got} instead.", param)


def invalid_value(param: str, value, supported) -> ApiError:
    return ApiError(400, "invalid_value",
                    f"Invalid value: '{value}'. Supported values are: {_enumerate(supported)}.", param)


def out_of_range(param: str, low, high, value) -> ApiError:
    return ApiError(400, "out_of_range",
                    f"Invalid '{param}': expected a value between {low} and {high}, but got {value} instead.",
                    param)


def too_long(param: str, limit: int, length: int) -> ApiError:
    return ApiError(400, "string_above_max_length",
                    f"Invalid '{param}': string too long. Expected a string with maximum length {limit}, "
                    f"but got a string with length {length} instead.", param)


def empty_string(param: str) -> ApiError:
    return ApiError(400, "empty_string", f"Invalid '{param}': empty string. Expected a non-empty string.", param)


def conflicting(param: str, other: str) -> ApiError:
    return ApiError(400, "conflicting_parameters",
                    f"Invalid '{param}': cannot be combined with '{other}'.", param)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, "model_not_found", f"The model '{model}' does not exist.", "model")


def voice_not_found(voice_id: str, param: str | None = "voice", status: int = 400) -> ApiError:
    return ApiError(status, "voice_not_found",
                    f"Voice '{voice_id}' was not found. List voices with GET /v1/audio/voices.", param)


def take_not_found(take_id: str, param: str | None) -> ApiError:
    return ApiError(400 if param else 404, "take_not_found",
                    f"Take '{take_id}' was not found or has expired.", param)


def too_large(limit: int) -> ApiError:
    return ApiError(413, "request_too_large", f"Request body too large: the limit is {limit} bytes.")


def unsupported_media_type(expected: str, got: str | None) -> ApiError:
    return ApiError(415, "unsupported_media_type",
                    f"Unsupported Content-Type '{got or ''}': expected {expected}.")


def _enumerate(values) -> str:
    quoted = [f"'{v}'" for v in values]
    if len(quoted) <= 1:
        return "".join(quoted)
    if len(quoted) == 2:
        return f"{quoted[0]} and {quoted[1]}"
    return ", ".join(quoted[:-1]) + f", and {quoted[-1]}"


def _validation_to_api_error(exc: RequestValidationError) -> ApiError:
    """FastAPI's own validation (path/query parameters) as a 400 envelope."""
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid_value", "Invalid request.")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = ".".join(loc) or None
    if first.get("type") == "missing" and param:
        return missing(param)
    return ApiError(400, "invalid_value", f"Invalid '{param}': {first.get('msg', 'invalid value')}.", param)


def install_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return _validation_to_api_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            err = ApiError(404, "not_found", f"Unknown route: {request.method} {request.url.path}")
        elif exc.status_code == 405:
            err = ApiError(405, "method_not_allowed",
                           f"Method {request.method} is not allowed on {request.url.path}.")
        else:
            err = ApiError(exc.status_code, None, str(exc.detail))
        err.headers.update(exc.headers or {})
        return err.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return ApiError(500, "internal_error", "The server had an error while processing your request.").response()

"""Every error leaves the server in OpenAI's envelope:
`{"error": {"message", "type", "param", "code"}}`, with the status OpenAI would use.

Bad input is 400 (never FastAPI's 422 shape), an unknown model 404, a missing or wrong API key 401,
a full queue 503 with `Retry-After`. A `ValueError` from the engine is the client's fault by the
engine's contract, so it is a 400 too.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from engine.async_engine import EngineDeadError, RequestFailedError
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
INLINE_BODY_BYTES = 64 * 1024  # larger bodies are parsed on a worker thread, off the event loop
SERVER_ERROR = "server_error"


class APIError(Exception):
    def __init__(self, status_code: int, message: str, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def client_gone() -> APIError:
    """What a route returns to a client that is no longer there (nobody reads it). 499 is
    nginx's "client closed request": the HTTP counter then tells clients that left apart from
    the server's own failures."""
    return APIError(499, "client disconnected")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_value_error(error: ValueError) -> APIError:
    """The engine's range checks start with the offending parameter's name ("top_p must be in
    (0, 1], got 0"); its other messages are about the request as a whole."""
    message = str(error)
    first_word = message.split(" ", 1)[0]
    param = first_word if first_word in SamplingParams.__dataclass_fields__ else None
    return bad_request(message, param)


def from_validation_errors(errors: list[dict]) -> APIError:
    """One pydantic error, named by its field path (`messages.0.role`). For a union, a branch's
    specific complaint ("at most 4 items") beats the other branches' "not a string"."""
    specific = [e for e in errors if not e.get("type", "").endswith("_type")] or errors
    first = specific[0]
    # Union branches appear in the path as type names (`str`, `list[int]`): drop them.
    location = [str(part) for part in first.get("loc", ())
                if isinstance(part, int) or (part.isidentifier() and part not in _TYPE_NAMES)]
    param = ".".join(location) or None
    message = first.get("msg", "invalid value")
    return bad_request(f"{param}: {message}" if param else message, param)


_TYPE_NAMES = {"body", "str", "int", "float", "bool"}


async def parse_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The JSON body validated as `model`; anything else is a 400 in OpenAI's envelope (a body
    declared as something other than JSON, 415)."""
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type and content_type != "application/json" and \
            not content_type.endswith("+json"):
        # As FastAPI's own body parsing: this also keeps web pages from sending a "simple"
        # cross-site POST (text/plain needs no CORS preflight) to a server without a key.
        raise APIError(415, f"the request body must be JSON (Content-Type: application/json), "
                       f"not {content_type}")
    raw = await request.body()
    if len(raw) > INLINE_BODY_BYTES:  # parsing and validating it may take more than a few ms
        return await asyncio.to_thread(_parse, raw, model)
    return _parse(raw, model)


def _parse(raw: bytes, model: type[BaseModel]) -> BaseModel:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except ValueError:  # an integer past Python's digit limit for int()
        raise bad_request("the request body has a number with too many digits") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    _refuse_lone_surrogates(data)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise from_validation_errors(error.errors()) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None


def _refuse_lone_surrogates(data: dict) -> None:
    """JSON may escape half of a UTF-16 pair ("\\ud800"); no tokenizer can encode the result."""
    stack = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            stack.extend((item, f"{path}.{key}" if path else str(key))
                         for key, item in value.items())
            value = "".join(value)  # the keys themselves
        elif isinstance(value, list):
            stack.extend((item, f"{path}.{index}") for index, item in enumerate(value))
            continue
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request(f"{path or 'the request body'}: the text holds a lone UTF-16 "
                                  "surrogate, which is not a character", path or None) from None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request, error: APIError):
        return error.response()

    @app.exception_handler(ValueError)
    async def value_error(_request, error: ValueError):
        return from_value_error(error).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, error: RequestValidationError):
        return from_validation_errors(list(error.errors())).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        message = error.detail if error.status_code != 404 else \
            f"Invalid URL ({request.method} {request.url.path})"
        return APIError(error.status_code, str(message), headers=error.headers).response()

    @app.exception_handler(ClientDisconnect)
    async def client_disconnected(_request, _error: ClientDisconnect):
        # Starlette raises it when the client leaves before its body is complete. Without this
        # handler it reached the catch-all below: a logged traceback and a 500 counted against
        # the server for what the client did (issue 29).
        return client_gone().response()

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_request, error: EngineDeadError):
        return APIError(503, str(error), SERVER_ERROR, code="engine_dead").response()

    @app.exception_handler(RequestFailedError)
    async def request_failed(_request, error: RequestFailedError):
        return APIError(500, f"the request failed: {error}", SERVER_ERROR,
                        code="request_failed").response()

    @app.exception_handler(Exception)
    async def unexpected(_request, error: Exception):
        logger.exception("request failed")
        return APIError(500, f"internal error: {error}", SERVER_ERROR).response()

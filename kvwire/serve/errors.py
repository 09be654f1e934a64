"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, so clients raise their
usual exceptions (openai.BadRequestError, ...) with kvwire's message."""
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..generate.request import RequestError


class APIError(Exception):
    """A request the server refuses (status 4xx) or could not answer (5xx).

    Example:
        >>> raise APIError("temperature must be >= 0, got -1.0", param="temperature")
    """

    def __init__(self, message, param=None, code=None, status=400, type="invalid_request_error", headers=None):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type
        self.headers = dict(headers or {})  # e.g. Retry-After on a 429

    def body(self):
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self):
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def from_request_error(exc):
    """The checks every door shares (`kvwire.generate.request`) refused a request: a 400 with the
    same message as the Python API's, naming the field."""
    return APIError(str(exc), param=exc.param, code=exc.code)


def validation_error(exc):
    """The first of pydantic's complaints about a request body as an `APIError` naming the field."""
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(f"the request body is not valid JSON ({detail} at character {first['loc'][-1]}); "
                        f"expected a JSON object", code="json_invalid")
    # pydantic names the union member it tried ("stop", "list[str]", 0); the client wants the field
    loc = [str(p) for p in first["loc"][1:] if not _type_name(p)]
    number = any(p in ("int", "float", "StrictInt", "StrictFloat") for p in first["loc"])
    param = ".".join(loc) or None
    got = first.get("input")
    shown = f"{got!r:.80}" if not isinstance(got, dict) or len(repr(got)) < 80 else "an object"
    if param is None:
        return APIError(f"the request body must be a JSON object, got {shown}", code="invalid_type")
    if first["type"] == "missing":
        return APIError(f"{param} is required", param=param, code="missing")
    expected = "input should be a number" if number and first["type"].startswith(("int", "float")) else \
        first["msg"][:1].lower() + first["msg"][1:]  # lower-casing all would change a pattern it quotes
    return APIError(f"{param}: {expected}, got {shown}", param=param, code="invalid_type")


def _type_name(part):
    return isinstance(part, str) and ("[" in part or part in _TYPES)


_TYPES = {"str", "int", "float", "bool", "list", "dict", "none", "StrictInt", "StrictFloat"}


ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def document_errors(app: FastAPI):
    """Make the OpenAPI schema say what the server sends: a refused request is a 400 in OpenAI's
    error shape (FastAPI documents its own 422, which this server never sends), and any other
    status (404, 405, 409, 500, 503) has the same shape."""
    make = app.openapi

    def openapi():
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = make()
        spec.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
        for name in ("HTTPValidationError", "ValidationError"):
            spec["components"]["schemas"].pop(name, None)
        error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        for operations in spec.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = {"description": "the request was refused; the message says why", **error}
                responses["default"] = {"description": "an error in OpenAI's shape", **error}
        app.openapi_schema = spec
        return spec

    app.openapi = openapi


def install(app: FastAPI):
    """Answer every refusal (ours, pydantic's, routing's 404/405) in OpenAI's error shape, and say
    so in the OpenAPI schema."""
    document_errors(app)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return from_request_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        message = f"{request.method} {request.url.path}: {exc.detail}"
        code = getattr(exc, "code", None) or str(exc.status_code)
        response = APIError(message, status=exc.status_code, code=code).response()
        response.headers.update(exc.headers or {})  # 405's Allow: the methods the path takes
        return response

"""API keys (`kvwire serve --api-key KEY`): every request must carry `Authorization: Bearer KEY`,
as OpenAI's clients send their `api_key`, except the few pages that hold no data: /health (for load
balancers), the playground page and its files (it asks for the key when an endpoint answers 401),
and the API's documentation pages with the schema they show.

Pure ASGI middleware, like `BodyLimit`: it answers or passes a request before the app reads it, so
streams go through untouched.
"""
import hmac

from .errors import APIError

# GET/HEAD only; every other method, path and prefix needs the key
OPEN_PATHS = frozenset({"/health", "/", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
OPEN_PREFIXES = ("/static/", "/docs-assets/")


def check_keys(keys):
    """The keys as bytes, refusing ones no client can send (empty, with spaces or non-ASCII)."""
    keys = list(keys)
    if not keys:
        raise ValueError("api_keys is empty; expected at least one key (None: no keys, every request is served)")
    for key in keys:
        if not isinstance(key, str) or not key or not key.isascii() or not key.isprintable() or " " in key:
            shown = f"a {type(key).__name__}" if not isinstance(key, str) else f"a key of {len(key)} characters"
            raise ValueError(f"an API key (--api-key, $KVWIRE_API_KEYS) must be a non-empty str of printable ASCII without spaces; "
                             f"got {shown}")
    return [key.encode() for key in keys]


def is_open(method, path):
    if method not in ("GET", "HEAD") or "/.." in path:  # the router never climbs out of a mount; nor do we
        return False
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class APIKeys:
    """ASGI middleware: a request without one of `keys` as its bearer token gets 401 in OpenAI's
    error shape (code "invalid_api_key") with `WWW-Authenticate: Bearer`; open pages pass.

    Args:
        keys: the accepted keys (str); compared in constant time.

    Example:
        >>> app.add_middleware(APIKeys, keys=["sk-local-1", "sk-local-2"])
        >>> # curl -H "Authorization: Bearer sk-local-1" http://127.0.0.1:8000/v1/models
    """

    def __init__(self, app, keys):
        self.app, self.keys = app, check_keys(keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = _route_path(scope)
        if scope["type"] == "http" and is_open(scope["method"], path):
            return await self.app(scope, receive, send)
        given = _bearer(scope)
        if given is not None and self._known(given):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})  # policy violation; no socket here yet
        message = ("incorrect API key provided" if given is not None else
                   "no API key: this server needs one, sent as 'Authorization: Bearer KEY'")
        error = APIError(f"{message} ({scope['method']} {path})", code="invalid_api_key", status=401,
                         headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)

    def _known(self, given):
        # every key compared, each in constant time: how long it takes says nothing of which is close
        found = False
        for key in self.keys:
            found |= hmac.compare_digest(given, key)
        return found


def _bearer(scope):
    """The bearer token of the request's Authorization header (bytes), or None."""
    for name, value in scope["headers"]:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return None


def _route_path(scope):
    """The path routes match (without a proxy's root_path prefix)."""
    path, root = scope["path"], scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


def document_bearer(app):
    """Say in the OpenAPI schema that the API takes a bearer key (Swagger UI then has Authorize)
    and answers 401 without it."""
    make = app.openapi

    def openapi():
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = make()
        spec.setdefault("components", {}).setdefault("securitySchemes", {})["apiKey"] = {
            "type": "http", "scheme": "bearer", "description": "one of the server's --api-key values"}
        spec["security"] = [{"apiKey": []}]
        unauthorized = {"description": "no API key, or a wrong one",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        for path, operations in spec.get("paths", {}).items():
            for method, operation in operations.items():
                if is_open(method.upper(), path):
                    operation["security"] = []
                else:
                    operation.setdefault("responses", {})["401"] = unauthorized
        app.openapi_schema = spec
        return spec

    app.openapi = openapi

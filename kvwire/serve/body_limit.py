"""The request-body limit, as ASGI middleware (the bound itself: `limits.Limits.body_bytes`)."""
from starlette.exceptions import HTTPException

from .errors import APIError
from .limits import FLAGS


class BodyLimit:
    """ASGI middleware: a POST body past `limit` bytes gets 413 in OpenAI's error shape, from its
    Content-Length when sent, else as soon as the bytes read pass the limit (chunked bodies); the
    app never sees it whole, so nothing parses or tokenises it."""

    def __init__(self, app, limit):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send, scope, int(declared))
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # an HTTPException: FastAPI passes it on while reading the body
                    raise TooLarge(self._message(seen, at_least=True))
            return message

        await self.app(scope, counted, send)

    def _message(self, size, at_least=False):
        return (f"the request body is {'at least ' if at_least else ''}{size} bytes; this server takes at most "
                f"{self.limit} ({FLAGS['body_bytes']})")

    async def _refuse(self, send, scope, size):
        error = APIError(self._message(size), code="request_too_large", status=413)
        await error.response()(scope, _nothing, send)


class TooLarge(HTTPException):
    """A body that passed the limit while it was read (errors.install answers it as a 413)."""

    code = "request_too_large"

    def __init__(self, message):
        super().__init__(413, message)


async def _nothing():
    return {"type": "http.disconnect"}

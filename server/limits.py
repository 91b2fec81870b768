"""A cap on request body size (`--max-request-bytes`), enforced before a route reads the body:
a declared `Content-Length` above it is refused at once, a chunked body as soon as it passes it.
Either way the client gets 413 in OpenAI's envelope."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                    "(--max-request-bytes)", code="request_too_large")


class BodySizeLimitMiddleware:
    """A plain ASGI middleware (like the metrics one), so disconnect detection keeps working."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(self.max_bytes).response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise too_large(self.max_bytes)  # answered by the app's APIError handler
            return message

        await self.app(scope, counting_receive, send)

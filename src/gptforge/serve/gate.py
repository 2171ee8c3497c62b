"""The ASGI layer in front of every route of `gptforge serve`: the API key, the drain, the
request-body limit, the request metrics and the last-resort 500.

- With an API key every path needs `Authorization: Bearer KEY` except `/health` (load balancers)
  and, with `--public-metrics`, `/metrics`; 401 otherwise. The comparison takes constant time.
- A body longer than `max_body_bytes` gets 413 without being read: a larger `Content-Length` is
  refused before any byte, and a chunked body is counted as it arrives. The handlers get the
  body from here (at most the limit in memory).
- `gptforge_requests_total{endpoint,status}` is labelled with the route's own path, and every
  path the app does not serve with `other`: a client can add series only by adding status codes.
- An exception no handler answered becomes an OpenAI-shaped 500 (counted, logged once).

A plain ASGI middleware: Starlette's `BaseHTTPMiddleware` would hide the client's disconnect
from the handlers.
"""

from __future__ import annotations

import hmac
import logging

from fastapi.responses import JSONResponse

from gptforge.serve.protocol import APIError

OPEN_PATHS = ("/health",)
OTHER = "other"  # the metrics label of every path no route serves

log = logging.getLogger("gptforge.serve")


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return v
    return None


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole body, or None once it passes `limit` bytes (or the client left)."""
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


class Gate:
    """See the module docstring. `api` is the FastAPI app (its routes name the metrics labels)."""

    def __init__(self, app, state, api):
        self.app, self.state, self.api = app, state, api
        self._routes: set[str] | None = None

    def label(self, path: str) -> str:
        if self._routes is None:
            self._routes = {p for p in (getattr(r, "path", None) for r in self.api.routes) if p}
        return path if path in self._routes else OTHER

    def refusal(self, scope) -> APIError | None:
        """The error a request gets before its body is read, or None."""
        st, path = self.state, scope["path"]
        if st.api_key and path not in OPEN_PATHS and not (path == "/metrics" and st.public_metrics):
            auth = _header(scope, b"authorization") or b""
            if not hmac.compare_digest(auth, f"Bearer {st.api_key}".encode()):
                return APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")
        if st.draining and scope["method"] == "POST" and path.startswith("/v1/"):
            return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        length = _header(scope, b"content-length")
        if length is not None:
            if not length.strip().isdigit():
                return APIError(400, "Content-Length: not a byte count", code="invalid_content_length")
            if int(length) > st.max_body_bytes:
                return _too_large(st.max_body_bytes)
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status: list[int] = []

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            error = self.refusal(scope)
            if error is None:
                body = await _read_body(receive, self.state.max_body_bytes)
                if body is None:
                    error = _too_large(self.state.max_body_bytes)
            if error is not None:
                # 413: close the connection rather than read and drop the rest of a huge body.
                headers = {"connection": "close"} if error.status == 413 else None
                await JSONResponse(error.body(), status_code=error.status, headers=headers)(scope, receive,
                                                                                            counted_send)
                return
            replayed = False

            async def replay():  # the body once, then the client's own events (its disconnect)
                nonlocal replayed
                if replayed:
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            await self.app(scope, replay, counted_send)
        except Exception:
            if status:  # the response had started (a stream): nothing more to send
                raise
            log.exception("gptforge serve: %s %s failed", scope["method"], scope["path"])
            e = APIError(500, "internal server error (logged on the server)", type="server_error")
            await JSONResponse(e.body(), status_code=500)(scope, receive, counted_send)
        finally:
            if scope["path"] != "/metrics" and status:
                self.state.metrics.requests.labels(self.label(scope["path"]), str(status[0])).inc()


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                    "(gptforge serve --max-body-bytes)", code="request_too_large")

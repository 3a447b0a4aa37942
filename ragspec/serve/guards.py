"""What `ragspec serve` checks before a request reaches an endpoint, and at startup.

- Bind: loopback needs no key; any other address does.
- Host (DNS rebinding): a web page whose name is rebound to 127.0.0.1 reaches a loopback server, but its
  requests carry its own name as Host. A keyless server answers only Hosts that are a loopback name with the
  server's port, or a name `serve.allowed_hosts` (`--allow-host`) lists; with an API key the key is the guard.
- CORS: without a key, only the page's own origin: any other would let that site's pages read the corpus.
- JSON only: a POST with another Content-Type is 415 (a cross-site form needs no CORS preflight).
- Body size: over `serve.max_request_bytes` is 413, by Content-Length or counted while reading (chunked bodies
  too), before any endpoint parses a byte.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from urllib.parse import urlsplit

from ragspec.errors import RagspecError
from ragspec.serve.openai_schema import error_body

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def check_bind(host: str, api_key: str | None) -> None:
    """Loopback needs no key; any other address does."""
    if not api_key and not _loopback(host):
        raise RagspecError(f"binding {host} (not loopback) needs --api-key: every /v1 request must then carry "
                           "Authorization: Bearer KEY")


def check_cors(origins: Iterable[str], api_key: str | None, port: int | None = None) -> None:
    """Without a key, `serve.cors_origins` may name only the page's own origin (a loopback name, and `port`
    when known): another site's pages could otherwise read every document."""
    if api_key:
        return
    for origin in origins:
        try:
            parts = urlsplit(origin)
            own = (parts.scheme in ("http", "https") and _loopback(parts.hostname or "")
                   and (port is None or parts.port == port))
        except ValueError:
            own = False
        if not own:
            raise RagspecError(f"serve.cors_origins lists '{origin}', not this server's own page: another site's "
                               "pages could read the corpus through it, so it needs --api-key")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _split_host(value: str) -> tuple[str, str | None]:
    """A Host header → (name, port or None); `[::1]:8000` keeps its brackets."""
    if value.startswith("["):
        end = value.find("]") + 1
        name, rest = value[:end], value[end:]
        return name, (rest[1:] if rest.startswith(":") else None if not rest else "?")
    name, colon, port = value.partition(":")
    return name, port if colon else None


async def _refuse(send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class HostCheck:
    """ASGI middleware: a request whose Host is not this server's own name and port gets 400 and reaches no
    endpoint (`allowed`: more names, any port; `*`: any)."""

    def __init__(self, app, allowed: Iterable[str] = ()):
        self.app, self.allowed = app, {h.lower() for h in allowed}

    def trusted(self, scope) -> bool:
        if "*" in self.allowed:
            return True
        value = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1").strip().lower()
        name, port = _split_host(value)
        if name in self.allowed:
            return True
        server = scope.get("server") or (None, None)
        own = None if server[1] is None else str(server[1])
        return name in LOOPBACK_NAMES and (own is None or port == own or (port is None and own == "80"))

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self.trusted(scope):
            return await self.app(scope, receive, send)
        await _refuse(send, 400, "this server answers only on its own address (a loopback name and its port); "
                                 "start it with --allow-host NAME to be reached by another name", "invalid_host")


class JsonOnly:
    """ASGI middleware: a POST whose Content-Type is not JSON gets 415. A page on another site can send a form
    or text/plain POST without asking first (no CORS preflight); this refuses it whatever FastAPI's own parsing
    allows."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") == "POST":
            kind = dict(scope.get("headers") or []).get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind != b"application/json":
                return await _refuse(send, 415, "a POST body must be JSON (Content-Type: application/json)",
                                     "unsupported_media_type")
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413, by Content-Length or while reading (a
    chunked body is read here, up to the limit, and handed on whole)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._reject(send)
        chunks, total = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # gone before its body arrived: nobody to answer
                return
            chunks.append(msg.get("body", b""))
            total += len(chunks[-1])
            if total > self.limit:
                return await self._reject(send)
            if not msg.get("more_body"):
                break
        whole: dict | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is not None:
                msg, whole = whole, None
                return msg
            return await receive()  # after the body: the disconnect a non-streamed request watches for

        await self.app(scope, replay, send)

    async def _reject(self, send):
        await _refuse(send, 413, f"the request body is larger than {self.limit} bytes", "too_large")

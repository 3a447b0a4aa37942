"""A client of a running `ragspec serve`: `/v1/ask` over the standard library only, so `ragspec ask --server`
answers without importing torch or loading a model (the server holds both, and its tree of earlier prompts)."""

from __future__ import annotations

import http.client
import ipaddress
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from ragspec.errors import RagspecError


class ServerClient:
    """One server's `/v1` endpoints; every failure is a RagspecError of one line that names the server."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0):
        url = url.strip().rstrip("/")
        if url.endswith("/v1"):
            url = url[:-3]
        if "://" not in url:
            url = "http://" + url  # `--server localhost:8000`
        if not url.startswith(("http://", "https://")) or url in ("http://", "https://"):
            raise RagspecError(f"--server must be an http:// or https:// address, not '{url}'")
        self.url = url
        self.api_key = api_key
        self.timeout_s = timeout_s
        # a server on this machine is reached directly, whatever HTTP(S)_PROXY says (a proxy cannot reach it)
        self._opener = urllib.request.build_opener(*([urllib.request.ProxyHandler({})] if _loopback(url) else []))

    def _open(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST")
        req.add_header("Accept", "application/json, text/event-stream")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            return self._opener.open(req, timeout=self.timeout_s)  # http(s) only: checked in __init__
        except urllib.error.HTTPError as exc:
            raise RagspecError(self._http_error(exc)) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise RagspecError(f"no ragspec server answers at {self.url} ({reason}); start one with "
                               "`ragspec serve --index INDEX`, or drop --server to answer here") from None

    def _http_error(self, exc: urllib.error.HTTPError) -> str:
        try:
            message = json.loads(exc.read().decode("utf-8", "replace"))["error"]["message"]
        except Exception:  # noqa: BLE001 - not ragspec's error shape: say the status alone
            message = exc.reason
        if exc.code == 401:
            return f"the server at {self.url} needs its API key: --api-key KEY or RAGSPEC_API_KEY ({message})"
        if exc.code == 503:
            after = exc.headers.get("Retry-After")
            return f"the server at {self.url} is busy: {message}" + (f" (retry after {after} s)" if after else "")
        return f"the server at {self.url} refused the question ({exc.code}): {message}"

    def health(self) -> dict:
        with self._open("/healthz") as r:
            return json.loads(r.read())

    def check_index(self, index: str | Path) -> None:
        """Refuse a question meant for another index than the one the server answers over (told apart by the
        index folder's name: `/healthz` names no location)."""
        served = self.health().get("index") or ""
        if served and served != Path(index).name:
            raise RagspecError(f"the server at {self.url} answers over an index named '{served}', not {index}; "
                               "drop --index, or drop --server to answer here")

    def ask(self, question: str, *, max_tokens: int | None = None, filter=None) -> dict:
        """The Answer JSON (`ragspec ask --json`'s schema)."""
        with self._open("/v1/ask", _body(question, False, max_tokens, filter)) as r:
            return json.loads(r.read())

    def stream(self, question: str, *, max_tokens: int | None = None, filter=None) -> Iterator[tuple[str, dict]]:
        """(event, data) as the server sends them: `sources`, `text`, `citation`, then `done` (the Answer JSON).
        An `error` event is raised as a RagspecError. Leaving the iterator closes the connection, which stops
        the generation on the server."""
        r = self._open("/v1/ask", _body(question, True, max_tokens, filter))
        try:
            event = None
            for raw in r:
                line = raw.decode("utf-8").rstrip("\r\n")
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    if event == "error":
                        raise RagspecError(f"the server at {self.url}: {data['error']['message']}")
                    yield event or "message", data
                    if event == "done":
                        return
            raise RagspecError(f"the server at {self.url} closed the answer before its end")
        except (OSError, http.client.HTTPException) as exc:
            raise RagspecError(f"the connection to the server at {self.url} broke mid-answer ({exc})") from None
        finally:
            r.close()


def _loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _body(question: str, stream: bool, max_tokens: int | None, filter) -> dict:
    body = {"question": question, "stream": stream}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if filter:
        body["filter"] = filter
    return body

"""`ragspec serve`: an OpenAI-compatible HTTP API and a web page over one pipeline (FastAPI + uvicorn).

- One model, shared by every request: up to `generator.parallel` generations run at once, their draft steps
  sharing forwards and their prompts read in chunks between steps (`decoding/step_batcher.py`: continuous
  batching, each answer the same as asked alone); on a backend that cannot batch (llama.cpp) generation queues
  on the model's lock. Retrieval runs concurrently on the request's worker thread.
- Admission: at most 1 + `serve.queue_size` generation requests at once (generating or waiting for a place);
  more get 503 with `Retry-After`. A request's slot is freed when its worker thread is done.
- Cancellation: a client that goes away (or a request past `serve.timeout_s`) sets a flag the worker checks
  between steps; it then closes the pipeline's generator, which frees its place, rows and KV at once.
- Prefix reuse: the pipeline keeps the KV caches of recent generations (`serve.prefix_cache`), so a
  follow-up turn over the same sources prefills only its new turn.
- Security: no endpoint reads a path named by the request (documents by index id only); with an API key set,
  every /v1 endpoint needs `Authorization: Bearer KEY`; without one, only the server's own Host and origin
  (`guards`). Search and documents pass the same admission and timeout as asks; a filter is checked (and
  capped) before a request is admitted; a failure that is the server's own (a model that would not load, a
  bug) is logged whole and answered with one generic line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import (
    HTTPException,  # FastAPI's subclasses it; routing and body parsing raise this one
)

from ragspec import activity
from ragspec.errors import Cancelled, LoadError, RagspecError
from ragspec.index.filters import as_filter
from ragspec.pipeline import CitationEvent, DoneEvent, Pipeline, SourcesEvent, TextEvent
from ragspec.pipeline.answer import source_json
from ragspec.serve.guards import BodyLimit, HostCheck, JsonOnly, check_cors
from ragspec.serve.openai_schema import (
    AskRequest,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ResponseMessage,
    SearchRequest,
    Usage,
    error_body,
)
from ragspec.settings import ServeSettings

STATIC = Path(__file__).resolve().parent / "static"
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
log = logging.getLogger("ragspec.serve")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.headers = status, message, type_, code, headers
        self.param = param


def user_error(exc: BaseException) -> ApiError:
    """What a client is told of an exception: its own mistake (a RagspecError) in full; the server's own (a
    model that would not load, anything unexpected) logged with its traceback and told in one generic line."""
    if isinstance(exc, RagspecError) and not isinstance(exc, LoadError):
        return ApiError(400, str(exc))
    log.error("a request failed: %s", exc, exc_info=exc)
    if isinstance(exc, LoadError):
        return ApiError(503, "the server could not load its model or index; its log says why", "server_error",
                        "load_failed")
    return ApiError(500, "the server failed on this request; its log says why", "server_error", "internal")


class Slot:
    """One admitted request's place: released once, by its worker thread when it ends, or by its response
    when no worker ever started (a streamed response whose first send raised)."""

    def __init__(self, server: Server):
        self.server, self.held, self.working = server, True, False

    def release(self) -> None:
        with self.server._lock:
            if self.held:
                self.held = False
                self.server.admitted -= 1


class EventStream(StreamingResponse):
    """A streamed answer whose generation stops and whose slot is freed when the response ends, however it
    ends (a client gone, a send that raised)."""

    def __init__(self, body, slot: Slot, cancel: threading.Event):
        super().__init__(body, media_type="text/event-stream", headers=STREAM_HEADERS)
        self.slot, self.cancel = slot, cancel

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.cancel.set()
            if not self.slot.working:
                self.slot.release()


class Server:
    """The state behind the app: the pipeline, the admission count and the generation threads."""

    def __init__(self, pipeline: Pipeline, settings: ServeSettings | None = None, *, model_name: str | None = None,
                 api_key: str | None = None, index_label: str = ""):
        self.pipe = pipeline
        self.settings = settings or pipeline.spec.serve
        self.model_name = model_name or pipeline.spec.generator.model
        self.api_key = api_key
        self.index_label = index_label  # as given (never sent back: it names this machine's folders)
        self.capacity = 1 + self.settings.queue_size
        self.admitted = 0
        self.cancelled = 0  # generations stopped early (client gone, timeout)
        self._lock = threading.Lock()
        self.executor = ThreadPoolExecutor(max_workers=self.capacity, thread_name_prefix="ragspec-gen")
        if self.settings.prefix_cache and pipeline.prefix_cache is None:
            pipeline.enable_prefix_cache(self.settings.prefix_cache)

    @property
    def generating(self) -> int:
        """Generations running now (their steps share forwards), 0 before the model is loaded."""
        if getattr(self.pipe, "_model", None) is None:
            return 0
        batcher = self.pipe.step_batcher
        return batcher.generations if batcher is not None else min(self.admitted, 1)

    @property
    def index_name(self) -> str:
        """The served index's folder name: all a client is told of where it lives."""
        return self.pipe.retriever.index.path.name

    # -- admission -------------------------------------------------------------------------------------------
    def admit(self) -> Slot:
        with self._lock:
            if self.admitted >= self.capacity:
                raise ApiError(503, f"the server is busy ({self.admitted} requests in the queue); retry later",
                               "server_busy", "queue_full", {"Retry-After": str(self.settings.retry_after_s)})
            self.admitted += 1
        return Slot(self)

    async def call(self, fn: Callable):
        """`fn()` on a worker thread under the admission limit and `serve.timeout_s` (then 504; the thread
        keeps its slot until it ends): what search and documents run under, as asks do."""
        slot = self.admit()
        slot.working = True
        try:
            fut = asyncio.get_running_loop().run_in_executor(self.executor, fn)
        except BaseException:
            slot.release()
            raise
        fut.add_done_callback(lambda f: (slot.release(), f.cancelled() or f.exception()))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.settings.timeout_s)
        except TimeoutError:
            raise self.timeout() from None
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - told as the client's error or the server's, never verbatim
            raise user_error(exc) from None

    def timeout(self) -> ApiError:
        return ApiError(504, f"the request took longer than {self.settings.timeout_s:g} s", "timeout", "timeout")

    def private(self, answer):
        """The answer as a client may see it: unless `serve.report_reuse`, no count of prompt tokens reused
        from earlier requests (they would tell one client how much of another's recent prompt matches)."""
        if self.settings.report_reuse:
            return answer
        return dataclasses.replace(answer, stats=dataclasses.replace(answer.stats, prefix_reused_tokens=0,
                                                                     cache_reused_tokens=0))

    # -- running a pipeline stream on a worker thread -----------------------------------------------------
    async def events(self, make: Callable[[], Iterator], cancel: threading.Event, slot: Slot) -> AsyncIterator:
        """Items of `make()` (run on a generation thread) as they come. Setting `cancel` (or leaving this
        iterator) stops the worker at its next item and closes the stream, releasing the model. The admission
        `slot` taken by the caller is released when the worker ends. Past `serve.timeout_s`: TimeoutError."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        def put(item):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone (shutdown)
                pass

        def work():
            it = None
            try:
                it = make()
                while True:
                    if cancel.is_set():
                        with self._lock:
                            self.cancelled += 1
                        break
                    try:
                        item = next(it)
                    except StopIteration:
                        break
                    put(item)
            except Cancelled:  # stopped inside a prefill or between decode steps
                with self._lock:
                    self.cancelled += 1
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                put(exc)
            finally:
                if it is not None and hasattr(it, "close"):
                    it.close()  # GeneratorExit inside the pipeline: the model lock is released now
                put(done)

        slot.working = True
        try:
            fut = loop.run_in_executor(self.executor, work)
        except BaseException:
            slot.release()
            raise
        fut.add_done_callback(lambda _: slot.release())
        deadline = time.monotonic() + self.settings.timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                item = await asyncio.wait_for(queue.get(), left)  # TimeoutError past the deadline
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, DoneEvent):
                    item = DoneEvent(self.private(item.answer))
                yield item
        finally:
            cancel.set()

    async def final_answer(self, make: Callable[[], Iterator], cancel: threading.Event, slot: Slot,
                           request: Request):
        """The Answer of a non-streamed request; a client that goes away cancels the generation (499), the
        deadline is a 504, a user error a 400, the server's own a generic 500/503."""
        watcher = asyncio.create_task(self.watch_disconnect(request, cancel))
        answer = None
        try:
            async for ev in self.events(make, cancel, slot):
                if isinstance(ev, DoneEvent):
                    answer = ev.answer
        except TimeoutError:
            raise self.timeout() from None
        except Exception as exc:  # noqa: BLE001 - told as the client's error or the server's, never verbatim
            raise user_error(exc) from None
        finally:
            cancel.set()
            watcher.cancel()
        if answer is None:
            raise ApiError(499, "cancelled", "cancelled")
        return answer

    async def watch_disconnect(self, request: Request, cancel: threading.Event) -> None:
        """For non-streaming requests: set `cancel` when the client goes away."""
        while not cancel.is_set():
            if await request.is_disconnected():
                cancel.set()
                return
            await asyncio.sleep(0.1)

    def check_tokens(self, n: int | None) -> int | None:
        if n is not None and n > self.settings.max_tokens:
            raise ApiError(400, f"max_tokens {n} is over this server's limit of {self.settings.max_tokens}",
                           code="max_tokens")
        return n


def checked_filter(value) -> dict | None:
    """A request's filter parsed and checked (capped) before the request is admitted: a malformed one is a
    400 naming the field."""
    try:
        return as_filter(value)
    except RagspecError as exc:
        raise ApiError(400, str(exc), param="filter") from None


def _sse(data, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (head + f"data: {body}\n\n").encode("utf-8")


def _chat_inputs(req: ChatCompletionRequest, max_messages: int) -> tuple[str, list[dict], str | None]:
    """(question, history, instructions) from chat messages: the last user message is the question, earlier
    user/assistant turns the history, system/developer messages extra instructions."""
    if len(req.messages) > max_messages:
        raise ApiError(400, f"at most {max_messages} messages per request", param="messages")
    try:
        texts = [(m.role, m.text()) for m in req.messages]
    except ValueError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    if texts[-1][0] != "user":
        raise ApiError(400, "the last message must be a user message (the question)", param="messages")
    if not texts[-1][1].strip():
        raise ApiError(400, "the question (the last user message) is empty", param="messages")
    instructions = [t for r, t in texts if r in ("system", "developer") and t.strip()]
    history: list[dict] = []
    for role, text in texts[:-1]:
        if role in ("system", "developer"):
            continue
        if role not in ("user", "assistant"):
            raise ApiError(400, f"messages of role '{role}' are not supported (no tools)", param="messages")
        if history and history[-1]["role"] == role:
            history[-1]["content"] += "\n\n" + text
        elif history or role == "user":  # a conversation starts with a user turn
            history.append({"role": role, "content": text})
    if history and history[-1]["role"] == "user":  # two user turns in a row: fold into the question
        question = history.pop()["content"] + "\n\n" + texts[-1][1]
    else:
        question = texts[-1][1]
    return question, history, "\n\n".join(instructions) or None


def create_app(server: Server) -> FastAPI:
    s = server.settings
    app = FastAPI(title="ragspec", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    check_cors(s.cors_origins, server.api_key)
    if s.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(s.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(JsonOnly)
    app.add_middleware(BodyLimit, limit=s.max_request_bytes)
    if server.api_key is None:  # outermost: a foreign Host reaches nothing, not even the body limit
        app.add_middleware(HostCheck, allowed=s.allowed_hosts)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return JSONResponse(error_body(exc.message, exc.type, exc.code, exc.param), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        return JSONResponse(error_body(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")), param=loc or None),
                            status_code=400)

    @app.exception_handler(Exception)
    async def _failed(_: Request, exc: Exception):
        err = user_error(exc)
        return JSONResponse(error_body(err.message, err.type, err.code), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException):
        kind = ("not_found_error" if exc.status_code == 404 else
                "invalid_request_error" if 400 <= exc.status_code < 500 else "error")
        return JSONResponse(error_body(str(exc.detail), kind),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    def auth(request: Request) -> None:
        if server.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), server.api_key.encode()):
            raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)", "authentication_error",
                           "invalid_api_key", {"WWW-Authenticate": "Bearer"})

    v1 = [Depends(auth)]

    def stream_error(exc: Exception) -> dict:
        err = server.timeout() if isinstance(exc, TimeoutError) else user_error(exc)
        return error_body(err.message, err.type, err.code)

    # -- page and health -------------------------------------------------------------------------------------
    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "model": server.model_name, "index": server.index_name,
                "queued": server.admitted, "capacity": server.capacity, "cancelled": server.cancelled,
                "generating": server.generating,
                "prompt_cache_mb": round(server.pipe.prompt_cache_bytes / 2 ** 20, 1), "auth": server.api_key is not None}

    # -- models, documents, search ---------------------------------------------------------------------------
    @app.get("/v1/models", dependencies=v1)
    async def models():
        return ModelList(data=[ModelCard(id=server.model_name)]).model_dump()

    @app.get("/v1/documents/{document_id}", dependencies=v1)
    async def document(document_id: int):
        if not 0 <= document_id < 2**63:  # SQLite's integer range: a larger id overflowed into a 500
            raise ApiError(404, f"no document {document_id} in this index", "not_found_error", "document_not_found")

        def read():
            index = server.pipe.retriever.index
            try:
                row, text, *_ = index.store.document_full(document_id)
            except (KeyError, TypeError):
                return None
            return {"id": row.id, "path": index.source_path(row.path), "key": row.key, "title": row.title,
                    "text": text}

        doc = await server.call(read)
        if doc is None:
            raise ApiError(404, f"no document {document_id} in this index", "not_found_error", "document_not_found")
        return doc

    @app.post("/v1/search", dependencies=v1)
    async def search(req: SearchRequest):
        flt = checked_filter(req.filter)
        def find():
            with activity.busy("a server search"):  # a calibration job stops meanwhile, as for asks
                return server.pipe.retriever.search(req.query, top_n=req.k, filter=flt)

        hits = await server.call(find)
        return {"index": server.index_name, "query": req.query, "results": [h.as_json() for h in hits]}

    # -- /v1/ask -----------------------------------------------------------------------------------------
    @app.post("/v1/ask", dependencies=v1)
    async def ask(req: AskRequest, request: Request):
        max_new = server.check_tokens(req.max_tokens)
        if len(req.history) >= s.max_messages:
            raise ApiError(400, f"at most {s.max_messages - 1} turns of history per request", param="history")
        history = [t.model_dump() for t in req.history]
        if history and history[0]["role"] != "user":
            raise ApiError(400, "history must start with a user turn", param="history")
        flt = checked_filter(req.filter)
        slot = server.admit()
        cancel = threading.Event()

        def make():
            return server.pipe.stream(req.question, max_new_tokens=max_new, history=history or None,
                                      filter=flt, cancel=cancel)

        if not req.stream:
            answer = await server.final_answer(make, cancel, slot, request)
            return answer.as_json()

        async def body():
            try:
                async for ev in server.events(make, cancel, slot):
                    if isinstance(ev, SourcesEvent):
                        yield _sse({"sources": [source_json(x) for x in ev.sources], "warnings": ev.warnings,
                                    "retrieval_ms": round(ev.retrieval_ms, 3)}, "sources")
                    elif isinstance(ev, TextEvent):
                        yield _sse({"text": ev.text, "tokens": ev.tokens, "copied": ev.copied}, "text")
                    elif isinstance(ev, CitationEvent):
                        yield _sse(ev.citation.as_json(), "citation")
                    elif isinstance(ev, DoneEvent):
                        yield _sse(ev.answer.as_json(), "done")
            except Exception as exc:  # noqa: BLE001 - an error event, never a dropped stream
                yield _sse(stream_error(exc), "error")
            finally:
                cancel.set()

        return EventStream(body(), slot, cancel)

    # -- /v1/chat/completions ------------------------------------------------------------------------------
    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat(req: ChatCompletionRequest, request: Request):
        if req.model not in (server.model_name, "ragspec"):
            raise ApiError(404, f"the model '{req.model}' does not exist here (this server has "
                                f"'{server.model_name}')", code="model_not_found")
        if req.n != 1:
            raise ApiError(400, "only n = 1 is supported", param="n")
        question, history, instructions = _chat_inputs(req, s.max_messages)
        max_new = server.check_tokens(req.max_completion_tokens or req.max_tokens)
        stop = req.stop_list()
        slot = server.admit()
        cancel = threading.Event()
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def make():
            return server.pipe.stream(question, max_new_tokens=max_new, stop=stop or None,
                                      temperature=req.temperature, seed=req.seed, history=history or None,
                                      instructions=instructions, cancel=cancel)

        def usage(answer) -> Usage:
            s = answer.stats
            p, c = s.prompt_tokens, s.new_tokens
            cached = PromptTokensDetails(cached_tokens=s.prefix_reused_tokens + s.cache_reused_tokens)
            return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c, prompt_tokens_details=cached)

        if not req.stream:
            answer = await server.final_answer(make, cancel, slot, request)
            doc = answer.as_json()
            extra = {k: doc[k] for k in ("sources", "citations", "stats", "warnings")}
            return ChatCompletion(
                id=cid, created=created, model=server.model_name,
                choices=[Choice(message=ResponseMessage(content=answer.text),
                                finish_reason=FINISH.get(answer.stats.finish_reason, "stop"))],
                usage=usage(answer), ragspec=extra).model_dump(exclude_none=False)

        def chunk(delta: Delta, finish=None, extra=None, use=None) -> bytes:
            c = ChatCompletionChunk(id=cid, created=created, model=server.model_name,
                                    choices=[ChunkChoice(delta=delta, finish_reason=finish)], usage=use, ragspec=extra)
            return _sse(c.model_dump_json(exclude_none=True))

        async def body():
            try:
                async for ev in server.events(make, cancel, slot):
                    if isinstance(ev, SourcesEvent):
                        yield chunk(Delta(role="assistant", content=""),
                                    extra={"sources": [source_json(x) for x in ev.sources], "warnings": ev.warnings})
                    elif isinstance(ev, TextEvent):
                        if ev.text:
                            yield chunk(Delta(content=ev.text))
                    elif isinstance(ev, CitationEvent):
                        yield chunk(Delta(content=""), extra={"citation": ev.citation.as_json()})
                    elif isinstance(ev, DoneEvent):
                        a = ev.answer
                        yield chunk(Delta(), FINISH.get(a.stats.finish_reason, "stop"),
                                    {"stats": a.stats.as_json(), "citations": [c.as_json() for c in a.citations]},
                                    usage(a))
                yield _sse("[DONE]")
            except Exception as exc:  # noqa: BLE001 - an error chunk, never a dropped stream
                yield _sse(stream_error(exc))
            finally:
                cancel.set()

        return EventStream(body(), slot, cancel)

    return app


def build_server(index: str | Path, spec=None, *, api_key: str | None = None, pipeline: Pipeline | None = None,
                 ) -> Server:
    """A Server over an index and a pipeline spec (path, dict or PipelineSpec); the model loads now."""
    pipe = pipeline or Pipeline(spec, str(index))
    pipe.retriever  # noqa: B018 — open the index now: a bad path fails before the model loads
    pipe.load()
    return Server(pipe, pipe.spec.serve, api_key=api_key, index_label=str(index))


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """uvicorn serving `app` on 127.0.0.1 (a free port by default) in a daemon thread: for tests, examples and
    notebooks. `stop()` shuts it down."""

    def __init__(self, app, port: int | None = None, host: str = "127.0.0.1"):
        import uvicorn

        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

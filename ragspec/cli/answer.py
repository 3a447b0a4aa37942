"""`ragspec ask` and `serve`: answer a question in the terminal (streamed, cited), or serve the API."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import typer

from ragspec.cli.common import run
from ragspec.console import console, quiet_libraries
from ragspec.errors import RagspecError


def ask(
    question: str = typer.Argument(...),
    index_path: Path | None = typer.Option(None, "--index", help="index path (default: the spec's retriever.index)"),
    spec: Path | None = typer.Option(None, "--pipeline", help="pipeline YAML (default: pipelines/default.yaml settings)"),
    as_json: bool = typer.Option(False, "--json", help="print the Answer as one JSON document (schema: docs/pipelines.md)"),
    no_stream: bool = typer.Option(False, "--no-stream", help="print the answer when it is complete"),
    model: str | None = typer.Option(None, "--model", help="override generator.model"),
    method: str | None = typer.Option(None, "--drafting", help="override drafting.method (none|pld|trie|suffix|pldplus-h|pldplus-a|lookahead|ngrammys|auto)"),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens", help="override generator.max_new_tokens"),
    where: list[str] | None = typer.Option(None, "--where", help="metadata filter, repeatable (see `search`)"),
    source_tokens: str | None = typer.Option(None, "--source-tokens", help="override prompt.source_tokens (auto | "
                                                "off | N): cut the sources to N tokens of the windows that bear "
                                                "on the question"),
    source_cache: str | None = typer.Option(None, "--source-cache", help="override generator.source_cache (on | "
                                               "off | auto): reuse each source piece's KV across asks"),
    server: str | None = typer.Option(None, "--server", envvar="RAGSPEC_SERVER",
                                      help="ask a running `ragspec serve` at this URL instead of loading the model "
                                      "here (its index, model and tree of earlier prompts)"),
    api_key: str | None = typer.Option(None, "--api-key", envvar="RAGSPEC_API_KEY",
                                       help="with --server: the server's API key"),
):
    """Answer a question over an index: streamed, copied spans highlighted and cited, sources listed."""

    def body():
        if max_new_tokens is not None and max_new_tokens < 1:
            raise RagspecError(f"--max-new-tokens must be at least 1, not {max_new_tokens}")
        if where:  # a malformed filter is one line now, before an index, a model or a server is reached
            from ragspec.index.filters import as_filter

            as_filter(list(where))
        if server:
            _ask_server(server, api_key, question, index_path, max_new_tokens, where, as_json, no_stream,
                        {"--pipeline": spec, "--model": model, "--drafting": method,
                         "--source-tokens": source_tokens, "--source-cache": source_cache})
            return
        quiet_libraries()
        from ragspec.pipeline import Pipeline
        from ragspec.pipeline.answer import CitationEvent, DoneEvent, SourcesEvent, TextEvent
        from ragspec.spec import load_spec

        data = load_spec(spec).model_dump()
        if model:
            data["generator"]["model"] = model
        if method:
            data["drafting"]["method"] = method
        if max_new_tokens is not None:
            data["generator"]["max_new_tokens"] = max_new_tokens
        if where:
            data["retriever"]["filter"] = list(where)
        if source_tokens is not None:
            from ragspec.settings import parse_source_tokens

            try:
                data["prompt"]["source_tokens"] = parse_source_tokens(source_tokens)
            except RagspecError:
                raise RagspecError(f"--source-tokens must be auto, off or a number of tokens (1 or more), "
                                   f"not '{source_tokens}'") from None
        if source_cache is not None:
            if source_cache not in ("on", "off", "auto"):
                raise RagspecError(f"--source-cache must be on, off or auto, not '{source_cache}'")
            data["generator"]["source_cache"] = source_cache
        changed = (model or method or max_new_tokens is not None or where or source_tokens is not None
                   or source_cache is not None)
        pipe = Pipeline(load_spec(data) if changed else load_spec(spec),
                        str(index_path) if index_path else None)
        with console.status("loading the index and the model…"):
            pipe.retriever  # noqa: B018 — open the index now, so a bad path fails before the model loads
            pipe.load(progress=lambda line: console.print(f"[dim]{line}[/]"))
        from ragspec.console import PrefillProgress, status

        if as_json or no_stream:
            with status("answering…") as spinner:
                answer = pipe.ask(question, on_progress=PrefillProgress(spinner=spinner)).as_json()
            _print_whole(answer, as_json)
            return
        reading = PrefillProgress()

        def events():
            for ev in pipe.stream(question, on_progress=reading):
                if isinstance(ev, SourcesEvent):
                    yield "sources", {"warnings": ev.warnings}
                elif isinstance(ev, TextEvent):
                    yield "text", {"text": ev.text}
                elif isinstance(ev, CitationEvent):
                    yield "citation", ev.citation.as_json()
                elif isinstance(ev, DoneEvent):
                    yield "done", ev.answer.as_json()

        _show_stream(events(), reading.close)

    run(body, busy="ragspec ask")


def _ask_server(url, api_key, question, index_path, max_new_tokens, where, as_json, no_stream, local_only):
    """`ragspec ask --server URL`: the server retrieves and answers; this process only prints (no torch, no
    model), the same output as answering here."""
    from ragspec.console import status
    from ragspec.serve.client import ServerClient

    given = [name for name, value in local_only.items() if value is not None]
    if given:
        raise RagspecError(f"{', '.join(given)} set up a pipeline here; the server at {url} answers with its own "
                           "(start `ragspec serve` with them, or drop --server)")
    client = ServerClient(url, api_key)
    if index_path is not None:
        client.check_index(index_path)
    filter = list(where) if where else None
    if as_json or no_stream:
        with status("answering…"):
            answer = client.ask(question, max_tokens=max_new_tokens, filter=filter)
        _print_whole(answer, as_json, via=client.url)
        return
    with contextlib.ExitStack() as waiting:
        waiting.enter_context(status("waiting for the server…"))
        _show_stream(client.stream(question, max_tokens=max_new_tokens, filter=filter), waiting.close,
                     via=client.url)


def _show_stream(events, before_text, via: str | None = None) -> None:
    """Print a streamed answer, given as (event, JSON) pairs as `/v1/ask` sends them: warnings, then the text
    (copied spans highlighted as their citations arrive), then the sources and the stats line. `before_text()`
    clears what held the screen until the first text (a progress bar, a spinner)."""
    from rich.console import Console

    live = _LiveAnswer(Console(highlight=False, soft_wrap=True))
    answer = None
    try:
        for event, data in events:
            if event == "sources":
                _print_warnings(data["warnings"])
            elif event == "text":
                before_text()
                live.text(data["text"])
            elif event == "citation":
                live.cite(data)
            elif event == "done":
                answer = data
    finally:  # Ctrl-C included: the terminal is left clean (and a server's connection closes: it stops generating)
        before_text()
        live.close()
    _print_sources(answer)
    _print_stats(answer, via=via)


def _print_warnings(warnings) -> None:
    for w in warnings:
        console.print(f"[yellow]warning:[/] {w}")


def _print_whole(answer: dict, as_json: bool, via: str | None = None) -> None:
    """A finished Answer (its JSON): as JSON on stdout, or as text, sources and stats."""
    if as_json:
        sys.stdout.write(json.dumps(answer, ensure_ascii=False, indent=2) + "\n")
        return
    _print_warnings(answer["warnings"])
    _print_answer(answer)
    _print_sources(answer)
    _print_stats(answer, via=via)


class _LiveAnswer:
    """Streams answer text to the terminal; on a terminal, copied spans turn highlighted as they close."""

    def __init__(self, out):
        self.out = out
        self.buf = ""
        self.cites = []
        self.live = None
        self.started = False

    def _start(self) -> None:
        """At the first text (not before: a prefill progress bar may hold the screen until then)."""
        self.started = True
        if self.out.is_terminal:
            from rich.live import Live

            self.live = Live(self._render(), console=self.out, refresh_per_second=12, transient=False)
            self.live.start()

    def _render(self):
        from rich.text import Text

        t = Text(self.buf)
        for c in self.cites:
            t.stylize("bold green", c["answer_start"], c["answer_end"])
        return t

    def text(self, s: str) -> None:
        if not self.started:
            self._start()
        self.buf += s
        if self.live:
            self.live.update(self._render())
        else:
            self.out.file.write(s)
            self.out.file.flush()

    def cite(self, c) -> None:
        self.cites.append(c)
        if self.live:
            self.live.update(self._render())

    def close(self) -> None:
        if self.live:
            self.live.update(self._render())
            self.live.stop()
        elif self.started:
            self.out.file.write("\n")


def _print_answer(answer: dict) -> None:
    from rich.console import Console
    from rich.text import Text

    t = Text(answer["text"])
    for c in answer["citations"]:
        t.stylize("bold green", c["answer_start"], c["answer_end"])
    Console(highlight=False, soft_wrap=True).print(t)


def _print_sources(answer: dict) -> None:
    """The numbered sources of an Answer's JSON (`ragspec ask --json`'s schema), each with its quotes."""
    from rich.console import Console
    from rich.markup import escape

    out = Console(highlight=False, soft_wrap=True)
    out.print()
    out.print("[bold]Sources[/]")
    cited = {}
    for c in answer["citations"]:
        cited.setdefault(c["source"], []).append(c)
    for s in answer["sources"]:
        where = s["path"] + (f"#{s['key']}" if s["key"] else "")
        span = f"lines {s['lines'][0]}–{s['lines'][1]}" if s["lines"] else f"chars {s['start']}–{s['end']}"
        if s["pieces"] != [[s["start"], s["end"]]]:  # cut by the source budget: the ranges that were sent
            span += " (sent chars " + ", ".join(f"{a}–{b}" for a, b in s["pieces"]) + ")"
        n = len(cited.get(s["source"], []))
        quoted = f"[green]{n} quote{'s' if n != 1 else ''}[/]" if n else "[dim]not quoted[/]"
        out.print(f"  [{s['source']}] [cyan]{escape(where)}[/] {span} [dim](score {s['score']:.4f})[/] {quoted}")
    for c in answer["citations"]:
        q = " ".join(c["quote"].split())
        out.print(f"  [dim]└ [{c['source']}] chars {c['start']}–{c['end']}: "
                  f"“{escape(q[:100])}{'…' if len(q) > 100 else ''}”[/]")


def _print_stats(answer: dict, via: str | None = None) -> None:
    from rich.markup import escape

    s = answer["stats"]
    speed = f" · speed-up ≈ {s['speedup_estimate']:.2f}× vs plain decoding" if s["speedup_estimate"] else ""
    reused = []
    if s["prefix_reused_tokens"]:
        reused.append(f"{s['prefix_reused_tokens']} reused from earlier prompts")
    if s["cache_reused_tokens"]:
        reused.append(f"{s['cache_reused_tokens']} from the source cache")
    if s["cache_note"]:
        reused.append(f"source cache: {s['cache_note']}")
    console.print(
        f"[dim]retrieval {s['retrieval_ms']:.0f} ms · prompt {s['prompt_tokens']} tokens, prefill "
        f"{s['prefill_ms']:.0f} ms" + (f" ({'; '.join(reused)})" if reused else "") + " · "
        + f"{s['new_tokens']} tokens in {s['decode_ms'] / 1000:.1f} s ({s['decode_tokens_per_s']:.1f} tok/s, "
        f"{s['mean_accepted']:.2f} tokens/step, drafting {s['drafting']}){speed}"
        + (f" · {s['backend']}/{s['dtype']}" if s["backend"] else "")
        + (f" · answered by {escape(via)}" if via else "") + "[/]"
    )


def serve(
    index_path: Path = typer.Option(..., "--index", help="the index to answer over"),
    spec: Path | None = typer.Option(None, "--pipeline", help="pipeline YAML (its serve: section sets the limits)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to bind; anything but loopback needs --api-key"),
    port: int = typer.Option(8000, "--port"),
    api_key: str | None = typer.Option(None, "--api-key", envvar="RAGSPEC_API_KEY",
                                          help="require Authorization: Bearer KEY on /v1 endpoints"),
    allow_host: list[str] | None = typer.Option(None, "--allow-host", help="without --api-key: another Host name "
                                                "the server answers to besides its loopback names, repeatable "
                                                "('*': any)"),
    executor: str = typer.Option("local", "--executor", help="local | ray (replicas behind Ray Serve's proxy)"),
    replicas: int = typer.Option(1, "--replicas", help="with --executor ray: server replicas, each with its "
                                 "own model"),
    address: str | None = typer.Option(None, "--address", help="with --executor ray: the cluster "
                                          "('auto', 'ray://HOST:10001'); default: start a local Ray"),
):
    """Serve an OpenAI-compatible API (/v1/chat/completions, /v1/ask, /v1/search, …) and a web page at /."""

    def body():
        quiet_libraries()
        try:
            import uvicorn

            from ragspec.serve.app import build_server, create_app
            from ragspec.serve.guards import check_bind, check_cors
        except ImportError as exc:
            raise RagspecError(f"ragspec serve needs the serve extra: pip install 'ragspec[serve]' ({exc})") from None
        from ragspec.spec import load_spec

        check_bind(host, api_key)
        pipeline = load_spec(spec)
        if allow_host:
            data = pipeline.model_dump()
            data["serve"]["allowed_hosts"] = [*data["serve"]["allowed_hosts"], *allow_host]
            pipeline = load_spec(data)
        check_cors(pipeline.serve.cors_origins, api_key, port)
        if executor not in ("local", "ray"):
            raise RagspecError(f"--executor must be local or ray (got '{executor}')")
        if executor == "local" and (replicas != 1 or address is not None):
            raise RagspecError("--replicas and --address go with --executor ray")
        if executor == "ray":
            _serve_on_ray(index_path, pipeline, replicas, host, port, api_key, address)
            return
        sock = _bind(host, port)  # before the model's seconds: a port in use is one line at once
        with sock:
            with console.status("loading the index and the model…"):
                server = build_server(str(index_path), pipeline, api_key=api_key)
            shown = f"[{host}]" if ":" in host else host
            url = f"http://{shown}:{sock.getsockname()[1]}"
            console.print(f"ragspec serving {index_path} with {server.model_name} on {url}/"
                          + (" (API key required)" if api_key else ""))
            console.print(f'[dim]from a terminal: ragspec ask "QUESTION" --server {url}[/]', highlight=False)
            config = uvicorn.Config(create_app(server), host=host, port=port, log_level="warning")
            uvicorn.Server(config).run(sockets=[sock])  # it listens only now: until then a connection is refused

    run(body)


def _bind(host: str, port: int):
    """A socket bound to host:port, not yet listening (uvicorn listens on it once the model is loaded), as uvicorn
    binds (SO_REUSEADDR); a port in use, or an address not of this machine, is one line."""
    import errno
    import socket

    if not 0 <= port <= 65535:
        raise RagspecError(f"--port must be 0 to 65535, not {port}")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise RagspecError(f"{host}:{port} is in use (another server?): stop it, or choose another --port") \
                from None
        raise RagspecError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _serve_on_ray(index_path, spec, replicas, host, port, api_key, address):
    from ragspec.cluster import require_ray

    require_ray()
    from ragspec.cluster import serving

    if replicas < 1:
        raise RagspecError(f"--replicas must be at least 1 (got {replicas})")
    from ragspec.index.reader import Index

    Index(index_path).close()  # a bad path fails here, in one line, before any replica loads a model
    with console.status(f"starting {replicas} Ray Serve replica(s), each loading the index and the model…"):
        url = serving.start(index_path, spec, replicas=replicas, host=host, port=port, api_key=api_key,
                            address=address)
    console.print(f"ragspec serving {index_path} with {spec.generator.model} on {url}/ ({replicas} Ray Serve "
                  "replicas" + (", API key required)" if api_key else ")") + "; Ctrl-C stops")

    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serving.stop()

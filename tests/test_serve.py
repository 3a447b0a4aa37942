"""`ragspec serve` end to end: a real uvicorn server on a free loopback port over a small index (MiniLM) with
SmolLM2. The official `openai` client gets the same text streamed and not, equal to `Pipeline.ask`; /v1/ask
streams its events before the end and its citations slice the documents; 401 without the key; 503 when the
queue is full; a client that goes away frees the model; a follow-up turn reuses the shared prefix's KV cache
with the same answer."""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from serve_util import SPEC, LiveServer, build_test_index, make_pipeline

KEY = "test-key-123"
MODEL = SPEC["generator"]["model"]
QUESTIONS = ["Where does the Danube rise and where does it end?", "How long should the dough be kneaded?"]
FOLLOW_UP = "At what temperature should bread bake?"  # retrieves the same three chunks as QUESTIONS[1]


@pytest.fixture(scope="module")
def smol():
    from ragspec.models.generator import load_generator

    return load_generator("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def index_path(tmp_path_factory, embedder):
    return build_test_index(tmp_path_factory.mktemp("serve"), embedder)


@pytest.fixture(scope="module")
def reference(index_path, embedder, smol):
    """A plain pipeline (no prefix cache) over the same index and model: what the server must match."""
    return make_pipeline(index_path, embedder, *smol)


@pytest.fixture(scope="module")
def live(index_path, embedder, smol, reference):
    from ragspec.serve.app import Server, create_app
    from ragspec.settings import ServeSettings

    pipe = make_pipeline(index_path, embedder, *smol)
    # capacity 1 (queue_size 0): a second request while one generates is refused
    server = Server(pipe, ServeSettings(queue_size=0, timeout_s=120, max_request_bytes=4096, prefix_cache=4,
                                        report_reuse=True),
                    model_name=MODEL, api_key=KEY, index_label=str(index_path))
    srv = LiveServer(create_app(server))
    yield srv, server
    srv.stop()


@pytest.fixture(scope="module")
def answers(reference):
    return {q: reference.ask(q) for q in QUESTIONS}


def headers():
    return {"Authorization": f"Bearer {KEY}"}


def doc_slice(path, start, end) -> str:
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()[start:end]


def wait_idle(live_url: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(f"{live_url}/healthz").json()
        if h["queued"] == 0 or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def test_openai_client_streamed_and_not_equal_pipeline_ask(live, answers):
    from openai import OpenAI

    srv, _ = live
    client = OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    for q in QUESTIONS:
        ref = answers[q]
        done = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=40)
        assert done.choices[0].message.content == ref.text
        assert done.choices[0].finish_reason in ("stop", "length")
        assert done.usage.prompt_tokens == ref.stats.prompt_tokens
        assert done.usage.completion_tokens == ref.stats.new_tokens
        extra = done.model_extra["ragspec"]
        assert extra["citations"] == [c.as_json() for c in ref.citations]
        assert [s["chunk_id"] for s in extra["sources"]] == [s.chunk_id for s in ref.sources]

        parts, citations, usage, finish = [], [], None, None
        for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                                    max_tokens=40, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            ext = (chunk.model_extra or {}).get("ragspec") or {}
            if "citation" in ext:
                citations.append(ext["citation"])
            usage = chunk.usage or usage
        assert "".join(parts) == ref.text
        assert citations == [c.as_json() for c in ref.citations]
        assert finish == done.choices[0].finish_reason and usage.completion_tokens == ref.stats.new_tokens


def test_langchain_chat_openai(live, answers):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    srv, _ = live
    chat = ChatOpenAI(base_url=srv.url + "/v1", api_key=KEY, model=MODEL, max_tokens=40, max_retries=0)
    assert chat.invoke(QUESTIONS[0]).content == answers[QUESTIONS[0]].text


def test_ask_sse_events_arrive_before_the_end_and_citations_slice_documents(live, answers):
    srv, _ = live
    q = QUESTIONS[0]
    events = []  # (arrival time, event, data)
    with httpx.stream("POST", f"{srv.url}/v1/ask", json={"question": q, "stream": True, "max_tokens": 40},
                      headers=headers(), timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                events.append((time.perf_counter(), event, json.loads(line[6:])))
    kinds = [e for _, e, _ in events]
    assert kinds[0] == "sources" and kinds[-1] == "done" and "text" in kinds
    first_text = next(t for t, e, d in events if e == "text" and d["text"])
    assert first_text < events[-1][0] - 0.02, "text should stream before the answer is done"
    final = events[-1][2]
    ref = answers[q]
    assert final["text"] == ref.text == "".join(d["text"] for _, e, d in events if e == "text")
    streamed = [d for _, e, d in events if e == "citation"]
    assert streamed == final["citations"] == [c.as_json() for c in ref.citations]
    assert final["citations"], "this question should quote its source"
    for c in final["citations"]:
        assert doc_slice(c["path"], c["start"], c["end"]) == c["quote"]
        doc = httpx.get(f"{srv.url}/v1/documents/{final['sources'][c['source'] - 1]['document_id']}",
                        headers=headers()).json()
        assert doc["path"] == c["path"] and doc["text"][c["start"] : c["end"]] == c["quote"]
    assert final["stats"]["ttft_ms"] > 0

    plain = httpx.post(f"{srv.url}/v1/ask", json={"question": q, "max_tokens": 40}, headers=headers(), timeout=120)
    assert plain.status_code == 200 and plain.json()["text"] == ref.text


def test_search_models_documents_and_errors(live, index_path):
    srv, _ = live
    r = httpx.post(f"{srv.url}/v1/search", json={"query": "Danube", "k": 2}, headers=headers())
    doc = r.json()
    assert r.status_code == 200 and doc["query"] == "Danube" and len(doc["results"]) == 2
    for h in doc["results"]:
        assert {"rank", "score", "path", "start", "end", "text", "chunk_id", "key", "title", "stages", "document_id",
                "chunk_ids", "locations"} == set(h)
        assert doc_slice(h["path"], h["start"], h["end"]) == h["text"]
    r = httpx.post(f"{srv.url}/v1/search", json={"query": "Danube", "filter": {"path": "sub/*"}}, headers=headers())
    assert r.status_code == 200 and all(h["path"].endswith("sub/bread.rst") for h in r.json()["results"])
    r = httpx.post(f"{srv.url}/v1/search", json={"query": "Danube", "filter": "colour=red"}, headers=headers())
    assert r.status_code == 400 and "unknown filter field 'colour'" in r.json()["error"]["message"]
    assert httpx.get(f"{srv.url}/v1/documents/999999", headers=headers()).status_code == 404
    assert httpx.get(f"{srv.url}/v1/documents/..%2F..%2Fetc%2Fpasswd", headers=headers()).status_code in (400, 404)
    # unauthorised: every /v1 endpoint; the page and the health check stay open
    for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/ask", {"question": "x"}),
                               ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}),
                               ("POST", "/v1/search", {"query": "x"}), ("GET", "/v1/documents/1", None)]:
        r = httpx.request(method, srv.url + path, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        r = httpx.request(method, srv.url + path, json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    health = httpx.get(srv.url + "/healthz")
    assert health.status_code == 200 and health.json()["prompt_cache_mb"] >= 0
    assert "<textarea" in httpx.get(srv.url + "/").text
    # bad requests
    r = httpx.post(f"{srv.url}/v1/chat/completions", headers=headers(),
                   json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{srv.url}/v1/chat/completions", headers=headers(),
                   json={"model": MODEL, "messages": [{"role": "assistant", "content": "hi"}]})
    assert r.status_code == 400 and "last message" in r.json()["error"]["message"]
    r = httpx.post(f"{srv.url}/v1/ask", headers=headers(), json={"question": "x", "max_tokens": 10**6})
    assert r.status_code == 400
    r = httpx.post(f"{srv.url}/v1/ask", headers=headers(), json={"question": "x" * 5000})
    assert r.status_code == 413
    r = httpx.post(f"{srv.url}/v1/ask", headers=headers(), json={"question": "x", "path": "/etc/passwd"})
    assert r.status_code == 400  # unknown keys are refused


# `ragspec ask` as a real process, run so that it says at its exit whether it imported torch
CLI = """
import sys
from ragspec.cli import app
try:
    app(sys.argv[1:], prog_name="ragspec")
finally:
    print("torch imported:", "torch" in sys.modules, file=sys.stderr)
"""


def cli(*args, env=None):
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in ("RAGSPEC_SERVER", "RAGSPEC_API_KEY")}
    return subprocess.run([sys.executable, "-c", CLI, "ask", *args], capture_output=True, text=True,
                          env={**base, "COLUMNS": "200", **(env or {})}, timeout=300)


def test_ask_on_the_command_line_through_the_server(live, answers, index_path):
    """`ragspec ask --server URL` prints what the server answers — the same text and citations as the pipeline
    asked here — without importing torch; what it cannot honour, or a server it cannot use, is one line."""
    srv, _ = live
    q = QUESTIONS[0]
    ref = answers[q]
    wait_idle(srv.url)
    out = cli(q, "--server", srv.url, "--api-key", KEY, "--max-new-tokens", "40", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["text"] == ref.text and doc["citations"] == [c.as_json() for c in ref.citations]
    assert "torch imported: False" in out.stderr
    # streamed (stdout is no terminal: plain text), the server named by the environment, the index checked,
    # a proxy meant for the internet not used for this machine's server
    wait_idle(srv.url)
    out = cli(q, "--index", str(index_path), "--max-new-tokens", "40",  # a proxy set for the internet: bypassed
              env={"RAGSPEC_SERVER": srv.url.removeprefix("http://"), "RAGSPEC_API_KEY": KEY,
                   "HTTP_PROXY": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(ref.text) and "Sources" in out.stdout and "[1]" in out.stdout
    assert f"answered by {srv.url}" in out.stderr and "torch imported: False" in out.stderr
    # a metadata filter travels with the question
    wait_idle(srv.url)
    r = httpx.post(f"{srv.url}/v1/ask", headers=headers(),
                   json={"question": "Where does the Danube rise?", "max_tokens": 8, "filter": {"path": "sub/*"}})
    assert r.status_code == 200 and all(s["path"].endswith("sub/bread.rst") for s in r.json()["sources"])

    def one_error(out, *words):
        errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
        assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
        assert all(w in errors[0] for w in words), errors[0]

    one_error(cli(q, "--server", srv.url), "needs its API key")
    one_error(cli(q, "--server", srv.url, "--api-key", KEY, "--drafting", "pld"), "--drafting", "drop --server")
    one_error(cli(q, "--server", srv.url, "--api-key", KEY, "--index", "/elsewhere/other-index"),
              "answers over an index named 'corpus'")
    one_error(cli(q, "--server", srv.url, "--api-key", KEY, "--where", "colour=red", "--no-stream"),
              "unknown filter field 'colour'")
    one_error(cli(q, "--server", srv.url, "--api-key", KEY, "--where", "colour=red"), "unknown filter field")
    with __import__("socket").socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    one_error(cli(q, "--server", f"http://127.0.0.1:{port}"), "no ragspec server answers", "ragspec serve")


def test_queue_full_gets_503_and_a_disconnected_client_frees_the_model(live, answers):
    srv, server = live
    assert wait_idle(srv.url)["queued"] == 0
    cancelled_before = server.cancelled
    body = {"question": QUESTIONS[1], "stream": True, "max_tokens": 400}
    client = httpx.Client(timeout=120)
    with client.stream("POST", f"{srv.url}/v1/ask", json=body, headers=headers()) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while not next(lines).startswith("event: text"):
            pass
        # the model is busy with this request and the queue holds nothing more: refused
        busy = httpx.post(f"{srv.url}/v1/ask", json={"question": QUESTIONS[0]}, headers=headers())
        assert busy.status_code == 503 and busy.headers["retry-after"] == "2"
        assert busy.json()["error"]["code"] == "queue_full"
    client.close()  # the client goes away mid-answer
    t = time.monotonic()
    h = wait_idle(srv.url)
    assert h["queued"] == 0 and time.monotonic() - t < 20
    assert server.cancelled == cancelled_before + 1, "the generation should stop, not run to its end"
    r = httpx.post(f"{srv.url}/v1/ask", json={"question": QUESTIONS[0], "max_tokens": 40}, headers=headers(), timeout=120)
    assert r.status_code == 200 and r.json()["text"] == answers[QUESTIONS[0]].text


def test_follow_up_reuses_the_prefix_cache_with_the_same_answer(live, reference, embedder, smol, index_path):
    """The first turn's prompt and answer are the follow-up's prefix: only the new turn is prefilled."""
    srv, _ = live
    q1 = QUESTIONS[1]
    first = reference.ask(q1)
    history = [{"role": "user", "content": q1}, {"role": "assistant", "content": first.text}]
    plain = reference.ask(FOLLOW_UP, history=history)  # no prefix cache: the whole prompt is prefilled
    assert [s.chunk_id for s in plain.sources] == [s.chunk_id for s in first.sources]

    reuse = make_pipeline(index_path, embedder, *smol).enable_prefix_cache(4)
    again = reuse.ask(q1)
    assert again.text == first.text
    follow = reuse.ask(FOLLOW_UP, history=history)
    assert follow.text == plain.text and follow.citations == plain.citations
    assert follow.stats.prefix_reused_tokens >= first.stats.prompt_tokens
    assert follow.stats.prefix_reused_tokens < follow.stats.prompt_tokens
    print(f"\nfollow-up TTFT: {plain.stats.ttft_ms:.0f} ms prefilling {plain.stats.prompt_tokens} tokens → "
          f"{follow.stats.ttft_ms:.0f} ms reusing {follow.stats.prefix_reused_tokens} "
          f"(prefill {plain.stats.prefill_ms:.0f} → {follow.stats.prefill_ms:.0f} ms)")

    # the same conversation through the OpenAI endpoint of the server (whose pipeline keeps a prefix cache)
    from openai import OpenAI

    client = OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    msgs = [{"role": "user", "content": q1}]
    a1 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40)
    assert a1.choices[0].message.content == first.text
    msgs += [{"role": "assistant", "content": a1.choices[0].message.content}, {"role": "user", "content": FOLLOW_UP}]
    a2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40)
    assert a2.choices[0].message.content == plain.text
    assert a2.model_extra["ragspec"]["stats"]["prefix_reused_tokens"] >= first.stats.prompt_tokens


def test_bind_rules_and_cli_help():
    from typer.testing import CliRunner

    from ragspec.cli import app
    from ragspec.errors import RagspecError
    from ragspec.serve.guards import check_bind

    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    check_bind("localhost", None)
    check_bind("0.0.0.0", "k")
    with pytest.raises(RagspecError, match="--api-key"):
        check_bind("0.0.0.0", None)
    r = CliRunner().invoke(app, ["serve", "--index", "nowhere", "--host", "0.0.0.0"])
    assert r.exit_code == 2 and "--api-key" in r.output


def test_serve_spec_section_is_validated():
    from ragspec.errors import RagspecError
    from ragspec.spec import load_spec

    assert load_spec({"serve": {"queue_size": 3}}).serve.queue_size == 3
    with pytest.raises(RagspecError, match=r"unknown key 'serve.queue'"):
        load_spec({"serve": {"queue": 3}})


def test_small_load_every_answer_identical_to_asked_alone(index_path, embedder, smol):
    """examples/serve_load.py, cut down: 4 clients, 8 requests (the full run is 16 and 64)."""
    import importlib.util

    from ragspec.serve.app import BackgroundServer, Server, create_app
    from ragspec.settings import ServeSettings

    path = __import__("pathlib").Path(__file__).resolve().parent.parent / "examples" / "serve_load.py"
    spec = importlib.util.spec_from_file_location("serve_load", path)
    load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load)
    pipe = make_pipeline(index_path, embedder, *smol)
    srv = BackgroundServer(create_app(Server(pipe, ServeSettings(queue_size=8), model_name=MODEL)))
    try:
        report = load.run_load(srv.url, MODEL, load.DEFAULT_QUESTIONS, clients=4, requests=8, max_tokens=24)
    finally:
        srv.stop()
    assert report["errors"] == 0, report["error_samples"]
    assert report["completed"] == report["identical"] == 8
    assert report["latency_p95_s"] >= report["latency_p50_s"] > 0 and report["requests_per_s"] > 0
    with pytest.raises(SystemExit, match="loopback"):
        load.run_load("http://10.0.0.1:8000", MODEL, ["q"])


def test_request_past_its_timeout_gets_504_and_stops(index_path, embedder, smol):
    from ragspec.serve.app import BackgroundServer, Server, create_app
    from ragspec.settings import ServeSettings

    server = Server(make_pipeline(index_path, embedder, *smol), ServeSettings(timeout_s=0.05, prefix_cache=0),
                    model_name=MODEL)
    srv = BackgroundServer(create_app(server))
    try:
        r = httpx.post(f"{srv.url}/v1/ask", json={"question": QUESTIONS[0], "max_tokens": 40}, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        events = httpx.post(f"{srv.url}/v1/ask", json={"question": QUESTIONS[0], "stream": True}, timeout=60).text
        assert "event: error" in events and "event: done" not in events
        assert wait_idle(srv.url)["queued"] == 0 and server.cancelled == 2
    finally:
        srv.stop()


def test_the_server_shares_one_source_cache(index_path, embedder, smol, monkeypatch, tmp_path):
    """With generator.source_cache on, a second request over the same sources reuses them: OpenAI's
    usage.prompt_tokens_details.cached_tokens says how many prompt tokens, and the answer is the first's."""
    from openai import OpenAI

    from ragspec.serve.app import Server, create_app
    from ragspec.settings import ServeSettings

    monkeypatch.setenv("RAGSPEC_HOME", str(tmp_path))
    spec = {**SPEC, "generator": {**SPEC["generator"], "source_cache": "on", "source_cache_blend": 0,
                                             "source_cache_disk_mb": 0}}
    server = Server(make_pipeline(index_path, embedder, *smol, spec=spec), ServeSettings(prefix_cache=0, report_reuse=True),
                    model_name=MODEL, index_label=str(index_path))
    srv = LiveServer(create_app(server))
    try:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="none")
        msgs = [{"role": "user", "content": QUESTIONS[0]}]
        first = client.chat.completions.create(model=MODEL, messages=msgs)
        again = client.chat.completions.create(model=MODEL, messages=msgs)
    finally:
        srv.stop()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0.5 * again.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content

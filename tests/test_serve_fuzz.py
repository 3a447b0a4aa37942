"""The HTTP API never answers 500: hypothesis feeds every path and body field of a real `ragspec serve` (uvicorn on
a loopback port, MiniLM index, SmolLM2) random values — huge and negative integers, floats, strings, nested JSON,
missing and unknown keys — and every answer is a success or a 4xx in OpenAI's error shape. Found by hand before:
`GET /v1/documents/99999999999999999999` overflowed SQLite's integer and answered 500."""

from __future__ import annotations

from urllib.parse import quote

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_util import SPEC, LiveServer, build_test_index, make_pipeline

KEY = "fuzz-key"
MODEL = SPEC["generator"]["model"]
OK = {200}
CLIENT_ERRORS = {400, 401, 404, 405, 413, 422}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6)
big_ints = st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**63, 2**64, 10**20, -(10**20)]) | st.integers()
texts = st.text(max_size=60)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "bot", ""])
messages = st.lists(st.fixed_dictionaries({"role": roles}, optional={"content": texts | json_values,
                                                                      "name": texts | json_values}), max_size=4)
fuzz_settings = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


def maybe(**fields):
    """A body whose fields are each present or missing, valid-looking or random."""
    return st.fixed_dictionaries({}, optional=fields).flatmap(
        lambda d: st.dictionaries(st.text(max_size=8), json_values, max_size=2).map(lambda extra: {**extra, **d}))


@pytest.fixture(scope="module")
def live(tmp_path_factory, embedder):
    from ragspec.models.generator import load_generator
    from ragspec.serve.app import Server, create_app
    from ragspec.settings import ServeSettings

    index_path = build_test_index(tmp_path_factory.mktemp("fuzz"), embedder)
    spec = {**SPEC, "generator": {**SPEC["generator"], "max_new_tokens": 4}}
    pipe = make_pipeline(index_path, embedder, *load_generator(MODEL), spec=spec)
    server = Server(pipe, ServeSettings(queue_size=4, timeout_s=60, max_request_bytes=4096, max_tokens=4,
                                        max_messages=4),
                    model_name=MODEL, api_key=KEY, index_label=str(index_path))
    srv = LiveServer(create_app(server))
    yield srv
    srv.stop()


def check(r: httpx.Response) -> None:
    assert r.status_code in OK | CLIENT_ERRORS, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and "type" in err, r.text[:500]


def call(srv, method: str, path: str, body=None, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.request(method, srv.url + path, json=body, headers=headers, timeout=120)


def test_the_overflowing_document_id_is_a_404(live):
    for bad in ["99999999999999999999", str(2**63), "-1", "-99999999999999999999", "1e3", "abc", "%00"]:
        r = call(live, "GET", f"/v1/documents/{bad}")
        check(r)
        assert r.status_code in (400, 404), bad


@fuzz_settings
@given(doc_id=big_ints.map(str) | texts.map(lambda t: quote(t, safe="")).filter(bool),
       key=st.sampled_from([KEY, None, "wrong"]))
def test_documents_path_never_500(live, doc_id, key):
    check(call(live, "GET", f"/v1/documents/{doc_id}", key=key))


@fuzz_settings
@given(body=maybe(query=texts | json_values, k=big_ints | json_values, filter=json_values | texts))
def test_search_body_never_500(live, body):
    check(call(live, "POST", "/v1/search", body))


@fuzz_settings
@given(body=maybe(question=texts | json_values, stream=st.booleans() | json_values,
                  max_tokens=big_ints | json_values,
                  history=st.lists(st.fixed_dictionaries({"role": roles, "content": texts}), max_size=3) | json_values))
def test_ask_body_never_500(live, body):
    check(call(live, "POST", "/v1/ask", body))


@fuzz_settings
@given(body=maybe(model=st.sampled_from([MODEL, "ragspec", "gpt-4o"]) | json_values, messages=messages | json_values,
                  stream=st.booleans() | json_values, max_tokens=big_ints | json_values,
                  max_completion_tokens=big_ints | json_values,
                  temperature=st.floats(allow_nan=False, allow_infinity=False) | json_values,
                  n=big_ints, stop=texts | st.lists(texts, max_size=3) | json_values, seed=big_ints | json_values,
                  stream_options=json_values))
def test_chat_completions_body_never_500(live, body):
    check(call(live, "POST", "/v1/chat/completions", body))


@fuzz_settings
@given(raw=st.binary(max_size=200), path=st.sampled_from(["/v1/ask", "/v1/search", "/v1/chat/completions"]))
def test_raw_bytes_never_500(live, raw, path):
    r = httpx.post(live.url + path, content=raw, headers={"Authorization": f"Bearer {KEY}",
                                                          "Content-Type": "application/json"}, timeout=120)
    check(r)

"""Metadata filters inside the search (FAISS ID selector, BM25 mask) on flat and IVF-PQ indexes built by ragspec:
glob, equality, range, IN, dates, unknown fields; a selective filter still fills top-n; old indexes say to rebuild."""

from __future__ import annotations

import json

import pytest
from conftest import write_corpus
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ragspec.cli import app
from ragspec.errors import RagspecError
from ragspec.index import manifest
from ragspec.index.builder import build_index
from ragspec.index.filters import parse_where
from ragspec.index.reader import Index
from ragspec.retrieve.retriever import Retriever
from ragspec.settings import IndexSettings, RetrieverSettings

ANIMALS = ["fox", "otter", "heron", "badger", "lynx", "beaver", "stork", "marten", "crane", "vole"]
PLACES = ["marsh", "forest", "river bank", "meadow", "mountain", "lake shore", "dune", "glacier", "canyon", "reef"]


def records() -> str:
    """120 JSONL records with distinct texts and a year, a language and a score field."""
    lines = []
    for i in range(120):
        a, p = ANIMALS[i % 10], PLACES[(i * 7 + i // 10) % 10]
        text = (f"Field note {i}: a {a} was seen near the {p} at dawn, hunting for {i % 13 + 2} minutes "
                f"before it disappeared; observer number {i * 31 % 97} wrote it down.")
        lines.append(json.dumps({"_id": f"n{i}", "title": f"note {i}", "text": text, "year": 1990 + i % 30,
                                 "lang": ["en", "de", "fr"][i % 3], "score": i / 10, "tags": ["ignored"]}))
    return "\n".join(lines) + "\n"


SETTINGS = {"flat": IndexSettings(chunk_tokens=64, overlap=8, index_type="flat"),
            "ivfpq": IndexSettings(chunk_tokens=64, overlap=8, index_type="ivfpq")}
PLAIN = {"merge": False, "containment": None}  # one hit per record, so counts are counts of records


@pytest.fixture(scope="module")
def indexes(tmp_path_factory, embedder):
    root = tmp_path_factory.mktemp("filters") / "corpus"
    write_corpus(root, {"notes.jsonl": records(), "tutorial/intro.md": "# Intro\n\nA fox tutorial for beginners.",
                        "tutorial/deep.md": "# Deep\n\nFoxes hunt voles under the snow in winter.",
                        "guide/otters.txt": "Otters float on their backs while they eat."})
    out = {}
    for kind, s in SETTINGS.items():
        build_index(root, root.parent / kind, s, embedder=embedder, show_progress=False,
                    reuse_from=root.parent / "flat" if kind != "flat" else None)
        out[kind] = Index(root.parent / kind)
    assert out["ivfpq"].manifest["faiss"]["kind"] == "ivfpq"
    return out


def fields(idx, hit) -> dict:
    return dict(idx.store.metadata())[hit.document_id]


@pytest.mark.parametrize("kind", ["flat", "ivfpq"])
def test_filters_on_flat_and_ivf(indexes, embedder, kind):
    idx = indexes[kind]
    r = Retriever(idx, RetrieverSettings(top_n=5, **PLAIN), embedder=embedder)
    cases = {
        "glob": ({"path": "tutorial/*"}, lambda f: f["path"].startswith("tutorial/")),
        "equality": ({"lang": "de"}, lambda f: f.get("lang") == "de"),
        "range": ({"year": {"$gte": 2015, "$lt": 2018}}, lambda f: 2015 <= f.get("year", 0) < 2018),
        "in": ({"lang": {"$in": ["fr", "de"]}, "year": {"$lte": 1995}}, lambda f: f.get("lang") in ("fr", "de")
               and f.get("year", 9999) <= 1995),
        "where": (["type=md"], lambda f: f["type"] == "md"),
        "float": ("score>11.5", lambda f: f.get("score", 0) > 11.5),
    }
    for name, (flt, ok) in cases.items():
        for mode in ("hybrid", "dense", "bm25"):
            r.settings = RetrieverSettings(top_n=5, mode=mode, **PLAIN)
            hits = r.search("a fox hunting near the marsh", filter=flt)
            assert hits, (name, mode)
            assert all(ok(fields(idx, h)) for h in hits), (name, mode, [fields(idx, h) for h in hits])
        expected = sum(1 for _, f in idx.store.metadata() if ok(f))
        r.settings = RetrieverSettings(top_n=5, mode="dense", **PLAIN)
        assert len(r.search("a fox hunting near the marsh", filter=flt)) == min(5, expected), name


@pytest.mark.parametrize("kind", ["flat", "ivfpq"])
def test_a_selective_filter_still_fills_top_n(indexes, embedder, kind):
    idx = indexes[kind]
    flt = {"lang": "fr", "year": {"$in": [1992, 1995, 1998, 2001, 2004, 2007]}}  # 12 records
    def keep(f):
        return f.get("lang") == "fr" and f.get("year") in (1992, 1995, 1998, 2001, 2004, 2007)

    allowed = {did for did, f in idx.store.metadata() if keep(f)}
    assert len(allowed) >= 8
    for mode in ("dense", "bm25", "hybrid"):
        r = Retriever(idx, RetrieverSettings(top_k=10, top_n=8, mode=mode, **PLAIN), embedder=embedder)
        q = "an otter was seen near the reef"
        post = [h for h in r.search(q) if h.document_id in allowed]  # what a post-filter of top-10 would keep
        hits = r.search(q, filter=flt)
        assert len(post) < 8 and len(hits) == 8, (mode, len(post), len(hits))
        assert {h.document_id for h in hits} <= allowed


def test_ivf_filter_searches_every_list_when_the_probed_ones_lack_allowed_vectors(indexes, embedder):
    idx = indexes["ivfpq"]
    idx.set_nprobe(1)
    try:
        r = Retriever(idx, RetrieverSettings(top_n=3, mode="dense", **PLAIN), embedder=embedder)
        hits = r.search("otters float on their backs", filter={"path": "tutorial/*"})
        assert len(hits) == 2  # both tutorial documents, wherever their lists are
    finally:
        idx.set_nprobe(idx.manifest["faiss"]["nprobe"])


def test_where_strings_and_errors(indexes, embedder):
    assert parse_where(["path=tutorial/*", "year>=2020"]) == {
        "$and": [{"path": {"$glob": "tutorial/*"}}, {"year": {"$gte": 2020}}]}
    assert parse_where("lang in de, fr") == {"lang": {"$in": ["de", "fr"]}}
    assert parse_where("title!='note 3'") == {"title": {"$ne": "note 3"}}
    r = Retriever(indexes["flat"], RetrieverSettings(top_n=3), embedder=embedder)
    with pytest.raises(RagspecError) as e:
        r.search("fox", filter="yeer>=2020")
    msg = str(e.value)
    assert "\n" not in msg and "unknown filter field 'yeer'" in msg
    for known in ("path", "title", "type", "modified", "key", "year", "lang", "score"):
        assert known in msg
    assert "tags" not in msg  # not a scalar
    with pytest.raises(RagspecError, match="cannot read filter"):
        r.search("fox", filter="year")
    assert r.search("fox", filter={"modified": {"$gte": "2000-01-01"}})
    assert r.search("fox", filter={"modified": {"$lt": "2000-01-01"}}) == []
    assert r.search("fox", filter={"$or": [{"lang": "de"}, {"path": "guide/*"}]})


def test_spec_filter_and_cli(indexes, tmp_path):
    r = Retriever(indexes["flat"], RetrieverSettings(top_n=4, filter=["path=tutorial/*"], **PLAIN))
    assert {h.path.rsplit("/", 2)[-2] for h in r.search("fox")} == {"tutorial"}
    path = str(indexes["flat"].path)
    runner = CliRunner()
    res = runner.invoke(app, ["search", "--index", path, "fox at dawn", "--where", "lang=de", "--where",
                              "year>=2010", "--json", "-k", "3"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert len(doc["results"]) == 3
    for h in doc["results"]:
        assert h["key"] and h["locations"][0]["path"] == h["path"]
    res = runner.invoke(app, ["search", path, "fox", "--where", "colour=red"])  # positional form still works
    assert res.exit_code == 2 and "unknown filter field 'colour'" in res.output and "Traceback" not in res.output


def test_an_old_index_says_in_one_line_to_rebuild(indexes, tmp_path, embedder):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(indexes["flat"].folder, old)
    data = json.loads((old / "manifest.json").read_text())
    data["format_version"] = 1
    data.pop("checksum")
    manifest.write(old, data)
    with pytest.raises(RagspecError) as e:
        Index(old)
    assert "\n" not in str(e.value) and "rebuild it: ragspec index CORPUS --out" in str(e.value)
    res = CliRunner().invoke(app, ["search", str(old), "fox"])
    assert res.exit_code == 2 and "rebuild" in res.output and "Traceback" not in res.output


def test_pipeline_filter_from_the_spec_and_per_question(indexes):
    from ragspec.pipeline import Pipeline

    pipe = Pipeline({"retriever": {"filter": ["lang=de"], **PLAIN}}, str(indexes["flat"].path))
    sources, _ = pipe.retrieve("a fox near the marsh")
    meta = dict(indexes["flat"].store.metadata())
    assert len(sources) == 5 and all(meta[s.document_id].get("lang") == "de" for s in sources)
    sources, _ = pipe.retrieve("a fox near the marsh", filter={"path": "guide/*"})  # per question wins
    assert [s.path.rsplit("/", 2)[-2:] for s in sources] == [["guide", "otters.txt"]]


def test_metadata_survives_an_incremental_rebuild(tmp_path, embedder):
    root = write_corpus(tmp_path / "corpus", {"a.jsonl": '{"_id": "r1", "text": "Otters eat fish.", "year": 2001}\n',
                                              "b.md": "# B\n\nBeavers build dams."})
    s = IndexSettings(chunk_tokens=48, overlap=8)
    build_index(root, tmp_path / "idx", s, embedder=embedder, show_progress=False)
    (root / "c.txt").write_text("Herons stand still in shallow water.")
    again = build_index(root, tmp_path / "idx", s, embedder=embedder, show_progress=False)
    assert again.reused >= 2 and again.embedded == 1
    meta = {f["path"]: f for _, f in Index(tmp_path / "idx").store.metadata()}
    assert meta["a.jsonl"]["year"] == 2001 and meta["a.jsonl"]["type"] == "jsonl" and meta["a.jsonl"]["key"] == "r1"
    assert meta["b.md"]["type"] == "md" and meta["c.txt"]["type"] == "txt"
    hits = Retriever(Index(tmp_path / "idx"), RetrieverSettings(top_n=3), embedder=embedder).search(
        "what do otters eat", filter="year=2001")
    assert [h.key for h in hits] == ["r1"]


# -- hostile filters (issue 90): one line naming the field, never a crash, nothing that scales past the caps --------
OLD_WHERE = r"^\s*([A-Za-z_][\w.\-]*)\s*(>=|<=|!=|==|=|>|<|\s+in\s+)\s*(.*?)\s*$"  # the backtracking regex it replaced
MALFORMED = {
    '{"$and": 1}': ({"$and": 1}, "$and takes a list"),
    "invalid date": ("modified>=2024-02-30", "filter 'modified': '2024-02-30' is not a date"),
    "number past float": ("year>" + "9" * 400, "filter 'year': the number 9999"),
    "past int's digit limit": ("year=" + "1" * 5000, "filter on 'year' is 5,005 characters long"),
    "300,000 spaces": ("a=x" + " " * 300_000 + "y", "filter on 'a' is 300,004 characters long"),
    "nested 300 deep": ("nest", "nested deeper than 8"),
    "$in of 100,000": ({"year": {"$in": list(range(100_000))}}, "filter 'year': $in has 100,000 values"),
    "a list as a bound": ({"year": {"$gt": [1]}}, "filter 'year': $gt takes a string, number"),
    "an unknown operator": ({"year": {"$regex": "x"}}, "filter 'year': unknown operator '$regex'"),
    "too many conditions": ({"$or": [{"year": i} for i in range(100)]}, "more than 64 conditions"),
}


def _malformed(flt):
    if flt == "nest":
        flt = {"year": 1}
        for _ in range(300):
            flt = {"$and": [flt]}
    return flt


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_filter_is_one_line_naming_the_field(indexes, embedder, name):
    flt, words = MALFORMED[name]
    r = Retriever(indexes["flat"], RetrieverSettings(top_n=3), embedder=embedder)
    with pytest.raises(RagspecError) as e:
        r.search("fox", filter=_malformed(flt))
    assert words in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 200, str(e.value)


def test_malformed_where_on_the_command_line_is_one_line(indexes):
    path = str(indexes["flat"].path)
    for name in ("invalid date", "number past float", "past int's digit limit", "300,000 spaces"):
        where, words = MALFORMED[name]
        for args in (["search", "--index", path, "fox"], ["ask", "--index", "/nowhere", "fox"]):
            res = CliRunner().invoke(app, [*args, "--where", where])
            lines = [line for line in res.output.splitlines() if line.strip()]
            assert res.exit_code == 2 and len(lines) == 1 and words in lines[0], res.output[:300]


def test_a_document_value_shaped_like_a_date_but_none_compares_as_text():
    from ragspec.index.filters import as_filter, compile_filter

    keep = compile_filter(as_filter("modified>=2024-01-01"), {"modified"})
    assert keep({"modified": "2024-02-30"}) and not keep({"modified": 10**400}) and keep({"modified": 1.8e9})


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=" \t\nab_.-=<>!in,*'\"0123456789", max_size=30))
def test_the_where_parser_reads_what_the_old_regex_read(expression):
    import re

    m = re.match(OLD_WHERE, expression, re.DOTALL)
    if not m or not m.group(3):
        with pytest.raises(RagspecError):
            parse_where(expression)
        return
    try:
        got = parse_where(expression)
    except RagspecError as e:  # the new caps may refuse what the regex read; nothing else may differ
        assert "too large" in str(e) or "not a date" in str(e)
        return
    from ragspec.index.filters import SYMBOL, _is_glob, _scalar

    field, op, raw = m.group(1), m.group(2).strip(), m.group(3)
    if op == "in":
        expected = {"$in": [_scalar(v.strip()) for v in raw.split(",") if v.strip()]}
    else:
        expected = {"$glob": raw} if op in ("=", "==") and _is_glob(raw) else {SYMBOL[op]: _scalar(raw)}
    assert got == {field: expected}

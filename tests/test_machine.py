"""Backend and dtype chosen per machine (machine/table.py): the choice by shape from a table (pure), the
settings that skip measuring, the real calibration of SmolLM2 (each candidate in a child process) cached and
read back without measuring, a failing or unavailable candidate recorded with why, `ragspec models
--calibrate`, and a pipeline with `generator.backend: auto` answering."""

from __future__ import annotations

import json
import time

import pytest
from conftest import write_corpus
from typer.testing import CliRunner

from ragspec.cli import app
from ragspec.errors import RagspecError
from ragspec.machine import table as machine
from ragspec.machine.table import Candidate, choose, decode_ms_per_token, prefill_s, resolve, table_key
from ragspec.settings import GeneratorSettings

SMOL = "smollm2-135m-instruct"


def row(backend, dtype, prefill_tps, ms):
    return {"backend": backend, "dtype": dtype, "prefill_tps": prefill_tps, "ms": ms}


# fast prefill but slow, flat steps (oneDNN float32 here) against slow prefill and fast steps that grow with n
# (llama.cpp's quantized kernels here); shapes of this machine's measurement
TABLE = {"sizes": [1, 2, 4, 8, 16], "candidates": [
    row("transformers", "float32", 130.0, [150.0, 175.0, 200.0, 245.0, 320.0]),
    {"backend": "transformers", "dtype": "bfloat16", "skipped": "no native bf16 on this CPU"},
    row("llama.cpp", "gguf", 90.0, [37.0, 83.0, 114.0, 242.0, 355.0]),
]}


# -- the choice, a pure function of the table ---------------------------------------------------------------
def test_choose_takes_the_fastest_for_the_shape():
    long = choose(TABLE, 1100, 256, "suffix")
    assert (long.backend, long.dtype) == ("llama.cpp", "gguf")
    assert "1100-token prompt + 256-token answer" in long.reason and "transformers/float32" in long.reason
    short = choose(TABLE, 1100, 8, "suffix")  # prefill dominates: the faster prefill wins
    assert (short.backend, short.dtype) == ("transformers", "float32")
    assert short.predicted_s < choose(TABLE, 1100, 8, backend="llama.cpp").predicted_s


def test_a_warm_source_cache_counts_the_assembly_not_the_prefill():
    """With the source cache on, the prompt costs its measured assembly (CacheBlend's share linear in the
    fraction): a backend whose assembly is cheap and whose steps are fast can win where its prefill lost."""
    tf, skipped, llama = (dict(r) for r in TABLE["candidates"])
    tf |= {"assembled_ms": 700.0, "blended_ms": 4700.0}
    cheap = {"sizes": TABLE["sizes"], "candidates": [tf, skipped, llama | {"assembled_ms": 1000.0}]}
    dear = {"sizes": TABLE["sizes"], "candidates": [tf, skipped, llama | {"assembled_ms": 4000.0}]}
    assert choose(cheap, 1100, 64).backend == "transformers"  # full prefill: the faster prefill wins
    warm = choose(cheap, 1100, 64, blend=0.0)
    assert warm.backend == "llama.cpp" and "from a warm source cache" in warm.reason
    assert choose(dear, 1100, 64, blend=0.0).backend == "transformers"
    assert choose(cheap, 1100, 64, blend=0.5).backend == "transformers"  # llama.cpp applies no CacheBlend
    k = 1024 / machine.CONTEXT  # the warm-store figures are of a CONTEXT-token prompt
    assert prefill_s(tf, 1024, 0.25) == pytest.approx(2.7 * k) and prefill_s(tf, 2048, 0.5) == pytest.approx(9.4 * k)
    assert prefill_s(llama | {"assembled_ms": 1000.0}, 1024, 0.5) == pytest.approx(1.0 * k)  # llama.cpp blends nothing
    assert prefill_s(TABLE["candidates"][0], 1300, 0.5) == pytest.approx(10.0)  # not measured: a full prefill


def test_pldplus_and_set_values_leave_candidates_out():
    assert choose(TABLE, 1100, 256, "pldplus-h").backend == "transformers"
    assert choose(TABLE, 1100, 256, "pldplus-a").backend == "transformers"
    assert choose(TABLE, 1100, 256, "lookahead").backend == "transformers"  # its window needs every row's argmax
    assert choose(TABLE, 1100, 256, "suffix", backend="transformers").dtype == "float32"
    none = choose({"sizes": [1], "candidates": [TABLE["candidates"][1]]}, 1100, 256)
    assert (none.backend, none.dtype) == ("transformers", "float32") and "no candidate" in none.reason


def test_drafting_pays_only_where_t_n_is_flat():
    flat, steep = TABLE["candidates"][0], TABLE["candidates"][2]
    assert decode_ms_per_token(flat, "none") == 150.0 and decode_ms_per_token(steep, "none") == 37.0
    assert decode_ms_per_token(flat, "suffix") < 0.6 * 150.0  # a chain of drafts halves the cost per token
    assert decode_ms_per_token(steep, "suffix") == 37.0  # every bigger step costs more than it yields


def test_settings_that_need_no_measurement():
    cpu = GeneratorSettings(model=SMOL, backend="llama.cpp")
    assert resolve(cpu, "cpu", 1000, 32, "suffix")[:2] == ("llama.cpp", "gguf")
    assert resolve(GeneratorSettings(model=SMOL, backend="auto", dtype="float32"), "cpu", 1000, 32, "suffix")[:2] == \
        ("transformers", "float32")
    assert resolve(GeneratorSettings(model=SMOL, backend="auto"), "cuda", 1000, 32, "suffix")[:2] == \
        ("transformers", "bfloat16")
    cpu_here = machine.cpu_info()
    runnable = [c.name for c in machine.CANDIDATES if c.backend == "transformers" and not c.needs(cpu_here, SMOL)]
    if runnable == ["transformers/float32"]:  # transformers + dtype auto: float32 the only candidate, taken as is
        c = resolve(GeneratorSettings(model=SMOL, backend="transformers"), "cpu", 1000, 32, "suffix")
        assert c[:2] == ("transformers", "float32") and "only candidate" in c.reason
        pld = resolve(GeneratorSettings(model=SMOL, backend="auto"), "cpu", 1000, 32, "pldplus-h")
        assert pld[:2] == ("transformers", "float32") and "PLD+" in pld.reason


ZEN3 = {"model": "AMD EPYC 7B13", "flags": ["avx2"], "threads": 2, "cores": 2, "flags_hash": "x"}
ZEN4 = ZEN3 | {"flags": ["avx2", "avx512f", "avx512_bf16", "avx512_vnni"]}


def test_guess_follows_the_flags():
    by = {c.name: c for c in machine.CANDIDATES}
    pool = list(machine.CANDIDATES)
    no_gguf = [c for c in pool if c.dtype != "gguf"]  # no C++ compiler builds the kernels
    assert machine.guess(pool, ZEN4).name == "transformers/gguf"
    assert machine.guess(no_gguf, ZEN4).name == "transformers/int8"
    assert machine.guess(no_gguf, ZEN4 | {"flags": ["avx2", "avx512_bf16"]}).name == "transformers/bfloat16"
    assert machine.guess(pool, ZEN3).name == "transformers/gguf"  # AVX2 and a compiler: measured fastest there too
    assert machine.guess(no_gguf, ZEN3).name == "transformers/float32"
    assert machine.guess([by["llama.cpp/gguf"], by["transformers/gguf"]], ZEN3).name == "transformers/gguf"


def test_calibrate_off_takes_the_guess_and_measures_nothing(tmp_path, monkeypatch):
    """RAGSPEC_CALIBRATE=off: no table here, so the flag-based guess is taken, nothing is measured, no job is
    started and no table is written; a value it does not know is one error naming the three it does."""
    from ragspec.machine import launch

    pool = pool_here()
    if len(pool) < 2:
        pytest.skip("one candidate here: nothing to guess between")
    monkeypatch.setenv("RAGSPEC_CALIBRATE", "off")
    started = set(launch._started)
    lines = []
    c = resolve(GeneratorSettings(model=SMOL), "cpu", 1000, 32, "suffix", progress=lines.append, cache_dir=tmp_path)
    guessed = machine.guess(pool, machine.cpu_info())
    assert c.guessed and c[:2] == (guessed.backend, guessed.dtype) and "RAGSPEC_CALIBRATE=off" in c.reason
    assert launch._started == started and not lines and not any(tmp_path.rglob("*.json"))
    monkeypatch.setenv("RAGSPEC_CALIBRATE", "later")
    with pytest.raises(RagspecError, match="'later' is not one of background, foreground, off"):
        resolve(GeneratorSettings(model=SMOL), "cpu", 1000, 32, "suffix", cache_dir=tmp_path)


def test_key_names_the_cpu_and_changes_with_threads():
    import torch

    cpu = machine.cpu_info()
    assert cpu["threads"] == torch.get_num_threads() and cpu["cores"] >= 1 and cpu["model"]
    assert set(cpu["flags"]) <= set(machine.FLAGS)
    key = table_key(SMOL, cpu)
    assert cpu["flags_hash"] in key and f"t{cpu['threads']}" in key
    assert table_key(SMOL, cpu | {"threads": cpu["threads"] + 1}) != key
    assert table_key(SMOL, cpu | {"flags_hash": "00000000"}) != key
    assert table_key("qwen2.5-coder-0.5b-instruct", cpu) != key


def test_matmul_ceilings():
    mm = machine.matmul_ceilings()
    assert mm["shape"] == [1024, 896, 4864] and mm["float32"] > 1
    assert ("bfloat16" in mm) == machine.native_bf16()  # measured only on native bf16
    assert "int8" in mm or "int8" in mm["skipped"]


# -- the real calibration -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A fresh RAGSPEC_HOME (no calibration yet) whose models/ links to the converted models already cached."""
    from ragspec.models.gguf_cache import cache_dir, ensure_converted
    from ragspec.models.registry import lookup

    real = ensure_converted(lookup(SMOL))  # in the usual home; converted once
    root = tmp_path_factory.mktemp("home")
    (root / "models").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAGSPEC_HOME", str(root))
        (root / "models" / cache_dir(lookup(SMOL)).name).symlink_to(real)
        yield root


@pytest.fixture(scope="module")
def table(home):
    lines = []
    t = time.perf_counter()
    table = machine.machine_table(SMOL, progress=lines.append)
    return table, lines, time.perf_counter() - t


def test_calibration_measures_each_candidate_once_then_reads_the_cache(home, table):
    from ragspec.runtime.llama_cpp_model import available

    tab, lines, _ = table
    path = machine.table_path(SMOL)
    assert path.parent == home / "calibration" and path.exists()
    rows = {(r["backend"], r["dtype"]): r for r in tab["candidates"]}
    gguf_runs = "prefill_tps" in rows["transformers", "gguf"]
    measured = rows["transformers", "gguf" if gguf_runs else "float32"]
    assert measured["prefill_tps"] > 0 and len(measured["ms"]) == len(machine.SIZES)
    assert measured["ms"] == sorted(measured["ms"]) and 0 < measured["cpu_share"] <= 1.5 and measured["cpu_s"] > 0
    # a warm source store's assembly of the same prompt, first-k only and with CacheBlend's fraction
    assert 0 < measured["assembled_ms"] < measured["prefill_ms"] and measured["assembled_ms"] < measured["blended_ms"]
    if gguf_runs:  # the dtypes gguf dominates are never measured, and the table says by which rule
        for dtype in ("float32", "bfloat16", "int8"):
            r = rows["transformers", dtype]
            assert "prefill_tps" not in r and ("transformers/gguf runs here" in r.get("ruled_out", "")
                                               or "skipped" in r)
        assert any("float32: not measured (transformers/gguf runs here" in line for line in lines)
    if available() is None:
        llama = rows["llama.cpp", "gguf"]
        assert llama["prefill_tps"] > 0 and "assembled_ms" not in llama  # its warm store counts as a prefill
    else:
        assert rows["llama.cpp", "gguf"]["skipped"] == available()
    if not machine.native_bf16():
        assert "no native bf16" in rows["transformers", "bfloat16"]["skipped"]
    assert len(lines) >= len(machine.CANDIDATES)  # one progress line per candidate at least
    # the second call reads the file: nothing measured, nothing written
    stamp = path.stat().st_mtime_ns
    t = time.perf_counter()
    again = machine.machine_table(SMOL, progress=lines.append)
    assert time.perf_counter() - t < 2.0 and again == tab and path.stat().st_mtime_ns == stamp
    assert len(lines) == len(table[1])  # no progress: no candidate was measured
    assert json.loads(path.read_text())["cpu"] == machine.cpu_info()


def test_unavailable_and_failing_candidates_are_recorded_with_why(home):
    from ragspec.models.gguf_cache import cache_dir
    from ragspec.models.registry import lookup

    folder = str(home / "models" / cache_dir(lookup(SMOL)).name)  # an HF folder: no GGUF for llama.cpp
    broken = Candidate("transformers", "int3", lambda cpu, model: None)  # the child fails to load it
    llama = next(c for c in machine.CANDIDATES if c.backend == "llama.cpp")
    tab = machine.machine_table(folder, candidates=(llama, broken), cache_dir=home / "other")
    skipped, failed = tab["candidates"]
    assert "has no GGUF" in skipped["skipped"] and "prefill_tps" not in skipped
    assert "int3" in failed["error"] and "prefill_tps" not in failed
    assert choose(tab, 1000, 100).reason.startswith("no candidate")


def test_processes_starting_together_calibrate_once(tmp_path):
    """One calibration per machine at a time: a second caller waits for the first's table and reads it, so both
    choose from the same figures (two server replicas once chose different dtypes from their own runs)."""
    import threading

    calls, lines = [], []

    def slow(cpu, model):
        calls.append(model)
        time.sleep(1.0)
        return "not here"

    cands = (Candidate("transformers", "float32", slow),)
    out = [None, None]

    def run(i):
        out[i] = machine.machine_table(SMOL, candidates=cands, cache_dir=tmp_path, progress=lines.append)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    threads[0].start()
    time.sleep(0.3)
    threads[1].start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and out[0] == out[1]
    assert any("waiting for its table" in line for line in lines)


def test_models_calibrate_prints_the_table(home, table):
    r = CliRunner().invoke(app, ["models", "--calibrate", "--model", SMOL])
    assert r.exit_code == 0, r.output
    out = r.output
    assert "CPU:" in out and "matmul 1024×896×4864 GFLOP/s: float32" in out
    assert "transformers/float32" in out and "prefill tok/s" in out and "cached" in out
    assert out.count("auto picks") == 5 and "1100-token prompt + 256-token answer" in out
    assert "with the source cache on (warm, blend 0.5) auto picks transformers" in " ".join(out.split())
    assert "what a pipeline plans for" in out
    bad = CliRunner().invoke(app, ["models", "--calibrate", "--model", "no/such-model-here"])
    assert bad.exit_code == 2 and "not an embedded generator" in bad.output
    assert CliRunner().invoke(app, ["models", "--force"]).exit_code == 2


def test_pipeline_with_backend_auto_chooses_and_answers(home, table, tmp_path, embedder):
    from ragspec.index.builder import build_index
    from ragspec.pipeline import Pipeline
    from ragspec.retrieve.retriever import Retriever
    from ragspec.settings import IndexSettings, RetrieverSettings

    corpus = write_corpus(tmp_path / "corpus")
    build_index(corpus, tmp_path / "ix", IndexSettings(chunk_tokens=48, overlap=8), embedder=embedder,
                show_progress=False)
    spec = {"retriever": {"top_n": 3}, "generator": {"model": SMOL, "backend": "auto", "max_new_tokens": 16},
            "drafting": {"method": "suffix", "budget": 16}}
    pipe = Pipeline(spec, Retriever(str(tmp_path / "ix"), RetrieverSettings(top_n=3), embedder=embedder)).load()
    assert pipe.expected_answer_tokens() == 16  # the cap, under machine.EXPECTED_ANSWER_TOKENS
    expected = choose(table[0], pipe.expected_prompt_tokens(), 16, "suffix")
    assert pipe.choice == expected
    answer = pipe.ask("Where does the Danube rise?")
    assert answer.text and answer.stats.new_tokens > 0
    assert (answer.stats.backend, answer.stats.dtype) == pipe.choice[:2]
    plus = Pipeline({**spec, "drafting": {"method": "pldplus-h", "budget": 16}}, pipe.retriever).load()
    assert plus.choice.backend == "transformers"  # PLD+ needs what only transformers gives
    with pytest.raises(RagspecError, match="hidden states"):
        Pipeline({**spec, "generator": {**spec["generator"], "backend": "llama.cpp"},
                  "drafting": {"method": "pldplus-a"}}, pipe.retriever).load()


# -- a new machine: a guess now, the measurement in the background --------------------------------------------
def pool_here(backend: str = "transformers"):
    cpu = machine.cpu_info()
    return [c for c in machine.CANDIDATES if backend in ("auto", c.backend) and c.needs(cpu, SMOL) is None]


def test_a_new_machine_answers_on_a_guess_and_switches_once_measured(tmp_path, monkeypatch, embedder):
    """No table: the pipeline loads the flag-based guess at once (nothing measured in the foreground) and says
    the measurement runs in the background; when the table appears it loads what the table prefers, between
    asks. (The job is marked started for this process so that no real calibration runs beside the tests; the
    job itself is tested below.)"""
    from ragspec.index.builder import build_index
    from ragspec.machine import launch
    from ragspec.pipeline import Pipeline
    from ragspec.pipeline import loading as pipeline
    from ragspec.retrieve.retriever import Retriever
    from ragspec.settings import IndexSettings, RetrieverSettings

    pool = pool_here()
    if len(pool) < 2:
        pytest.skip("one candidate here: nothing to guess between")
    from ragspec.models.gguf_cache import cache_dir, ensure_converted
    from ragspec.models.registry import lookup
    from ragspec.paths import ragspec_home

    real = ensure_converted(lookup(SMOL))  # in the usual home; converted once
    kernels = ragspec_home() / "kernels"
    monkeypatch.setenv("RAGSPEC_CALIBRATE", "background")
    monkeypatch.setenv("RAGSPEC_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "models").mkdir(parents=True)
    (tmp_path / "home" / "models" / cache_dir(lookup(SMOL)).name).symlink_to(real)
    kernels.mkdir(parents=True, exist_ok=True)  # a gguf guess loads the kernels built in the usual home
    (tmp_path / "home" / "kernels").symlink_to(kernels)
    path = machine.table_path(SMOL)
    launch._started.add(str(path))
    corpus = write_corpus(tmp_path / "corpus")
    build_index(corpus, tmp_path / "ix", IndexSettings(chunk_tokens=48, overlap=8), embedder=embedder,
                show_progress=False)
    spec = {"retriever": {"top_n": 3}, "generator": {"model": SMOL, "max_new_tokens": 12},
            "drafting": {"method": "suffix", "budget": 16}}
    lines = []
    t = time.perf_counter()
    pipe = Pipeline(spec, Retriever(str(tmp_path / "ix"), RetrieverSettings(top_n=3), embedder=embedder))
    pipe.load(progress=lines.append)
    guessed = machine.guess(pool, machine.cpu_info())
    assert pipe.choice.guessed and pipe.choice[:2] == (guessed.backend, guessed.dtype)
    assert "first guess from the CPU flags" in pipe.choice.reason and not path.exists()
    first = pipe.ask("Where does the Danube rise?")
    assert first.text and (first.stats.backend, first.stats.dtype) == pipe.choice[:2]
    # the background job's table arrives, preferring another candidate: the next ask runs on it
    other = next(c for c in pool if c is not guessed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"sizes": [1, 2, 4, 8, 16], "contended": [], "candidates": [
        row(c.backend, c.dtype, 1000.0 if c is other else 10.0, [10.0, 11, 12, 13, 14]) for c in pool]}))
    monkeypatch.setattr(pipeline, "GUESS_RECHECK_S", 0.0)
    second = pipe.ask("Where does the Danube rise?")
    assert not pipe.choice.guessed and pipe.choice[:2] == (other.backend, other.dtype)
    assert (second.stats.backend, second.stats.dtype) == (other.backend, other.dtype) and second.text
    assert time.perf_counter() - t < 300


def test_the_background_job_waits_for_quiet_then_writes_the_table(tmp_path):
    """The detached job, started for a model none of whose candidates can run (each fails or is skipped in
    seconds), writes its table and log; a second start in the same process is a no-op."""
    from ragspec.machine import job as calibration_job
    from ragspec.machine import launch

    share = calibration_job.busy_share(0.2)
    assert share is None or 0.0 <= share <= 1.0
    bogus = str(tmp_path / "no-model-here")
    path = machine.table_path(bogus, tmp_path)
    log = launch.start(bogus, path, tmp_path, wait_s=0)
    assert log is not None and launch.start(bogus, path, tmp_path, wait_s=0) is None
    deadline = time.time() + 240
    while not path.exists() and time.time() < deadline:
        time.sleep(0.5)
    tab = json.loads(path.read_text())
    assert all("prefill_tps" not in r for r in tab["candidates"]) and tab["contended"] == []
    text = log.read_text()
    assert "calibrating" in text and "table written" in text


def test_a_contended_table_is_measured_again_three_tries_at_most(tmp_path, monkeypatch):
    """A table measured beside another job is used and measured again in the background; a job that finds the
    machine still busy leaves it and counts a try; after TRIES no pipeline starts another job for it, and a job
    whose table another process measured quietly meanwhile reads that one instead of measuring."""
    from ragspec.machine import job as calibration_job
    from ragspec.machine import launch

    pool = pool_here("auto")
    if len(pool) < 2:
        pytest.skip("one candidate here: no table is read")
    monkeypatch.setenv("RAGSPEC_CALIBRATE", "background")  # the default (the suite runs with off)
    path = machine.table_path(SMOL, tmp_path)
    rows = [row(c.backend, c.dtype, 100.0, [10.0, 11, 12, 13, 14]) | {"cpu_share": 0.5} for c in pool]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"sizes": [1, 2, 4, 8, 16], "contended": ["transformers/float32"], "tries": 1,
                               "candidates": rows}))
    started = []
    monkeypatch.setattr(launch, "start", lambda *a, **k: started.append(k) or tmp_path / "job.log")
    settings = GeneratorSettings(model=SMOL, backend="auto")
    lines = []
    choice = resolve(settings, "cpu", 400, 32, "suffix", progress=lines.append, cache_dir=tmp_path)
    assert not choice.guessed and started == [{"again": True}]  # used, and a job measures it again
    assert "measured beside another job: measuring again" in lines[0]

    # the jobs find the machine busy (no wait at all here): the table stays, each counts a try
    for tries in (2, 3):
        table = calibration_job.run(SMOL, tmp_path, again=True, wait_s=0)
        assert table["tries"] == tries and json.loads(path.read_text())["tries"] == tries
        assert table["candidates"] == rows  # nothing measured
    started.clear()
    resolve(settings, "cpu", 400, 32, "suffix", progress=lines.append, cache_dir=tmp_path)
    assert started == []  # kept after three tries

    # another process measured it quietly meanwhile: a job asked to measure again reads that table
    quiet = json.loads(path.read_text()) | {"contended": [], "tries": 1}
    path.write_text(json.dumps(quiet))
    assert machine.machine_table(SMOL, cache_dir=tmp_path, again=True) == quiet


def test_measuring_again_keeps_each_candidates_least_disturbed_figures(tmp_path, monkeypatch):
    """A try that finds the machine busier than the last keeps the last try's figures for that candidate: a
    contended table measured again never gets worse. (The measurement is stubbed with the share of its cores
    each try got: here the merge is under test, not the timing, which test_static_verifier measures beside real
    spinning processes.)"""
    pool = [c for c in pool_here("auto") if c.dtype != "gguf"]  # with gguf the other dtypes are ruled out
    if len(pool) < 2:
        pytest.skip("one candidate here")
    path = machine.table_path(SMOL, tmp_path, candidates=pool)
    path.parent.mkdir(parents=True, exist_ok=True)
    shares = [0.95, 0.5] + [0.5] * (len(pool) - 2)  # the first was measured quietly, the others were not
    before = [row(c.backend, c.dtype, 100.0, [10.0, 11, 12, 13, 14]) | {"cpu_share": s} for c, s in zip(pool, shares)]
    path.write_text(json.dumps({"sizes": [1, 2, 4, 8, 16], "contended": [c.name for c in pool[1:]], "tries": 1,
                               "candidates": before}))
    now = {pool[0].name: 0.6, pool[1].name: 0.8}  # busier than the last try for the first, quieter for the second
    monkeypatch.setattr(machine, "run_child", lambda model, backend, dtype, threads, say: {
        "prefill_tps": 50.0, "ms": [20.0, 21, 22, 23, 24], "cpu_share": now.get(f"{backend}/{dtype}", 0.4)})
    lines = []
    table = machine.machine_table(SMOL, cache_dir=tmp_path, again=True, progress=lines.append, candidates=pool)
    got = {(r["backend"], r["dtype"]): r for r in table["candidates"]}
    first, second = got[(pool[0].backend, pool[0].dtype)], got[(pool[1].backend, pool[1].dtype)]
    assert (first["cpu_share"], first["prefill_tps"]) == (0.95, 100.0)  # kept
    assert (second["cpu_share"], second["prefill_tps"]) == (0.8, 50.0)  # measured again, quieter
    assert table["tries"] == 2 and pool[0].name not in table["contended"]
    assert any("keeping the last try's figures" in line for line in lines)

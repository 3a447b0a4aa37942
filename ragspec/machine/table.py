"""Which backend and dtype run a generator fastest on this machine — measured (guessed from the flags only until
the measurement is done).

The CPU's SIMD flags decide which kernels exist: without native bf16 (AVX-512 BF16 or AMX) a bfloat16 model
runs on slow emulation, and llama.cpp's quantized GGUF kernels can beat PyTorch's float32 on decoding while
losing on prefill, or the reverse. So `generator.backend: auto` / `dtype: auto` measure each candidate once
per machine (CPU model, flags, threads): prefill tok/s over a 512-token prompt and t(1)…t(16), one forward
of n tokens over a 512-token cache. The table is cached as JSON beside the draft budget's t(n) tables and
`choose` picks, for an ask's shape, the candidate with the least predicted time.

Each candidate is measured in a child process: a native build that dies (SIGILL on a CPU it was not built
for) or runs out of memory costs that candidate, recorded with why, never the caller. A pipeline on a machine
with no table yet does not wait for it: it takes `guess` (from the CPU flags) and the table is measured by a
detached job once the machine is quiet (`machine/job.py`); `RAGSPEC_CALIBRATE=foreground` measures first,
`off` keeps the guess and measures nothing.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ragspec.cpu_flags import flags_hash, read_cpuinfo
from ragspec.errors import RagspecError
from ragspec.machine.measure import BLEND, CONTEXT, SIZES, run_child
from ragspec.paths import ragspec_home, read_json, write_json
from ragspec.runtime.options import current_options

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")
NATIVE_INT8 = ("avx512_vnni", "avx_vnni", "amx_int8")
MATMUL = (1024, 896, 4864)  # M×K×N: a 1,024-token prefill through Qwen2.5-0.5B's MLP up-projection
# Drafting: each draft token is accepted with this chance once its parent is (geometric, so a step of k
# drafts yields (1 - ACCEPT^(k+1)) / (1 - ACCEPT) tokens; 0.7 gives the ~3 tokens a step suffix drafting
# reaches on Spec-Bench rag, docs/models.md). One acceptance for every candidate: the same drafts are accepted
# whatever runs the model; what differs is what a step of 1 + k tokens costs, t(1 + k).
ACCEPT = 0.7
FORMAT = 3  # bump when the table's layout or the measurement changes: old cache files are then ignored
# The answer length a pipeline plans for: max_new_tokens is a cap, not a length. The 12 quickstart asks of
# examples/source_stats.py (quote style, Qwen2.5-0.5B) answered in 9-67 tokens (median 13, mean 21), so their
# time is mostly prefill; planning for the cap (256) would pick the faster decoder and lose (docs/models.md).
EXPECTED_ANSWER_TOKENS = 32
BUSY = 0.7  # a measurement that got less than this share of its cores ran beside another job: measured again
TRIES = 3  # background jobs that measure a contended table again (or find the machine busy) before it is kept


# -- the CPU -------------------------------------------------------------------------------------------------
def cpu_info() -> dict:
    """The CPU a measurement holds for: model, the flags that decide kernels, threads torch and llama.cpp use
    (torch's thread count; `cores`: the CPUs this process may run on, what llama.cpp takes)."""
    import torch

    model, flags = read_cpuinfo()
    model = model or platform.processor() or platform.machine()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"model": model, "flags": [f for f in FLAGS if f in flags], "threads": torch.get_num_threads(),
            "cores": cores, "flags_hash": flags_hash()}


def native_bf16(cpu: dict | None = None) -> bool:
    return any(f in (cpu or cpu_info())["flags"] for f in NATIVE_BF16)


def native_int8(cpu: dict | None = None) -> bool:
    return any(f in (cpu or cpu_info())["flags"] for f in NATIVE_INT8)


def matmul_ceilings(repeats: int = 3, budget_s: float = 0.3) -> dict:
    """GFLOP/s (GOP/s for int8) of an M×K×N matmul per dtype: float32 always, bfloat16 only on native bf16,
    int8 through `torch._int_mm` where it runs. A slow path (int8 without VNNI: ~1.5 GOP/s on AVX2) is timed
    on fewer rows (`rows`), so the whole measurement stays around a second."""
    import torch

    m, k, n = MATMUL
    out: dict = {"shape": [m, k, n], "rows": {}, "skipped": {}}
    names = ["float32"]
    if native_bf16():
        names.append("bfloat16")
    else:
        out["skipped"]["bfloat16"] = "no native bf16 (" + " / ".join(NATIVE_BF16) + ")"
    names.append("int8")
    for name in names:
        try:
            a, b = _operands(name, 64, k, n)  # a probe sizes the timed run
            fn = torch._int_mm if name == "int8" else torch.matmul
            fn(a, b)
            t = time.perf_counter()
            fn(a, b)
            per_row = (time.perf_counter() - t) / 64
            rows = int(min(m, max(64, budget_s / max(per_row, 1e-9) // 64 * 64)))
            a, b = _operands(name, rows, k, n)
            times = []
            for _ in range(repeats if per_row * rows < budget_s else 1):
                t = time.perf_counter()
                fn(a, b)
                times.append(time.perf_counter() - t)
            out[name] = round(2 * rows * k * n / min(times) / 1e9, 1)
            out["rows"][name] = rows
        except (RuntimeError, NotImplementedError) as exc:  # e.g. no int8 matmul kernel in this torch build
            out["skipped"][name] = _first_line(exc)
    return out


def _operands(name: str, rows: int, k: int, n: int):
    import torch

    g = torch.Generator().manual_seed(0)
    if name == "int8":
        return (torch.randint(-128, 127, (rows, k), dtype=torch.int8, generator=g),
                torch.randint(-128, 127, (k, n), dtype=torch.int8, generator=g))
    dt = getattr(torch, name)
    return torch.randn(rows, k, generator=g).to(dt), torch.randn(k, n, generator=g).to(dt)


def machine_info() -> dict:
    """What a figure was measured on: the CPU and its measured matmul ceilings (for the bench JSON)."""
    return cpu_info() | {"matmul_gflops": matmul_ceilings()}


# -- candidates ----------------------------------------------------------------------------------------------
def is_gguf_file(model: str) -> bool:
    return Path(model).expanduser().suffix == ".gguf"


def has_gguf(model: str) -> bool:
    """Embedded generators ship as GGUF; otherwise a local .gguf file names one."""
    from ragspec.models.registry import lookup

    return lookup(model) is not None or (is_gguf_file(model) and Path(model).expanduser().is_file())


def _transformers(cpu: dict, model: str) -> str | None:
    return "a .gguf file runs on its blocks (dtype gguf) or on llama.cpp" if is_gguf_file(model) else None


def _transformers_bf16(cpu: dict, model: str) -> str | None:
    if not native_bf16(cpu):
        return "no native bf16 on this CPU (needs " + " or ".join(NATIVE_BF16) + ")"
    return _transformers(cpu, model)


def _transformers_int8(cpu: dict, model: str) -> str | None:
    if not native_int8(cpu):  # without VNNI the int8 path is an exact fp32 emulation: slower than float32
        return "no native int8 dot products on this CPU (needs " + " or ".join(NATIVE_INT8) + ")"
    return _transformers(cpu, model)


def _transformers_gguf(cpu: dict, model: str) -> str | None:
    import shutil

    from ragspec.models.registry import lookup

    if lookup(model, "generator") is None:
        if not (is_gguf_file(model) and Path(model).expanduser().is_file()):
            return "dtype gguf runs an embedded model's GGUF blocks or a local .gguf file"
        from ragspec.runtime.gguf_file import architecture, file_source

        try:
            architecture(file_source(model))
        except RagspecError as exc:
            return str(exc)
    if "avx2" not in cpu.get("flags", ()):
        return "no AVX2: the GGUF kernels would run as plain C"
    if not (shutil.which("c++") or shutil.which("g++")):
        return "no C++ compiler to build the GGUF kernels"
    return None


def _llama(cpu: dict, model: str) -> str | None:
    from ragspec.runtime.llama_cpp_model import available

    if not has_gguf(model):
        return "the model has no GGUF (llama.cpp runs embedded models or a local .gguf file)"
    return available()


@dataclass(frozen=True)
class Candidate:
    """A way to run the model; `needs(cpu, model)` says why it cannot run here (None: it can)."""

    backend: str
    dtype: str
    needs: Callable[[dict, str], str | None]

    @property
    def name(self) -> str:
        return f"{self.backend}/{self.dtype}"


# Another dtype is one more line here, once load_generator knows it.
CANDIDATES = (
    Candidate("transformers", "float32", _transformers),
    Candidate("transformers", "bfloat16", _transformers_bf16),
    Candidate("transformers", "int8", _transformers_int8),
    Candidate("transformers", "gguf", _transformers_gguf),
    Candidate("llama.cpp", "gguf", _llama),
)


# Where transformers/gguf runs, the other transformers dtypes are not measured: they read 2-7x its weight bytes a
# decoding step (t(1) is bound by those bytes) and their prompt matmuls run no faster than the int8 units its prompt
# copy uses (float32 at under half their rate); every table measured (Zen 3, Zen 4, Zen 5, a Xeon with AMX) took
# gguf over each of them for every shape, both models (docs/models.md).
DOMINATED_BY_GGUF = ("transformers/float32", "transformers/bfloat16", "transformers/int8")


def ruled_out(runnable: list[str], cpu: dict, path: Path) -> dict[str, str]:
    """Candidate name → the rule that leaves it unmeasured: DOMINATED_BY_GGUF where transformers/gguf runs, and
    llama.cpp where an earlier table of this machine (same CPU, flags and threads; another model) measured it
    slower than transformers/gguf in prefill and at every t(n)."""
    out = {}
    if "transformers/gguf" not in runnable:
        return out
    for name in DOMINATED_BY_GGUF:
        if name in runnable:
            out[name] = "transformers/gguf runs here: fewer weight bytes a step, prompts on the int8 units"
    if "llama.cpp/gguf" in runnable:
        same_cpu = f"-cpu{cpu['flags_hash']}-t{cpu['threads']}c{cpu['cores']}-"
        for other in sorted(path.parent.glob(f"machine-*{same_cpu}*.json")):
            if other == path or (table := read_json(other)) is None or table.get("contended"):
                continue
            if llama_slower(table):
                out["llama.cpp/gguf"] = (f"slower than transformers/gguf at every shape in this machine's table of "
                                         f"{table.get('model')}")
                break
    return out


def llama_slower(table: dict) -> bool:
    """A table measured llama.cpp slower than transformers/gguf in prefill and at every t(n)."""
    rows = {f"{r['backend']}/{r['dtype']}": r for r in table.get("candidates", []) if "prefill_tps" in r}
    g, ll = rows.get("transformers/gguf"), rows.get("llama.cpp/gguf")
    return bool(g and ll and g["prefill_tps"] > ll["prefill_tps"] and all(a < b for a, b in zip(g["ms"], ll["ms"])))


# -- the calibration table -----------------------------------------------------------------------------------
def _llama_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama_cpp_python")
    except PackageNotFoundError:
        return None


def table_key(model: str, cpu: dict | None = None, candidates=CANDIDATES) -> str:
    """Model + CPU model + CPU flags + threads (+ torch and llama.cpp versions, ragspec's own CPU kernels, the
    runtime options in effect, the candidates): a change in any of them changes the kernels, so the measurements
    no longer hold."""
    import torch

    from ragspec.models.generator import prompt_copy_key
    from ragspec.runtime.gguf_kernel import source_digest
    from ragspec.runtime.gguf_linear import superblock_activations
    from ragspec.runtime.step_forward import wanted as step_forward_wanted

    cpu = cpu or cpu_info()
    model_id = model if not Path(model).expanduser().exists() else str(Path(model).expanduser().resolve())
    parts = [FORMAT, model_id, cpu["model"], cpu["flags_hash"], cpu["threads"], cpu["cores"], torch.__version__,
             _llama_version(), source_digest(), current_options().key(), prompt_copy_key(model),
             "1" if superblock_activations() else "0", "step" if step_forward_wanted() else "modules", CONTEXT, SIZES,
             [c.name for c in candidates]]
    h = hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:12]
    slug = "".join(c if c.isalnum() or c in ".-_" else "_" for c in Path(model).name.lower())[:48]
    return f"machine-{slug}-cpu{cpu['flags_hash']}-t{cpu['threads']}c{cpu['cores']}-{h}"


def table_path(model: str, cache_dir: Path | None = None, cpu: dict | None = None, candidates=CANDIDATES) -> Path:
    return (cache_dir or ragspec_home() / "calibration") / f"{table_key(model, cpu, candidates)}.json"


def machine_table(model: str, force: bool = False, cache_dir: Path | None = None,
                  progress: Callable[[str], None] | None = None, candidates=CANDIDATES, again: bool = False) -> dict:
    """The calibration table of `model` on this machine: read from the cache, else measured (each available
    candidate in a child process) and cached. `progress(line)` hears one line per candidate. `again`: measure
    a contended table again (try `tries` + 1 of TRIES); one another process measured quiet meanwhile is read."""
    cpu = cpu_info()
    path = table_path(model, cache_dir, cpu, candidates)
    if not force and _settled(table := read_json(path), again):
        return table
    say = progress or (lambda line: None)
    path.parent.mkdir(parents=True, exist_ok=True)
    # one calibration per machine at a time: processes starting together (two server replicas, a server and a
    # notebook) would measure each other's load, and each would choose from its own figures. The second waits
    # for the first's table and reads it, so every process on the machine makes the same choice.
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("another process is calibrating this model on this machine: waiting for its table…")
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _settled(table := read_json(path), again):
                return table
        old = read_json(path)
        if not force and _settled(old, again):
            return old
        tries = old.get("tries", 1) + 1 if again and old is not None else 1
        return _measure_table(model, path, cpu, candidates, say, tries, old if again else None)


def table_status(model: str, cache_dir: Path | None = None) -> str:
    """One line on `model`'s table here: measured (when, CPU seconds), being measured (the job's last log line),
    or not measured yet."""
    path = table_path(model, cache_dir)
    table = read_json(path)
    if table is not None:
        cpu_s = sum(r.get("cpu_s", 0.0) for r in table.get("candidates", []))
        measured = [f"{r['backend']}/{r['dtype']}" for r in table["candidates"] if "prefill_tps" in r]
        return (f"measured {table.get('measured_at', '?')} ({', '.join(measured) or 'nothing'}; {cpu_s:.0f} s of CPU)"
                + (" — contended, to be measured again" if table.get("contended") else ""))
    log = path.with_suffix(".log")
    try:
        last = log.read_text(encoding="utf-8").strip().splitlines()[-1]
    except (OSError, IndexError):
        return "not measured yet (the first ask starts it in the background; `ragspec models --calibrate` now)"
    return f"being measured in the background: {last}"


def busy_try(model: str, cache_dir: Path | None = None, candidates=CANDIDATES) -> dict | None:
    """Count a background job that found the machine too busy to measure a contended table again as one of its
    TRIES, so a machine that stays busy stops starting jobs for it. Returns the table (None: there is none)."""
    path = table_path(model, cache_dir, cpu_info(), candidates)
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table = read_json(path)
        if table is None or not table.get("contended"):
            return table
        table["tries"] = table.get("tries", 1) + 1
        write_json(path, table)
        return table


def _settled(table: dict | None, again: bool) -> bool:
    """A table to read as it is: there is one, and it is not a contended one a job was asked to measure again."""
    return table is not None and not (again and table.get("contended"))



def _measure_table(model: str, path: Path, cpu: dict, candidates, say: Callable[[str], None], tries: int = 1,
                   before: dict | None = None) -> dict:
    """Measure every candidate; measuring a contended table again (`before`), a candidate keeps whichever of its
    two measurements got the larger share of its cores, so a try more disturbed than the last loses nothing."""
    earlier = {(r["backend"], r["dtype"]): r for r in (before or {}).get("candidates", []) if "prefill_tps" in r}
    rows = []
    needs = {c.name: c.needs(cpu, model) for c in candidates}
    rules = ruled_out([n for n, why in needs.items() if why is None], cpu, path)
    for c in candidates:
        row = {"backend": c.backend, "dtype": c.dtype}
        why = needs[c.name]
        if why:
            row["skipped"] = why
            say(f"{c.name}: skipped ({why})")
        elif c.name in rules:
            row["ruled_out"] = rules[c.name]
            say(f"{c.name}: not measured ({rules[c.name]})")
        else:
            say(f"{c.name}: measuring prefill and t(1)…t({SIZES[-1]}) over {CONTEXT} tokens…")
            try:
                row |= run_child(model, c.backend, c.dtype, cpu["threads"], lambda line, c=c: say(f"{c.name}: {line}"))
                if row["cpu_share"] < BUSY:  # another job took cores: its figures would mislead for good
                    say(f"{c.name}: got {row['cpu_share']:.0%} of its cores (another job ran), measuring again…")
                    again = run_child(model, c.backend, c.dtype, cpu["threads"], say)
                    row |= (again | {"attempts": 2}) if again["cpu_share"] > row["cpu_share"] else {"attempts": 2}
                last = earlier.get((c.backend, c.dtype))
                if last is not None and last.get("cpu_share", 0.0) > row["cpu_share"]:
                    say(f"{c.name}: got {row['cpu_share']:.0%} of its cores, the last try {last['cpu_share']:.0%}: "
                        "keeping the last try's figures")
                    row = dict(last)
                say(f"{c.name}: prefill {row['prefill_tps']:.0f} tok/s, t(1) {row['ms'][0]:.1f} ms "
                    f"({row.get('seconds', 0):.0f} s, {row.get('cpu_s', 0):.0f} s of CPU)")
            except RagspecError as exc:
                row["error"] = str(exc)
                say(f"{c.name}: failed ({exc})")
        rows.append(row)
    # a row that got under BUSY of its cores even when measured again ran beside another job: the table is used,
    # but marked, and a pipeline that reads it has it measured again once the machine is quiet
    contended = [r["backend"] + "/" + r["dtype"] for r in rows if r.get("cpu_share", 1.0) < BUSY]
    table = {"key": path.stem, "model": model, "cpu": cpu, "context": CONTEXT, "sizes": list(SIZES),
             "contended": contended, "tries": tries,
             "versions": {"python": platform.python_version(), "torch": _torch_version(),
                          "llama_cpp_python": _llama_version()},
             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "candidates": rows}
    write_json(path, table)
    return table


def _torch_version() -> str:
    import torch

    return torch.__version__


def prefill_s(row: dict, prompt_tokens: int, blend: float | None = None) -> float:
    """Seconds to read a prompt: a full prefill at the measured rate, or with a warm source store (`blend`:
    its CacheBlend fraction) the measured assembly scaled to the prompt, blended cost linear in the fraction."""
    if blend is None or "assembled_ms" not in row:
        return prompt_tokens / row["prefill_tps"]
    ms = row["assembled_ms"] + (row.get("blended_ms", row["assembled_ms"]) - row["assembled_ms"]) * blend / BLEND
    return ms / 1000 * prompt_tokens / CONTEXT


# -- the choice ----------------------------------------------------------------------------------------------
class Choice(NamedTuple):
    backend: str
    dtype: str
    reason: str
    predicted_s: float | None = None
    guessed: bool = False  # from the CPU flags while the table is measured in the background


def guess(pool, cpu: dict) -> Candidate:
    """The candidate to run before this machine's table exists: transformers/gguf wherever it can run (AVX2 and a
    C++ compiler). Every table measured picks it for every shape: Zen 4 (the 1.5B's prefill 140 tok/s against
    int8's 123, t(1) 52 ms against 136), a Xeon with AMX (the 0.5B's 602 against 390, t(1) 28 against 58), and
    a Zen 3 with AVX2 only (the 1.5B's 48 against float32's 41, t(1) 68 against 324); and its answers are the
    same bits on every CPU, so the measured table does not change them. Without it, int8 where the CPU has VNNI
    or AMX, then bfloat16 where bf16 is native, float32 elsewhere. llama.cpp is never guessed: it changes which
    drafters can run."""
    order = ["transformers/gguf"] + (["transformers/int8"] if native_int8(cpu) else []) + (
        ["transformers/bfloat16"] if native_bf16(cpu) else []) + ["transformers/float32"]
    by_name = {c.name: c for c in pool}
    return next((by_name[n] for n in order if n in by_name), pool[0])


def needs_transformers(drafting_method: str) -> bool:
    """Drafting that reads what only the transformers backend gives: PLD+ (hidden states, attention rows),
    lookahead (every tree row's argmax, for its Jacobi window) and ngrammys (the model's bigram)."""
    return drafting_method.startswith("pldplus") or drafting_method in ("lookahead", "ngrammys")


def decode_ms_per_token(row: dict, drafting_method: str = "suffix", sizes=SIZES) -> float:
    """ms per answer token: t(1) with drafting 'none'; else the best step size over the measured ones,
    min over n of t(n) / E(n - 1), E(k) = (1 - ACCEPT^(k+1)) / (1 - ACCEPT) tokens for k drafts. Where t(n)
    is flat (oneDNN float32 here: t(8) ≈ 1.7 t(1)) drafting pays; where it grows about like n (llama.cpp's
    quantized kernels here: t(8) ≈ 4 t(1)) a plain step is nearly as good, as the budget will find."""
    if drafting_method == "none":
        return row["ms"][0]
    return min(ms * (1 - ACCEPT) / (1 - ACCEPT ** n) for n, ms in zip(sizes, row["ms"]))


def predict_s(row: dict, prompt_tokens: int, answer_tokens: int, drafting_method: str = "suffix",
              sizes=SIZES, blend: float | None = None) -> float:
    """Seconds for an ask: the prompt's prefill (`prefill_s`) + answer_tokens × decode ms per token (first
    order: the budget's finer choices and the answer's real length are left out)."""
    return (prefill_s(row, prompt_tokens, blend)
            + answer_tokens * decode_ms_per_token(row, drafting_method, sizes) / 1000)


def choose(table: dict, prompt_tokens: int, answer_tokens: int, drafting_method: str = "suffix",
           backend: str = "auto", dtype: str = "auto", blend: float | None = None) -> Choice:
    """The measured candidate with the least predicted time for this shape (a pure function of the table).
    llama.cpp is left out for PLD+ drafting (it needs hidden states or attention rows llama.cpp does not
    give); `backend` / `dtype` other than 'auto' keep only the candidates that match. `blend`: the source
    cache is on with this CacheBlend fraction, and its store is counted warm (the prompt assembled); a
    fraction above 0 leaves llama.cpp out too (it applies none: its answers would not be the ones asked for)."""
    rows = [r for r in table["candidates"] if "prefill_tps" in r
            and backend in ("auto", r["backend"]) and dtype in ("auto", r["dtype"])
            and not (r["backend"] == "llama.cpp" and (needs_transformers(drafting_method) or blend))]
    if not rows:
        return Choice("transformers", "float32", "no candidate was measured here: transformers/float32 as before")
    sizes = table.get("sizes", SIZES)
    scored = sorted((predict_s(r, prompt_tokens, answer_tokens, drafting_method, sizes, blend), i, r)
                    for i, r in enumerate(rows))
    best_s, _, best = scored[0]
    others = ", ".join(f"{r['backend']}/{r['dtype']} {s:.1f} s" for s, _, r in scored[1:])
    prompt = f"{prompt_tokens}-token prompt" + (" from a warm source cache" if blend is not None else "")
    reason = (f"fastest measured here for a {prompt} + {answer_tokens}-token answer: "
              f"{best['backend']}/{best['dtype']} {best_s:.1f} s" + (f" (vs {others})" if others else ""))
    return Choice(best["backend"], best["dtype"], reason, round(best_s, 2))


def resolve(generator, device: str, prompt_tokens: int, answer_tokens: int, drafting_method: str,
            progress: Callable[[str], None] | None = None, cache_dir: Path | None = None,
            source_cache: bool = False) -> Choice:
    """What a pipeline runs for `generator` settings (backend, dtype): explicit values are honoured; on
    CUDA auto is transformers bfloat16; on CPU auto measures the candidates left (once per machine, cached)
    and takes the fastest for the shape — with a single candidate left, it is taken without measuring.
    `source_cache`: prompts are assembled from a (warm) source store, at `generator.source_cache_blend`."""
    backend, dtype = generator.backend, generator.dtype
    if backend == "llama.cpp":
        return Choice("llama.cpp", "gguf", "generator.backend: llama.cpp")
    if device != "cpu":
        return Choice("transformers", "bfloat16" if dtype == "auto" else dtype,
                      f"on {device}: transformers, bfloat16 unless set")
    if dtype != "auto":  # only transformers runs a chosen dtype
        return Choice("transformers", dtype, f"generator.dtype: {dtype}")
    cpu = cpu_info()
    pool, left_out = [], []
    for c in CANDIDATES:
        if backend not in ("auto", c.backend):
            continue
        why = ("PLD+ / lookahead / ngrammys drafting needs hidden states / attention rows / every row's prediction "
               "/ the model's bigram"
               if c.backend == "llama.cpp" and needs_transformers(drafting_method) else c.needs(cpu, generator.model))
        if why:
            left_out.append(f"{c.name}: {why}")
        else:
            pool.append(c)
    if not pool:
        raise RagspecError(f"no way to run '{generator.model}' here: " + "; ".join(left_out))
    if len(pool) == 1:
        c = pool[0]
        return Choice(c.backend, c.dtype, "the only candidate here" + (f" ({'; '.join(left_out)})" if left_out else ""))
    # the whole table (every candidate), so pipelines of other settings on this machine share one file
    path = table_path(generator.model, cache_dir, cpu)
    table = read_json(path)
    from ragspec.machine import launch

    mode = launch.mode()
    if table is None and mode == "foreground":
        table = machine_table(generator.model, cache_dir=cache_dir, progress=progress)
    if mode != "off" and (table is None or (table.get("contended") and table.get("tries", 1) < TRIES)):
        log = launch.start(generator.model, path, cache_dir, again=table is not None)
        if log is not None and progress is not None:
            progress(("this machine's figures were measured beside another job: measuring again" if table else
                      "no measurements of this machine yet: they run in the background once it is quiet")
                     + f" (log: {log})")
    if table is None:
        c = guess(pool, cpu)
        flags = " ".join(cpu["flags"]) or "no AVX2"
        if mode == "off":
            return Choice(c.backend, c.dtype, f"a guess from the CPU flags ({flags}): RAGSPEC_CALIBRATE=off measures "
                          "nothing (`ragspec models --calibrate` does)", guessed=True)
        return Choice(c.backend, c.dtype, f"a first guess from the CPU flags ({flags}) while this machine is "
                      "measured in the background; later loads, and this pipeline between asks, use the measurement",
                      guessed=True)
    blend = float(generator.source_cache_blend) if source_cache else None
    return choose(table, prompt_tokens, answer_tokens, drafting_method, backend, blend=blend)



def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]

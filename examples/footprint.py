"""What a model costs a user in memory and disk: the quickstart ask on a fresh `RAGSPEC_HOME` (first) and again
(warm), each its own process, beside llama.cpp (llama-cpp-python, n_ctx 4096) on the same GGUF and prompt tokens.

Prints per model: peak RSS of each process (`wait4`'s ru_maxrss: the process and the children it waited for, such
as the kernels' compiler), its wall time, the warm load time of the model alone, and the bytes
`$RAGSPEC_HOME/models` holds against the GGUF's. The generator runs as `generator.dtype: auto` picks it with the
background measurement off (RAGSPEC_CALIBRATE=off: the CPU flags' guess, transformers/gguf here). Run it alone.
Usage: python examples/footprint.py INDEX [--model NAME ...] [--json OUT]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ragspec.cpu_flags import read_cpuinfo

QUESTION = "What does the global statement do?"


def child(args: list[str], home: Path) -> dict:
    """Run this script's `--child` mode in a fresh process; its JSON and its peak RSS."""
    env = dict(os.environ, RAGSPEC_HOME=str(home), RAGSPEC_CALIBRATE="off")
    t = time.perf_counter()
    p = subprocess.Popen([sys.executable, __file__, "--child", *args], stdout=subprocess.PIPE, env=env, text=True)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    if status:
        raise SystemExit(f"child {args[0]} failed ({status})")
    return {**json.loads(out.strip().splitlines()[-1]), "peak_rss_gb": round(usage.ru_maxrss / 1e6, 2),
            "wall_s": round(time.perf_counter() - t, 1)}


def run_child(mode: str, a: list[str]) -> dict:
    if mode == "ask":  # the quickstart ask, its prompt tokens kept for llama.cpp
        index, model, ids_out = a
        from ragspec.decoding import generate
        from ragspec.pipeline import Pipeline

        seen = {}
        orig = generate.SpeculativeGenerator.stream

        def keep(self, prompt, *args, **kwargs):
            seen.setdefault("ids", list(prompt))
            return orig(self, prompt, *args, **kwargs)

        generate.SpeculativeGenerator.stream = keep
        pipe = Pipeline({"generator": {"model": model, "max_new_tokens": 64}}, index)
        ans = pipe.ask(QUESTION)
        Path(ids_out).write_text(json.dumps(seen.get("ids", [])))
        return {"prompt_tokens": ans.stats.prompt_tokens, "ttft_s": round(ans.stats.ttft_ms / 1000, 2),
                "choice": f"{ans.stats.backend}/{ans.stats.dtype}", "text": ans.text[:80]}
    if mode == "load":
        from ragspec.models.generator import load_generator

        t = time.perf_counter()
        load_generator(a[0], "cpu", "gguf")
        return {"load_s": round(time.perf_counter() - t, 2)}
    if mode == "llama":  # bare llama-cpp-python on the same GGUF and prompt tokens, 64 greedy tokens
        from llama_cpp import Llama

        ids = json.loads(Path(a[1]).read_text())
        llm = Llama(model_path=a[0], n_ctx=4096, verbose=False)
        t = time.perf_counter()
        out = []
        for tok in llm.generate(ids, temp=0.0):
            out.append(tok)
            if len(out) == 64 or tok == llm.token_eos():
                break
        return {"prompt_tokens": len(ids), "gen_s": round(time.perf_counter() - t, 2)}
    raise SystemExit(f"unknown child mode {mode}")


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def main():
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(run_child(sys.argv[2], sys.argv[3:])))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("index")
    ap.add_argument("--model", action="append")
    ap.add_argument("--json")
    a = ap.parse_args()
    from ragspec.models.gguf_cache import gguf_path
    from ragspec.models.registry import lookup

    cpu, flags = read_cpuinfo()
    flags = [f for f in flags if f.startswith(("avx2", "avx512", "avx_vnni", "amx"))]
    print(f"CPU: {cpu} · flags: {' '.join(flags)}")
    rows = []
    kernels = Path(os.environ.get("RAGSPEC_HOME", Path.home() / ".cache" / "ragspec")) / "kernels"
    for model in a.model or ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]:
        home = Path(tempfile.mkdtemp(prefix="ragspec-footprint-"))
        if kernels.is_dir():  # the compiled kernels (not model files): the first ask here is not a compile
            (home / "kernels").symlink_to(kernels)
        ids = home / "prompt.json"
        first = child(["ask", a.index, model, str(ids)], home)
        models_bytes = du(home / "models")
        warm = child(["ask", a.index, model, str(ids)], home)
        load = child(["load", model], home)
        gguf = gguf_path(lookup(model))  # llama.cpp's one file, assembled in the usual home (not this one)
        llama = child(["llama", str(gguf), str(ids)], home)
        row = {"model": model, "gguf_bytes": lookup(model).size, "models_bytes": models_bytes,
               "models_over_gguf": round(models_bytes / lookup(model).size, 2), "first": first, "warm": warm,
               "load": load, "llama_cpp": llama,
               "first_over_llama": round(first["peak_rss_gb"] / llama["peak_rss_gb"], 2),
               "warm_over_llama": round(warm["peak_rss_gb"] / llama["peak_rss_gb"], 2)}
        rows.append(row)
        print(json.dumps(row))
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu": cpu, "flags": flags, "date": time.strftime("%Y-%m-%d"),
                                            "question": QUESTION, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

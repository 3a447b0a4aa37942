"""The device check's measurements, one JSON each under OUT (examples/gpu_check.sh runs them in order).

    python examples/gpu_check.py env   --out OUT
    python examples/gpu_check.py curve --out OUT --shape qwen2.5-7b [--device cuda] [--context 1024]
    python examples/gpu_check.py index --out OUT --corpus DIR --embedder NAME_OR_FOLDER [--device cuda] [--sample N]
    python examples/gpu_check.py load  --out OUT --prompts question.jsonl [--device cuda] [--clients 1,32]

`curve`: t(n) for n = 1…256 over a `context`-token cache, prefill speed, and one ragspec step's split (inputs,
forward, accept, trim) for a model of a real architecture's shape with random weights: speed only, never
quality. `bench-replay --cost` projects recorded runs over such a curve. `index`: chunks/s of an index build
on `device` beside the CPU (a sample of the corpus for both, then the whole corpus on `device`), which search
an index on that device runs, and whether its top 5 agree with the CPU index's. `load`: SmolLM2's generations at
once on the static verifier, their steps packed into one bucket's forward (one graph replay on CUDA), against the
same prompts one after another: tokens/s each way, and how many answers equal the lone ones.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Real configs (hub config.json values); the weights are drawn at random on the device.
SHAPES = {
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "smollm2-135m": dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "tiny": dict(vocab_size=32000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}
QUERIES = ["How do I open a file for appending?", "What does the with statement do?",
           "How do I sort a list of dictionaries by a key?", "What is a generator expression?",
           "How do I read environment variables?"]


def write(out: Path, name: str, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(result, indent=1))
    print(f"wrote {out / name}", flush=True)


def machine() -> dict:
    import torch

    from ragspec.bench.decoding import cpu_info

    m = {"cpu": cpu_info(), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        m |= {"gpu": torch.cuda.get_device_name(0), "gpu_memory_gib": round(p.total_memory / 2**30, 1),
              "multiprocessors": p.multi_processor_count, "cuda": torch.version.cuda}
    return m


def cmd_env(a) -> None:
    import importlib.metadata as md

    names = ["torch", "transformers", "sentence-transformers", "tokenizers", "accelerate", "pydantic", "faiss-cpu",
             "faiss-gpu-cu12", "gguf", "bm25s", "PyStemmer", "scipy", "pytest", "hypothesis"]
    versions = {}
    for n in names:
        try:
            versions[n] = md.version(n)
        except md.PackageNotFoundError:
            versions[n] = None
    smi = shutil.which("nvidia-smi")
    info = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm",
                           "--format=csv,noheader"], capture_output=True, text=True).stdout.strip() if smi else None
    import torch

    from ragspec.index.torch_search import which_search

    device = "cuda" if torch.cuda.is_available() else "cpu"
    write(a.out, "env.json", {"machine": machine(), "packages": versions, "nvidia_smi": info,
                              "index_search_on_" + device: which_search(device)})


def random_model(shape: str, device: str, dtype: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape_cfg = dict(SHAPES[shape])
    config, model_class = ((LlamaConfig, LlamaForCausalLM) if shape_cfg.pop("arch", "qwen2") == "llama"
                           else (Qwen2Config, Qwen2ForCausalLM))
    cfg = config(max_position_embeddings=32768, **shape_cfg)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # drawn in its dtype, where it runs: no float32 copy of a 7B
    try:
        with torch.device(device):
            model = model_class(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def numbered_tokenizer(vocab: int):
    """A real (word-level) tokenizer whose token i is the word `t<i>`: the random model's ids decode to text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")


def cmd_curve(a) -> None:
    import torch

    from ragspec.decoding.backends import describe
    from ragspec.decoding.backends.static_verifier import StaticBackend
    from ragspec.decoding.backends.transformers import TransformersBackend
    from ragspec.decoding.budget import CostModel
    from ragspec.decoding.drafters import make_drafter
    from ragspec.decoding.generate import SpeculativeGenerator

    t = time.perf_counter()
    model = random_model(a.shape, a.device, a.dtype)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    sync()
    load_s = time.perf_counter() - t
    sizes = list(range(1, 17)) + [24, 32, 48, 64, 96, 128, 160, 192, 224, 256] if a.device == "cuda" else [1, 2, 4, 8, 16]
    ms = TransformersBackend.measure_costs(model, a.context, a.repeats, sizes)
    # the static verifier's steps (CUDA graph replays on a GPU, eager elsewhere) over the same cache length
    static_ms = StaticBackend.measure_costs(model, a.context, a.repeats, sizes)
    prefill = {}
    with torch.inference_mode():
        for n in (a.context, 4 * a.context):
            ids = torch.randint(100, 30000, (1, n), device=a.device)
            model(input_ids=ids, logits_to_keep=1)  # warm
            sync()
            times = []
            for _ in range(3):
                t = time.perf_counter()
                model(input_ids=ids, logits_to_keep=1)
                sync()
                times.append(time.perf_counter() - t)
            prefill[str(n)] = {"ms": round(sorted(times)[1] * 1000, 2), "tokens_per_s": round(n / sorted(times)[1], 1)}
    # one ragspec generation with plain steps: what the Python around a forward costs per step
    tok = numbered_tokenizer(model.config.vocab_size)
    prompt = torch.randint(100, 30000, (a.context,)).tolist()
    plain = {}
    for choice in ("0", "1"):  # the dynamic verifier, then the static one (graphs on CUDA)
        os.environ["RAGSPEC_STATIC_VERIFIER"] = choice
        for _ in range(2):  # the second run is measured
            gen = SpeculativeGenerator(model, tok, drafter=make_drafter("none"), max_new_tokens=a.steps,
                                       eos_token_ids=[-1], budget=1)
            gen.generate(prompt)
        s = gen.stats
        plain["static" if choice == "1" else "dynamic"] = {
            "verifier": describe(model), "steps": s.steps, "draft": round(s.draft_ms / s.steps, 3),
            **{k: round(v / s.steps, 3) for k, v in s.step_ms.items()}}
    os.environ.pop("RAGSPEC_STATIC_VERIFIER")
    params = sum(p.numel() for p in model.parameters())
    cost = CostModel(sizes, ms)
    result = {"what": f"random weights in {a.shape}'s shape: speed only", "shape": a.shape,
              "config": SHAPES[a.shape], "parameters": params, "dtype": a.dtype, "device": a.device,
              "machine": machine(), "load_s": round(load_s, 1), "context": a.context,
              "ms_measured": [round(v, 3) for v in ms],  # cost_model's t(n) is the least at n or beyond
              "cost_model": cost.as_dict(), "t1_ms": round(cost.ms[0], 3),
              "t_over_t1": {str(n): round(v / cost.ms[0], 3) for n, v in zip(sizes, cost.ms)},
              "prefill": prefill,
              "static": {"ms_measured": [round(v, 3) for v in static_ms], "t1_ms": round(static_ms[0], 3),
                         "t_over_t1": {str(n): round(v / static_ms[0], 3) for n, v in zip(sizes, static_ms)},
                         "graphs": a.device == "cuda"},
              "plain_step_ms": plain}
    dtype_tag = "" if a.dtype == "bfloat16" else f"-{a.dtype}"
    write(a.out, f"curve-{a.shape}{dtype_tag}-{a.device}.json", result)
    print(json.dumps({k: result[k] for k in ("shape", "t1_ms", "prefill", "plain_step_ms")}
                     | {"static_t1_ms": result["static"]["t1_ms"]}), flush=True)


def cmd_profile(a) -> None:
    """Where an eager static-verifier step of one row spends its device time, kernel by kernel (graphs off, so
    the profiler sees each launch; the graphed step runs the same kernels): why float32 costs 3x bfloat16."""
    from torch.profiler import ProfilerActivity, profile

    from ragspec.decoding.backends.static_verifier import StaticBackend

    model = random_model(a.shape, a.device, a.dtype)
    os.environ["RAGSPEC_CUDA_GRAPHS"] = "0"
    try:
        StaticBackend.measure_costs(model, a.context, 1, [1, 16])  # warm: kernels chosen, handles made
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
        with profile(activities=activities) as prof:
            StaticBackend.measure_costs(model, a.context, a.repeats, [1, 16])
    finally:
        os.environ.pop("RAGSPEC_CUDA_GRAPHS")
    key = "cuda_time_total" if a.device == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=70)
    name = f"profile-{a.shape}-{a.dtype}-{a.device}.txt"
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / name).write_text(table)
    print(f"wrote {a.out / name}\n" + "\n".join(table.splitlines()[:12]), flush=True)


def build(corpus: Path, target: Path, embedder: str, device: str):
    from ragspec.index.builder import build_index
    from ragspec.settings import IndexSettings

    shutil.rmtree(target, ignore_errors=True)
    s = build_index(corpus, target, IndexSettings(embedder=embedder, device=device), show_progress=False)
    return {"device": device, "documents": s.documents, "chunks": s.chunks, "embed_s": round(s.embed_seconds, 2),
            "chunks_per_s": round(s.chunks_per_s, 1), "total_s": round(s.seconds, 2), "factory": s.factory,
            "notes": s.notes}


def cmd_index(a) -> None:
    from ragspec.index.torch_search import which_search
    from ragspec.retrieve.retriever import Retriever

    work = a.out / "index-work"
    files = sorted(p for p in a.corpus.rglob("*") if p.is_file())
    sample = work / "sample"
    for p in files[: a.sample]:  # the same files for both devices
        dest = sample / p.relative_to(a.corpus)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(p, dest)
    runs = {"cpu": build(sample, work / "sample-cpu", a.embedder, "cpu")}
    if a.device != "cpu":
        build(sample, work / "warm", a.embedder, a.device)  # the model's first load and kernels stay out
        runs[a.device] = build(sample, work / f"sample-{a.device}", a.embedder, a.device)
        runs["whole_corpus_" + a.device] = build(a.corpus, work / "whole", a.embedder, a.device)
    agree = []
    if a.device != "cpu":  # the same files embedded on each device: the dense top 5 should be the same chunks
        on_cpu = Retriever(work / "sample-cpu", device="cpu")
        on_dev = Retriever(work / f"sample-{a.device}", device=a.device)
        for q in QUERIES:
            ids = [{c for c, _ in r.dense(q, 5)} for r in (on_cpu, on_dev)]
            agree.append(len(ids[0] & ids[1]) / 5)
    result = {"machine": machine(), "corpus": str(a.corpus), "sample_files": min(a.sample, len(files)),
              "files": len(files), "embedder": a.embedder, "runs": runs,
              "search_on_" + a.device: which_search(a.device),
              "top5_overlap_cpu_vs_device": agree or None}
    if a.device != "cpu" and runs["cpu"]["chunks_per_s"]:
        result["speedup"] = round(runs[a.device]["chunks_per_s"] / runs["cpu"]["chunks_per_s"], 2)
    shutil.rmtree(work, ignore_errors=True)
    write(a.out, f"index-{a.device}.json", result)
    print(json.dumps({k: result.get(k) for k in ("speedup", "search_on_" + a.device, "top5_overlap_cpu_vs_device")}))


def cmd_load(a) -> None:
    import threading

    os.environ["RAGSPEC_STATIC_VERIFIER"] = "1"  # CUDA's default; on the CPU the same steps run eagerly
    from ragspec.bench.decoding import chat_ids, load_prompts
    from ragspec.decoding.backends import describe, step_batcher
    from ragspec.decoding.drafters import make_drafter
    from ragspec.decoding.generate import SpeculativeGenerator
    from ragspec.models.generator import load_generator, model_lock

    model, tok = load_generator("smollm2-135m-instruct", device=a.device, dtype=a.dtype)
    texts = [p["turns"][0] for p in load_prompts(a.prompts, "all", None)]
    batcher = step_batcher(model, model_lock(model))

    def answer(ids, shared=None):
        gen = SpeculativeGenerator(model, tok, drafter=make_drafter(a.method, model, tok), max_new_tokens=a.new)
        for _ in gen.stream(ids, batcher=shared):
            pass
        return gen.tokens

    def timed(fn):
        t = time.perf_counter()
        out = fn()
        if a.device == "cuda":
            import torch

            torch.cuda.synchronize()
        return out, time.perf_counter() - t

    def at_once(prompts):
        got: list = [None] * len(prompts)

        def run(i):
            got[i] = answer(prompts[i], batcher)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return got

    answer(chat_ids(tok, texts[0]))  # the buckets' graphs captured, kernels chosen
    rows = []
    for c in [int(x) for x in a.clients.split(",")]:
        prompts = [chat_ids(tok, texts[i % len(texts)]) for i in range(c)]
        alone, alone_s = timed(lambda ps=prompts: [answer(p) for p in ps])
        b0, r0 = batcher.batches, batcher.batched_rows
        got, together_s = timed(lambda ps=prompts: at_once(ps))
        tokens = sum(len(x) for x in alone)
        rows.append({"clients": c, "tokens": tokens, "one_after_another_s": round(alone_s, 3),
                     "at_once_s": round(together_s, 3), "tokens_per_s_one_after_another": round(tokens / alone_s, 1),
                     "tokens_per_s_at_once": round(tokens / together_s, 1),
                     "throughput_ratio": round(alone_s / together_s, 2),
                     "identical": sum(x == y for x, y in zip(got, alone)), "batches": batcher.batches - b0,
                     "rows_per_batch": round((batcher.batched_rows - r0) / max(1, batcher.batches - b0), 1)})
        print(json.dumps(rows[-1]))
    write(a.out, f"load-{a.device}.json", {"machine": machine(), "model": "smollm2-135m-instruct", "dtype": a.dtype,
                                           "verifier": describe(model), "method": a.method,
                                           "max_new_tokens": a.new, "rows": rows})


def cmd_summary(a) -> None:
    """The short table the device call's reply ends with (full figures stay in the JSON files)."""
    import xml.etree.ElementTree as ET

    lines = []
    env = a.out / "env.json"
    if env.exists():
        e = json.loads(env.read_text())
        lines.append(f"machine: {e['machine'].get('gpu') or e['machine']['cpu']['model']}, torch {e['machine']['torch']}")
    for f in sorted(a.out.glob("curve-*.json")):
        c = json.loads(f.read_text())
        t = c["t_over_t1"]
        lines.append(f"{c['shape']} ({c['parameters'] / 1e9:.2f} B, {c['dtype']}): t(1) {c['t1_ms']} ms; t(n)/t(1) "
                     + ", ".join(f"{n}: {t[n]}" for n in ("16", "64", "128", "256") if n in t)
                     + "; prefill " + ", ".join(f"{n}: {v['tokens_per_s']:.0f} tok/s" for n, v in c["prefill"].items())
                     + (f"; static t(1) {c['static']['t1_ms']} ms, t(n)/t(1) "
                        + ", ".join(f"{n}: {c['static']['t_over_t1'][n]}" for n in ("16", "64", "256")
                                    if n in c['static']['t_over_t1']) if "static" in c else "")
                     + f"; plain step {c['plain_step_ms']}")
    junit = a.out / "tests.xml"
    if junit.exists():
        s = ET.parse(junit).getroot()
        s = s if s.tag == "testsuite" else s[0]
        lines.append("tests: " + ", ".join(f"{k} {s.get(k)}" for k in ("tests", "failures", "errors", "skipped")))
    bench = a.out / f"bench-smollm2-{a.device}.json"
    if bench.exists():
        b = json.loads(bench.read_text())
        for cat, r in (b.get("categories") or {b.get("category"): b}).items():
            cells = [f"{m} {v['speedup']:.2f}x/{v['mean_accepted'] or 1:.2f}/{v['identical']}"
                     for m, v in r["methods"].items()]
            lines.append(f"bench {cat} ({r['prompts']} prompts; speed-up/tok-step/identical): " + "  ".join(cells))
    idx = a.out / f"index-{a.device}.json"
    if idx.exists():
        i = json.loads(idx.read_text())
        lines.append("index: " + "; ".join(f"{k} {v['chunks_per_s']} chunks/s ({v['chunks']} chunks)"
                                           for k, v in i["runs"].items())
                     + f"; search {i.get('search_on_' + a.device)}; top-5 overlap {i.get('top5_overlap_cpu_vs_device')}")
    load = a.out / f"load-{a.device}.json"
    if load.exists():
        lines.append("load (" + json.loads(load.read_text())["verifier"] + "): " + "; ".join(
            f"{r['clients']} at once {r['throughput_ratio']}x one after another ({r['tokens_per_s_at_once']} tok/s), "
            f"{r['identical']}/{r['clients']} identical, {r['rows_per_batch']} rows a batch"
            for r in json.loads(load.read_text())["rows"]))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    default_device = "cuda" if os.environ.get("DEVICE", "cuda") == "cuda" else "cpu"
    for name in ("env", "curve", "profile", "index", "load", "summary"):
        p = sub.add_parser(name)
        p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-check-out"))
        p.add_argument("--device", default=default_device, choices=["cpu", "cuda"])
        if name in ("curve", "profile"):
            p.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
            p.add_argument("--dtype", default="bfloat16")
            p.add_argument("--context", type=int, default=1024)
            p.add_argument("--repeats", type=int, default=5)
        if name == "curve":
            p.add_argument("--steps", type=int, default=32)
        if name == "index":
            p.add_argument("--corpus", type=Path, required=True)
            p.add_argument("--embedder", default="all-minilm-l6-v2")
            p.add_argument("--sample", type=int, default=60, help="files indexed on both devices")
        if name == "load":
            p.add_argument("--prompts", type=Path, required=True)
            p.add_argument("--clients", default="1,32")
            p.add_argument("--method", default="suffix")
            p.add_argument("--new", type=int, default=128)
            p.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    {"env": cmd_env, "curve": cmd_curve, "profile": cmd_profile, "index": cmd_index, "load": cmd_load,
     "summary": cmd_summary}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())

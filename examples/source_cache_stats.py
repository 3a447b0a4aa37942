"""What the source cache (`generator.source_cache`) saves before the first token, and what it changes in answers.

Every question is asked four ways, interleaved so each ratio is measured in one run:
- full: the cache off (today's prefill of the whole prompt);
- cold: the store emptied first (the ask computes its pieces into the store, then assembles);
- warm: the store holding this question's pieces in memory (filled by the cold ask, as ahead of time);
- disk: a new store over the same folder (memory empty, entries read back from disk: a restarted server).
The relevance gate's embeddings of the question's sources are made once before the four asks (it remembers
them), so no mode pays for them alone. It prints the median TTFT and prefill of each, how many answers equal
full prefill's, the store's size per 1,000 tokens
and the CPU flags. `--recompute 0,4,16` measures several recompute settings side by side (full once); `K:F`
recomputes the first K tokens of each piece and the fraction F of the rest that deviates most (CacheBlend);
`K:F:attention` the fraction F the question attends to most (ProphetKV / A³).
Usage: python examples/source_cache_stats.py INDEX [--pipeline FILE] [--recompute 4,4:0.15] [--max-new-tokens 48]
       [--source-tokens off] [--questions N] [--json OUT]
"""

import argparse
import json
import statistics
import tempfile

from source_stats import QUESTIONS  # the quickstart questions (examples/ is on the path when run as a script)

from ragspec.decoding.source_cache import SourceKVStore
from ragspec.pipeline import Pipeline


def ask(pipe, q, mode, max_new, budget):
    a = pipe.ask(q, max_new_tokens=max_new, source_tokens=budget, source_cache=mode)
    s = a.stats
    return {"ttft_s": round(s.ttft_ms / 1000, 3), "prefill_s": round(s.prefill_ms / 1000, 3), "text": a.text,
            "prompt_tokens": s.prompt_tokens, "reused": s.cache_reused_tokens, "stored": s.cache_stored_tokens,
            "computed": s.cache_computed_tokens, "declined": bool(a.declined)}


def measure(index, pipeline=None, recompute=(4,), max_new=48, budget="off", n=None):
    pipe = Pipeline(pipeline, index)
    folder = tempfile.mkdtemp(prefix="ragspec-kv-")
    pipe._source_store = SourceKVStore(memory_bytes=4 << 30, directory=folder, disk_bytes=16 << 30)
    pipe.load()
    pipe.ask(QUESTIONS[0], max_new_tokens=1, source_cache="off")  # warm: index, embedder, kernels
    rows = []
    for q in QUESTIONS[:n or len(QUESTIONS)]:
        pipe.prepare(q, source_tokens=budget)  # the gate's window embeddings, remembered: every mode pays the same
        row = {"question": q, "full": ask(pipe, q, "off", max_new, budget), "settings": {}}
        for k in recompute:
            first, _, rest = str(k).partition(":")
            blend, _, select = rest.partition(":")
            g = pipe.spec.generator.model_copy(update={"source_cache_recompute": int(first),
                                                        "source_cache_blend": float(blend or 0),
                                                        "source_cache_select": select or "deviation"})
            pipe.spec = pipe.spec.model_copy(update={"generator": g})
            pipe._source_store.clear()
            r = {"cold": ask(pipe, q, "on", max_new, budget), "warm": ask(pipe, q, "on", max_new, budget)}
            memory_only = pipe._source_store
            pipe._source_store = SourceKVStore(memory_bytes=4 << 30, directory=folder, disk_bytes=16 << 30)
            r["disk"] = ask(pipe, q, "on", max_new, budget)
            pipe._source_store = memory_only
            row["settings"][str(k)] = r
        rows.append(row)
        line = " | ".join(f"k={k}: cold {v['cold']['ttft_s']:5.2f} warm {v['warm']['ttft_s']:5.2f} "
                          f"disk {v['disk']['ttft_s']:5.2f} s, same {v['warm']['text'] == row['full']['text']}"
                          for k, v in row["settings"].items())
        print(f"{q[:44]:44s} {row['full']['prompt_tokens']:5d} tok full {row['full']['ttft_s']:5.2f} s | {line}",
              flush=True)
    cfg = pipe.model.config  # a cached token: layers x (keys, values) x KV heads x head size x element size
    if not hasattr(cfg, "num_key_value_heads"):  # llama.cpp: what its sequence states took, per token stored
        store = pipe._source_store
        stored = sum(r["settings"][str(recompute[-1])]["cold"]["stored"] for r in rows[-1:])
        return pipe, rows, store.memory_used / max(1, stored) * 1000
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * next(pipe.model.parameters()).element_size()
    return pipe, rows, per_token * 1000


if __name__ == "__main__":
    from ragspec.cpu_flags import read_cpuinfo

    ap = argparse.ArgumentParser()
    ap.add_argument("index")
    ap.add_argument("--pipeline", default=None)
    ap.add_argument("--recompute", default="4", help="comma-separated first-k recompute settings")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--source-tokens", default="off")
    ap.add_argument("--questions", type=int, default=len(QUESTIONS))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ks = [k.strip() for k in a.recompute.split(",") if k.strip()]
    model, flags = read_cpuinfo()
    simd = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")) or f in ("f16c", "sse4_2"))
    print(f"CPU: {model}; flags: {' '.join(simd)}", flush=True)
    pipe, rows, per_1k = measure(a.index, a.pipeline, ks, a.max_new_tokens, a.source_tokens, a.questions)
    print(f"model {pipe.spec.generator.model} · {pipe.choice.backend if pipe.choice else ''}/"
          f"{pipe.choice.dtype if pipe.choice else ''} · source budget {a.source_tokens} · "
          f"store {per_1k / 1e6:.1f} MB per 1,000 tokens")
    med = lambda xs: statistics.median(xs)  # noqa: E731
    full = med([r["full"]["ttft_s"] for r in rows])
    full_prefill = med([r["full"]["prefill_s"] for r in rows])
    summary = {"full_median_ttft_s": full, "full_median_prefill_s": full_prefill, "settings": {}}
    print(f"full prefill: median prefill {full_prefill:.2f} s, median TTFT {full:.2f} s")
    for k in ks:
        s = {m: med([r["settings"][str(k)][m]["ttft_s"] for r in rows]) for m in ("cold", "warm", "disk")}
        same = sum(r["settings"][str(k)]["warm"]["text"] == r["full"]["text"] for r in rows)
        cold_same = sum(r["settings"][str(k)]["warm"]["text"] == r["settings"][str(k)]["cold"]["text"] for r in rows)
        reused = statistics.mean(r["settings"][str(k)]["warm"]["reused"] / r["settings"][str(k)]["warm"]["prompt_tokens"]
                                 for r in rows)
        summary["settings"][str(k)] = {**{f"{m}_median_ttft_s": v for m, v in s.items()}, "same_as_full": same,
                                       "cold_same_as_warm": cold_same, "mean_reused_share": round(reused, 3)}
        p = {m: med([r["settings"][str(k)][m]["prefill_s"] for r in rows]) for m in ("cold", "warm", "disk")}
        summary["settings"][str(k)].update({f"{m}_median_prefill_s": v for m, v in p.items()})
        print(f"recompute {k:>6}: median prefill cold {p['cold']:.2f} s · warm {p['warm']:.2f} s · disk "
              f"{p['disk']:.2f} s; median TTFT cold {s['cold']:.2f} s ({s['cold'] / full:.2f}×) · warm "
              f"{s['warm']:.2f} s ({s['warm'] / full:.2f}×) · disk {s['disk']:.2f} s ({s['disk'] / full:.2f}×) · "
              f"answers identical to full prefill {same}/{len(rows)} · warm = cold {cold_same}/{len(rows)} · "
              f"{reused:.0%} of the prompt reused", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"cpu": {"model": model, "flags": simd}, "model": pipe.spec.generator.model,
                       "mb_per_1k_tokens": per_1k / 1e6, "summary": summary, "rows": rows}, fh, indent=1)

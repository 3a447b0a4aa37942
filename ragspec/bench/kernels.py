"""CPU kernel figures for `generator.dtype`: GEMM throughput and a model's prefill / verify cost per dtype.

`python -m ragspec.bench.kernels [--model qwen2.5-coder-0.5b-instruct] [--dtypes float32,bfloat16,int8]
[--threads 2] [--prompt-tokens 1000] [--rounds 3] [--attention sdpa] [--json out.json]` — run it alone on the
machine (timings). RAGSPEC_EXACT_ATTENTION=0 measures bf16/int8 with PyTorch's attention instead (not identical
to vanilla); `--attention sdpa` adds float32 rows under transformers' own attention, beside ragspec's default.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ragspec.decoding.backends.transformers import cache_arg


def _median_s(f, reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def gemm_rates(m: int = 1024, k: int = 896, n: int = 4864, reps: int = 3) -> dict[str, float | None]:
    """G(FL)OP/s of an [m, k] × [k, n] product (Qwen2.5-0.5B's gate/up projection over 1024 tokens)."""
    from ragspec.runtime.cpu_linear import PackedLinear, bf16_packing_available, packing_available
    from ragspec.runtime.int8_linear import Int8Linear

    torch.manual_seed(0)
    x, lin = torch.randn(m, k), torch.nn.Linear(k, n, bias=False)
    ops = 2 * m * k * n
    out: dict[str, float | None] = {}
    with torch.inference_mode():
        out["fp32 F.linear (MKL)"] = ops / _median_s(lambda: lin(x), reps) / 1e9
        packed = PackedLinear(lin) if packing_available() else None
        out["fp32 packed (oneDNN)"] = ops / _median_s(lambda: packed(x), reps) / 1e9 if packed else None
        lb, xb = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16), x.bfloat16()
        out["bf16 F.linear"] = ops / _median_s(lambda: lb(xb), reps) / 1e9
        packed_b = PackedLinear(lb) if bf16_packing_available() else None
        out["bf16 packed (oneDNN)"] = ops / _median_s(lambda: packed_b(xb), reps) / 1e9 if packed_b else None
        if hasattr(torch, "_int_mm"):
            xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
            wq = torch.randint(-127, 128, (n, k), dtype=torch.int8)
            out["int8 torch._int_mm"] = ops / _median_s(lambda: torch._int_mm(xq, wq.t()), 1) / 1e9
        q = Int8Linear(lin, "fp32")
        out["int8 layer, fp32 kernel (quantise + GEMM)"] = ops / _median_s(lambda: q(x), reps) / 1e9
    return out


def model_costs(name: str, dtypes: list[str], prompt_tokens: int, rounds: int = 3, sizes=(1, 8, 16),
                reps: int = 3, attention: tuple[str, ...] = ()) -> list[dict]:
    """Per dtype: prefill tok/s of a `prompt_tokens` prompt, then t(n) ms, a forward of n tokens over that cache.
    The models load once and are measured in turns, `rounds` times; each figure is the median over rounds (a
    shared machine's noise hits every dtype alike). `attention`: more float32 rows, the same model run under
    each named attention implementation (e.g. transformers' `sdpa` beside ragspec's `ragspec_sdpa`)."""
    from transformers import DynamicCache

    from ragspec.models.generator import load_generator

    models = {dt: load_generator(name, "cpu", dt)[0] for dt in dtypes}
    kernels = {dt: models[dt].config._attn_implementation for dt in dtypes}
    if attention:
        fp32 = models.get("float32") or load_generator(name, "cpu", "float32")[0]
        for impl in attention:
            models[f"float32/{impl}"], kernels[f"float32/{impl}"] = fp32, impl
    dtypes = list(models)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 30000, (1, prompt_tokens), generator=gen)
    steps = {n: torch.randint(100, 30000, (1, n), generator=gen) for n in sizes}
    samples: dict[str, dict[str, list[float]]] = {dt: {} for dt in dtypes}
    with torch.inference_mode():
        for model in models.values():
            model(input_ids=ids[:, :32], logits_to_keep=1)  # warm-up
        for _ in range(rounds):
            for dt, model in models.items():
                model.set_attn_implementation(kernels[dt])
                cache = DynamicCache(config=model.config)
                t = time.perf_counter()
                model(input_ids=ids, **cache_arg(model, cache), use_cache=True, logits_to_keep=1)
                samples[dt].setdefault("prefill tok/s", []).append(prompt_tokens / (time.perf_counter() - t))
                for n, new in steps.items():
                    pos = torch.arange(prompt_tokens, prompt_tokens + n)[None]

                    def step(model=model, new=new, pos=pos, cache=cache):
                        model(input_ids=new, position_ids=pos, **cache_arg(model, cache), use_cache=True)
                        for layer in cache.layers:
                            layer.keys = layer.keys[:, :, :prompt_tokens]
                            layer.values = layer.values[:, :, :prompt_tokens]

                    samples[dt].setdefault(f"t({n}) ms", []).append(_median_s(step, reps) * 1000)
    return [{"dtype": dt.split("/")[0], "attention": kernels[dt],
             **{k: sorted(v)[len(v) // 2] for k, v in samples[dt].items()}} for dt in dtypes]


def main(argv=None) -> None:
    from ragspec.bench.decoding import cpu_info
    from ragspec.models.registry import DEFAULT_GENERATOR

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_GENERATOR)
    p.add_argument("--dtypes", default="float32,bfloat16,int8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--attention", default="", help="comma-separated attention implementations to add for float32")
    p.add_argument("--sizes", default="1,8,16", help="t(n) for these n")
    p.add_argument("--no-gemm", action="store_true")
    p.add_argument("--json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"cpu": cpu_info(), "gemm_1024x896x4864": None if args.no_gemm else gemm_rates(), "models": []}
    if result["gemm_1024x896x4864"]:
        for k, v in result["gemm_1024x896x4864"].items():
            print(f"{k:45s} {'n/a' if v is None else f'{v:7.1f} G(FL)OP/s'}", flush=True)
    result["models"] = model_costs(args.model, [d for d in args.dtypes.split(",") if d], args.prompt_tokens,
                                   args.rounds, tuple(int(n) for n in args.sizes.split(",")),
                                   attention=tuple(a for a in args.attention.split(",") if a))
    for row in result["models"]:
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

"""What a step costs when several generations share its forward (`runtime/step_forward.step_forward_many`).

    python examples/batched_steps.py MODEL [--context 800] [--json out.json]

Times, over caches of `--context` positions each: one generation's forward of n rows alone, and k generations'
forwards of r rows each in one forward (median of 5). Prints the CPU flags with the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import DynamicCache


def main(argv=None) -> int:
    from ragspec.cpu_flags import read_cpuinfo
    from ragspec.decoding.backends.transformers import cache_arg
    from ragspec.models.generator import load_generator
    from ragspec.runtime.growing_cache import growing
    from ragspec.runtime.step_forward import step_forward_many

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=800)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    model, _ = load_generator(args.model, dtype="gguf")
    n = args.context

    def prefilled(seed):
        ids = torch.randint(100, 20000, (1, n), generator=torch.Generator().manual_seed(seed))
        cache = growing(DynamicCache(config=model.config))
        model(input_ids=ids, **cache_arg(model, cache), use_cache=True, logits_to_keep=1)
        return cache

    def median_ms(k, rows, caches):
        times = []
        for _ in range(5):
            parts = [(torch.randint(100, 20000, (1, rows)), torch.arange(n, n + rows)[None], None, c)
                     for c in caches[:k]]
            t = time.perf_counter()
            assert step_forward_many(model, parts) is not None, "this model's steps cannot share a forward"
            times.append((time.perf_counter() - t) * 1000)
            for c in caches[:k]:
                for layer in c.layers:
                    layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
        return round(sorted(times)[2], 1)

    cpu, flags = read_cpuinfo()
    out = {"model": args.model, "context": n, "cpu": cpu, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "cpu_flags": sorted(set(flags) & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8"}),
           "alone_ms": {}, "together_ms": {}}
    with torch.inference_mode():
        caches = [prefilled(s) for s in range(8)]
        for rows in (1, 2, 4, 8, 16, 32):
            out["alone_ms"][rows] = median_ms(1, rows, caches)
        for k, rows in ((2, 1), (4, 1), (8, 1), (2, 4), (4, 4), (8, 4)):
            out["together_ms"][f"{k}x{rows}"] = median_ms(k, rows, caches)
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

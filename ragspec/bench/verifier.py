"""The verifier against llama.cpp on one machine: the calibration's own measurement of each candidate in interleaved
rounds, and the GGUF kernel's throughput by row count.

`python -m ragspec.bench.verifier --model qwen2.5-coder-0.5b-instruct --rounds 2` loads llama.cpp and
transformers/gguf in turn (`models.machine.measure_candidate`: prefill of a 1,024-token prompt, t(n) over it) and
prints one JSON line per candidate and round, with the CPU flags first: ratios are read within one run, since a
shared machine's speed moves from hour to hour. `--kernel` instead runs every linear of the 0.5B's shapes (random
blocks, 24 layers as a step does; `--head` adds the 151,936-row head) through `ragspec_gguf::qmatmul` for each
row count and prints ms and GOP/s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

# the 0.5B's linears of one layer: (outputs, inputs, kernel format 1 = u5 / 2 = s8 / 3 = u6 / 4 = u4k), as its
# Q4_K_M GGUF maps (its ffn_down is Q6_K in half the layers, Q4_K in the others)
LAYER_05B = [(896, 896, 1), (128, 896, 1), (128, 896, 2), (896, 896, 1), (4864, 896, 1), (4864, 896, 1),
             (896, 4864, 3)]
LAYER_05B_ODD = LAYER_05B[:-1] + [(896, 4864, 4)]


def candidates(model: str, rounds: int) -> None:
    from ragspec.models.machine import measure_candidate

    for r in range(rounds):
        for backend, dtype in (("llama.cpp", "auto"), ("transformers", "gguf")):
            m = measure_candidate(model, backend, dtype, repeats=5)
            print(json.dumps({"round": r, "candidate": f"{backend}/{dtype}",
                              **{k: m[k] for k in ("prefill_tps", "ms", "cpu_share")}}), flush=True)


def kernel(rows: list[int], head: bool, reps: int = 5) -> None:
    import torch

    from ragspec.models.gguf_kernel import load_kernels

    ops = load_kernels()
    g = torch.Generator().manual_seed(0)

    def blocks(n, k, fmt):
        groups = k // 32
        w = torch.randint(0, 256, (n // 8, groups, 256 if fmt == 2 else 128), dtype=torch.uint8, generator=g)
        wh = torch.randint(0, 256, (n // 8, groups, {1: 32, 3: 64}.get(fmt, 0)), dtype=torch.uint8, generator=g)
        if fmt >= 3:  # K-quants: D (and Dmin) per 8 groups, byte scales per group
            d = torch.full((n // 8, groups // 8, 8 * (fmt - 2)), 0.001, dtype=torch.float16).view(torch.int16)
            return k, n, fmt, w, wh, d, torch.randint(0, 64, (n // 8, groups, 16), dtype=torch.uint8, generator=g)
        d = torch.full((n // 8, groups, 8), 0.01, dtype=torch.float16).view(torch.int16)
        return k, n, fmt, w, wh, d, (d.clone() if fmt != 2 else torch.empty(0, dtype=torch.int16))

    linears = [blocks(n, k, f) for i in range(24) for n, k, f in (LAYER_05B if i % 2 == 0 else LAYER_05B_ODD)]
    linears += [blocks(151936, 896, 2)] if head else []
    macs = sum(k * n for k, n, *_ in linears)
    for m in rows:
        xs = {k: ops.quantize_rows(torch.randn(m, k)) for k in {k for k, *_ in linears}}
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            for k, _n, fmt, w, wh, d, mn in linears:
                ops.qmatmul(*xs[k], w, wh, d, mn, fmt)
            best = min(best, time.perf_counter() - t)
        print(json.dumps({"rows": m, "ms": round(best * 1000, 2), "gops": round(2 * macs * m / best / 1e9)}),
              flush=True)


def main(argv=None) -> None:
    from ragspec.cpu_flags import cpu_flags

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kernel", action="store_true", help="the GGUF kernel alone, by row count")
    p.add_argument("--rows", default="1,4,8,16,32,64")
    p.add_argument("--head", action="store_true", help="with --kernel: the 0.5B's lm_head too")
    args = p.parse_args(argv)
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))))
    print(json.dumps({"utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                      "model": args.model, "flags": flags}), flush=True)
    if args.kernel:
        kernel([int(r) for r in args.rows.split(",")], args.head)
    else:
        candidates(args.model, args.rounds)


if __name__ == "__main__":
    main()

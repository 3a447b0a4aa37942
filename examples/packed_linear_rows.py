"""Whether oneDNN's float32 linear gives a row alone the bits it gives the same row among others, per weight shape,
and what running one row as two costs (`runtime/cpu_linear.PackedLinear`, docs/decoding.md "CPU dtypes").

For each shape (the 0.5B's, the 1.5B's and SmolLM2's linears): one row alone against the same row at 2 rows, every
row count from 2 to 300 against 2 rows, then the median time of one row and of two. Run it alone on the machine.
Usage: python examples/packed_linear_rows.py [--json OUT]
"""

import argparse
import json
import statistics
import time

import torch
from torch import nn

from ragspec.cpu_flags import read_cpuinfo
from ragspec.runtime.cpu_linear import PackedLinear

SHAPES = [(576, 576), (576, 1536), (1536, 576), (576, 49152), (896, 4864), (4864, 896), (1536, 1536),
          (1536, 8960), (8960, 1536), (1536, 151936)]


def median_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t) / reps * 1000)
    return statistics.median(times)


def measure(k: int, n: int) -> dict:
    torch.manual_seed(0)
    lin = PackedLinear(nn.Linear(k, n, bias=False))
    run = lin._run  # oneDNN as it is, without the one-row rule
    x = torch.randn(300, k)
    with torch.inference_mode():
        alone = torch.cat([run(x[j : j + 1]) for j in range(300)])
        in_two = torch.cat([run(x[j : j + 1].expand(2, -1).contiguous())[:1] for j in range(300)])
        counts = list(range(2, 70)) + [100, 128, 129, 200, 256, 300]
        other = [m for m in counts if not torch.equal(run(x[:m]), in_two[:m])]
        one, two = x[:1], x[:1].expand(2, -1).contiguous()
        t1, t2 = median_ms(lambda: run(one)), median_ms(lambda: run(two))
    return {"shape": [k, n], "one_row_differs": not torch.equal(alone, in_two), "counts_differing_from_two": other,
            "probe_runs_one_as_two": lin.one_row_as_two, "ms_one_row": round(t1, 4), "ms_two_rows": round(t2, 4),
            "two_over_one": round(t2 / t1, 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    model, flags = read_cpuinfo()
    wanted = [f for f in flags if f.startswith(("avx", "amx", "fma"))]
    print(f"CPU: {model}; flags: {' '.join(wanted)}; torch threads {torch.get_num_threads()}")
    rows = []
    for k, n in SHAPES:
        r = measure(k, n)
        rows.append(r)
        print(f"{k:>5}->{n:<6} one row differs: {r['one_row_differs']!s:5}  probe says two rows: "
              f"{r['probe_runs_one_as_two']!s:5}  counts 2-300 unlike 2: {r['counts_differing_from_two'][:8]}  "
              f"one row {r['ms_one_row']:.3f} ms, two {r['ms_two_rows']:.3f} ms ({r['two_over_one']:.2f}x)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": {"model": model, "flags": wanted}, "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
                       "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()

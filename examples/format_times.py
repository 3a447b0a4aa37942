"""Time a model's GGUF linears by kernel format at M prompt rows (`ragspec_gguf::qmatmul` alone), with a hash of
the u6 outputs: run it once per build to compare two versions of the kernels (one from a worktree of the older
commit, the other from this one), alternating the two a few times, since a build is one per process. The formats
a change leaves alone serve as the control for the machine's drift between runs.

    PYTHONPATH=<tree>[:examples/avx2_emulation] .venv/bin/python examples/format_times.py [--rows 538] [--reps 3]

Prints one JSON line: the ragspec it ran, the kernel build, the u6 hash and the median ms per format
(1 u5, 2 s8, 3 u6, 4 u4k, 5 u4k8) over `reps` passes after a warm-up.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import time

import torch

import ragspec
from ragspec.models.generator import load_generator
from ragspec.runtime.gguf_kernel import build_key, load_kernels
from ragspec.runtime.gguf_linear import SUPERBLOCK, GGUFLinear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rows", type=int, default=538)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    model, _ = load_generator(a.model, "cpu", "gguf")
    ops = load_kernels()
    linears = [m for n, m in model.named_modules() if isinstance(m, GGUFLinear) and "lm_head" not in n]
    inputs, times, u6 = {}, collections.defaultdict(list), []
    with torch.inference_mode():
        for rep in range(a.reps + 1):
            spent = collections.defaultdict(float)
            for m in linears:
                w, wh, d, mn = m.kernel_args()[:4]
                k, span = w.shape[1] * 32, 256 if m.code == SUPERBLOCK else 32
                if (k, span) not in inputs:
                    x = torch.randn(a.rows, k, generator=torch.Generator().manual_seed(k))
                    inputs[k, span] = ops.quantize_rows(x, span)
                t = time.perf_counter()
                y = ops.qmatmul(*inputs[k, span], w, wh, d, mn, m.code)
                spent[m.code] += time.perf_counter() - t
                if rep == 0 and m.code == 3:
                    u6.append(y.numpy().tobytes())
            if rep:  # the first pass warms up
                for code, s in spent.items():
                    times[code].append(s)
    print(json.dumps({"ragspec": ragspec.__file__, "build": build_key(), "rows": a.rows,
                      "u6_hash": hashlib.sha256(b"".join(u6)).hexdigest()[:16],
                      **{f"fmt{c}_ms": round(sorted(v)[len(v) // 2] * 1000, 1) for c, v in sorted(times.items())}}))


if __name__ == "__main__":
    main()

"""The verifier against llama.cpp on one machine: the calibration's own measurement of each candidate in interleaved
rounds, and the GGUF kernel's throughput by row count.

`python -m ragspec.bench.verifier --model qwen2.5-coder-0.5b-instruct --rounds 2` loads llama.cpp and
transformers/gguf in turn (`models.machine_measure.measure_candidate`: prefill of a 1,024-token prompt, t(n) over it) and
prints one JSON line per candidate and round, with the CPU flags first: ratios are read within one run, since a
shared machine's speed moves from hour to hour. `--interleave N` loads both at once over the same 1,024-token
context and alternates single steps (t(1), then t(16)) N times, a pause between them so neither's idle threads
spin on the other's cores: on a machine whose speed moves by the minute, the per-pair ratio is the steadiest
figure. `--kernel` instead runs every linear of the 0.5B's shapes (random
blocks, 24 layers as a step does; `--head` adds the 151,936-row head) through `ragspec_gguf::qmatmul` for each
row count and prints ms and GOP/s. `--amx N` (CPUs with AMX) runs dtype gguf with the kernel's AMX tiles off and on
in turn, prefills and steps, and prints the per-pair ratio and whether the logits were the same bits; `--paired N`
(AVX2 without VNNI) likewise switches the integer dot between one chunk per widening and up to four, and
`--unpacked N` (AVX2 without AVX-512) u5/u6 blocks between unpacked per tile of rows and once per call. `--q8k N`
likewise switches the Q4_K linears between the group activation rule and llama.cpp's Q8_K rule (u4k8; other
numerics, so it prints the largest logit difference too). `--prompt-copy N` switches every linear's prompt
chunks between the integer kernel and the opt-in bf16 prompt copy (`RAGSPEC_GGUF_PROMPT`); oneDNN runs the copy
with AMX only when `ONEDNN_MAX_CPU_ISA=AVX512_CORE_AMX` is set before the run (ragspec caps it otherwise).
`--int8-prompt N` likewise switches prompt reads between the integer kernel and the int8 prompt copy
(`RAGSPEC_GGUF_PROMPT=int8`), prefills only (steps never read the copy), and prints the copy's size.
`--cache-only N` runs the backend's prefill with the last layer whole and cut to its keys and values in the
chunks read for the cache alone (`runtime/cache_only.py`), N of each, and says whether the root's logits were the
same bits. `--prompt-kernels N` switches prompt rows between the step kernels and the prompt kernels (`prompt_attention.cpp`;
with the int8 copy, `int8_rows.cpp` too). `--step-forward N` runs dtype gguf's steps (1, 4 and 16 rows over 1,024 tokens) on the module tree and on the lean
step loop (`runtime/step_forward.py`) in turn, N of each, and says whether the logits were the same bits.
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
    from ragspec.machine.measure import measure_candidate

    for r in range(rounds):
        for backend, dtype in (("llama.cpp", "auto"), ("transformers", "gguf")):
            m = measure_candidate(model, backend, dtype, context=1024, repeats=5, assembly=True)
            print(json.dumps({"round": r, "candidate": f"{backend}/{dtype}",
                              **{k: m[k] for k in ("prefill_tps", "ms", "cpu_share")}}), flush=True)


def interleaved(model: str, steps: int, sizes=(1, 16), context: int = 1024, pause_s: float = 0.005) -> None:
    import numpy as np
    import torch
    from transformers import DynamicCache

    from ragspec.decoding.backends.transformers import cache_arg
    from ragspec.models.generator import load_generator, load_llama_generator
    from ragspec.runtime.growing_cache import growing

    llama, _ = load_llama_generator(model)
    hf, _ = load_generator(model, "cpu", "gguf")
    rng = np.random.default_rng(0)
    ctx = rng.integers(100, 30000, context).tolist()
    try:
        llama.clear()
        llama.feed(ctx, 0)
        with torch.inference_mode():
            cache = growing(DynamicCache(config=hf.config))
            hf(input_ids=torch.tensor([ctx]), **cache_arg(hf, cache), use_cache=True, logits_to_keep=1)
            for n in sizes:
                toks = rng.integers(100, 30000, n).tolist()
                rows = [(t, context + k, [0], True) for k, t in enumerate(toks)]
                ids, pos = torch.tensor([toks]), torch.arange(context, context + n)[None]
                ms = {"llama.cpp": [], "transformers/gguf": []}
                for _ in range(steps + 1):
                    time.sleep(pause_s)
                    t = time.perf_counter()
                    llama.decode_small(rows)
                    ms["llama.cpp"].append((time.perf_counter() - t) * 1000)
                    llama.lc.llama_memory_seq_rm(llama.mem, 0, context, -1)
                    time.sleep(pause_s)
                    t = time.perf_counter()
                    hf(input_ids=ids, position_ids=pos, **cache_arg(hf, cache), use_cache=True)
                    ms["transformers/gguf"].append((time.perf_counter() - t) * 1000)
                    for layer in cache.layers:  # back to the context only
                        layer.keys, layer.values = layer.keys[:, :, :context], layer.values[:, :, :context]
                a, b = np.array(ms["transformers/gguf"][1:]), np.array(ms["llama.cpp"][1:])
                print(json.dumps({"n": n, "steps": steps, **{k: round(float(np.median(v[1:])), 2) for k, v in ms.items()},
                                  "ratio_median": round(float(np.median(a / b)), 3),
                                  "ratio_q25_q75": [round(float(q), 3) for q in np.quantile(a / b, [0.25, 0.75])]}),
                      flush=True)
    finally:
        llama.close()


def op_pairs(model: str, rounds: int, op: str, on: int, names: tuple[str, str], missing: str) -> None:
    """dtype gguf with one of the kernel's runtime switches (`torch.ops.ragspec_gguf.<op>(mode)`: 0, then `on`),
    alternated: the same build, the same bits; left at `on` after. `missing`: said where the switch is off here."""
    from ragspec.models.generator import load_generator
    from ragspec.runtime.gguf_kernel import load_kernels

    switch = getattr(load_kernels(), op)
    if not switch(-1):
        print(json.dumps({op: missing}))
        return
    hf, _ = load_generator(model, "cpu", "gguf")
    try:
        switched_pairs(hf, rounds, lambda mode: switch(on if mode else 0), names)
    finally:
        switch(on)


def amx_pairs(model: str, rounds: int) -> None:
    """dtype gguf with the kernel's AMX tiles off and on."""
    op_pairs(model, rounds, "amx", 1, ("off_ms", "amx_ms"), "not on this CPU or build")


def paired_pairs(model: str, rounds: int) -> None:
    """dtype gguf on an AVX2 CPU without VNNI with one chunk's products widened at a time (0) and up to four
    chunks' added in int16 before widening (2, the kernel's default)."""
    op_pairs(model, rounds, "paired", 2, ("single_ms", "paired_ms"), "not in this build (VNNI, or no AVX2)")


def unpacked_pairs(model: str, rounds: int) -> None:
    """dtype gguf on an AVX2 CPU without AVX-512 with u5/u6 blocks unpacked per tile of rows (0) and once per call
    (1, the kernel's default)."""
    op_pairs(model, rounds, "unpacked", 1, ("per_tile_ms", "once_ms"), "not in this build (AVX-512, or no AVX2)")


def q8k_pairs(model: str, rounds: int) -> None:
    """dtype gguf with its Q4_K linears on the group activation rule (u4k) and on the Q8_K rule (u4k8): loaded as
    RAGSPEC_GGUF_Q8K=1 loads them (the fused MLPs decide which of theirs keep it), then switched back and forth."""
    import os
    from unittest import mock

    from ragspec.models.generator import load_generator
    from ragspec.runtime.gguf_formats import FORMATS, SUPERBLOCK
    from ragspec.runtime.gguf_linear import GGUFLinear

    with mock.patch.dict(os.environ, {"RAGSPEC_GGUF_Q8K": "1"}):
        hf, _ = load_generator(model, "cpu", "gguf")
    q4k = [m for m in hf.modules() if isinstance(m, GGUFLinear) and m.code == SUPERBLOCK]
    print(json.dumps({"q4k_linears_switched": len(q4k)}), flush=True)

    def switch(mode):
        for m in q4k:
            m.code = SUPERBLOCK if mode else FORMATS["u4k"]

    switched_pairs(hf, rounds, switch, ("group_ms", "q8k_ms"))
    switch(0)


def prompt_copy_pairs(model: str, rounds: int) -> None:
    """dtype gguf loaded with the bf16 prompt copy, its prompt chunks switched between the integer kernel (0) and
    the copy (1); one-token steps use the integer kernel either way."""
    import os
    from unittest import mock

    from ragspec.models.generator import load_generator
    from ragspec.runtime.fused_layers import FusedMLP
    from ragspec.runtime.gguf_linear import GGUFLinear

    with mock.patch.dict(os.environ, {"RAGSPEC_GGUF_PROMPT": "1"}):
        hf, _ = load_generator(model, "cpu", "gguf")
    linears = {m: m.prompt for m in hf.modules() if isinstance(m, GGUFLinear) and m.prompt is not None}
    mlps = [m for m in hf.modules() if isinstance(m, FusedMLP)]
    print(json.dumps({"onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"), "copies": len(linears),
                      "copy_gb": round(sum(m.nbytes()[1] for m in linears) / 1e9, 2)}), flush=True)
    if not linears:
        raise SystemExit("no prompt copy here: it needs native bf16 and oneDNN's bf16 packing")

    def switch(mode):
        for m, copy in linears.items():
            m.prompt = copy if mode else None
        for m in mlps:
            m._prompt = bool(mode)

    switched_pairs(hf, rounds, switch, ("int_ms", "copy_ms"), sizes=(1,))


def int8_prompt_pairs(model: str, rounds: int) -> None:
    """dtype gguf loaded with the int8 prompt copy (RAGSPEC_GGUF_PROMPT=int8), prefills read as prompt
    (`prompt_mode.prompt_forward`) with the copy switched off (0: the integer kernel) and on (1). Steps never
    read the copy, so only prefills are measured."""
    import os
    from unittest import mock

    from ragspec.models.generator import load_generator
    from ragspec.runtime.fused_layers import FusedMLP
    from ragspec.runtime.gguf_linear import GGUFLinear
    from ragspec.runtime.prompt_mode import prompt_forward

    with mock.patch.dict(os.environ, {"RAGSPEC_GGUF_PROMPT": "int8"}):
        hf, _ = load_generator(model, "cpu", "gguf")
    linears = {m: m.prompt_int8 for m in hf.modules() if isinstance(m, GGUFLinear) and m.prompt_int8 is not None}
    mlps = [m for m in hf.modules() if isinstance(m, FusedMLP)]
    print(json.dumps({"copies": len(linears), "copy_gb": round(sum(m.nbytes()[1] for m in linears) / 1e9, 2),
                      "blocks_gb": round(sum(m.nbytes()[0] for m in hf.modules() if isinstance(m, GGUFLinear)) / 1e9,
                                         2)}), flush=True)
    if not linears:
        raise SystemExit("no int8 prompt copy here: it needs int8 units (VNNI/AMX) that torch._int_mm runs on")

    def switch(mode):
        for m, copy in linears.items():
            m.use_int8_copy(copy if mode else None)
        for m in mlps:
            m._int8 = bool(mode)

    with prompt_forward():
        switched_pairs(hf, rounds, switch, ("int_ms", "int8_ms"), sizes=())
    switch(1)


def prompt_kernel_pairs(model: str, rounds: int) -> None:
    """dtype gguf, prompts read (`prompt_mode.prompt_forward`) on the step kernels (0) and on
    `prompt_attention.cpp` (1); with the int8 prompt copy (where there are int8 units), its rows on PyTorch's
    per-row passes (0) and `int8_rows.cpp` (1) too. The attention's arithmetic differs, so the logits do too: the
    largest difference is printed."""
    import os
    from unittest import mock

    from ragspec.models.generator import load_generator
    from ragspec.runtime.gguf_linear import GGUFLinear
    from ragspec.runtime.model_runtime import runtime_of
    from ragspec.runtime.prompt_mode import prompt_forward

    with mock.patch.dict(os.environ, {"RAGSPEC_GGUF_PROMPT": "int8"}):
        hf, _ = load_generator(model, "cpu", "gguf")
    copies = [m.prompt_int8 for m in hf.modules() if isinstance(m, GGUFLinear) and m.prompt_int8 is not None]
    ops = copies[0].ops if copies else None  # none without int8 units: the attention alone switches
    runtime = runtime_of(hf)

    def switch(mode):
        for c in copies:
            c.ops = ops if mode else None
        runtime.prompt_attention = bool(mode)

    with prompt_forward():
        switched_pairs(hf, rounds, switch, ("before_ms", "after_ms"), sizes=())
    switch(1)


def step_forward_pairs(model: str, rounds: int) -> None:
    """dtype gguf's steps through transformers' module tree (0) and the lean step loop (1), alternated."""
    from ragspec.models.generator import load_generator

    hf, _ = load_generator(model, "cpu", "gguf")
    lean = vars(hf).get("forward")
    if lean is None:
        raise SystemExit("the lean step loop is not installed for this model (RAGSPEC_STEP_FORWARD=0?)")

    def switch(mode):
        if mode:
            hf.forward = lean
        else:
            vars(hf).pop("forward", None)

    switched_pairs(hf, rounds, switch, ("modules_ms", "step_loop_ms"), prompts=(), sizes=(1, 4, 16), steps=rounds)
    switch(1)


def cache_only_pairs(model: str, rounds: int, prompts=(353, 538, 1024)) -> None:
    """dtype gguf's prefill as the backend reads a prompt (its chunks; the last token alone, as a step) with the
    last layer's o_proj and MLP run (0) and skipped (1) in the chunks read for the cache alone
    (`runtime/cache_only.py`), alternated; the root's logits compared."""
    import numpy as np
    import torch

    from ragspec.decoding.backends.transformers import TransformersBackend
    from ragspec.models.generator import load_generator
    from ragspec.runtime.cache_only import switch

    hf, _ = load_generator(model, "cpu", "gguf")
    rng = np.random.default_rng(0)
    try:
        for n in prompts:
            ms, same = {0: [], 1: []}, True
            for r in range(rounds + 1):  # a warm-up round first
                ids, root = rng.integers(100, 30000, n).tolist(), {}
                for mode in ((0, 1) if r % 2 else (1, 0)):
                    switch(bool(mode))
                    backend = TransformersBackend(hf)
                    t = time.perf_counter()
                    backend.prefill(ids)
                    if r:
                        ms[mode].append((time.perf_counter() - t) * 1000)
                    root[mode] = backend._root_logits.clone()
                same &= torch.equal(root[0], root[1])
            a, b = np.array(ms[0]), np.array(ms[1])
            print(json.dumps({"prefill_tokens": n, "whole_ms": round(float(np.median(a)), 1),
                              "cache_only_ms": round(float(np.median(b)), 1), "ratio": round(float(np.median(b / a)), 3),
                              "pairs": rounds, "same_root_logits": bool(same)}), flush=True)
    finally:
        switch(True)


def switched_pairs(hf, rounds: int, switch, names, prompts=(353, 1024), sizes=(1, 16, 64), steps: int = 20) -> None:
    """Runs alternated in one process between `switch(0)` and `switch(1)`: prefill of each prompt length in the
    backend's 512-token chunks, then single steps of each size over a 1,024-token context. One JSON line per
    measurement: the medians (`names`), the per-pair ratio 1 ÷ 0, whether the logits were identical and their
    largest difference."""
    import numpy as np
    import torch
    from transformers import DynamicCache

    from ragspec.decoding.backends.base import chunks
    from ragspec.decoding.backends.transformers import cache_arg
    from ragspec.runtime.growing_cache import growing

    rng = np.random.default_rng(0)

    def forward(ids, start, cache, keep=None):
        kw = {"logits_to_keep": keep} if keep else {}
        return hf(input_ids=torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids))[None],
                  **cache_arg(hf, cache), use_cache=True, **kw).logits

    def prefill(ids):
        cache = growing(DynamicCache(config=hf.config))
        logits = [forward(ids[a:b], a, cache, keep=1) for a, b in chunks(0, len(ids))]
        return cache, logits[-1]

    def pairs(label, run, n):
        ms, out = {0: [], 1: []}, {}
        for _ in range(n):
            for mode in (0, 1):
                switch(mode)
                t = time.perf_counter()
                out[mode] = run()
                ms[mode].append((time.perf_counter() - t) * 1000)
        a, b = np.array(ms[0]), np.array(ms[1])
        print(json.dumps({**label, names[0]: round(float(np.median(a)), 2), names[1]: round(float(np.median(b)), 2),
                          "ratio": round(float(np.median(b / a)), 3), "same_logits": bool(torch.equal(out[0], out[1])),
                          "max_logit_diff": round(float((out[0] - out[1]).abs().max()), 4)}), flush=True)

    with torch.inference_mode():
        for n in prompts:
            ids = rng.integers(100, 30000, n).tolist()
            pairs({"prefill_tokens": n}, lambda ids=ids: prefill(ids)[1], rounds)
        context = 1024
        switch(0)
        cache, _ = prefill(rng.integers(100, 30000, context).tolist())
        for n in sizes:
            toks = rng.integers(100, 30000, n).tolist()

            def step(toks=toks):
                logits = forward(toks, context, cache)
                for layer in cache.layers:  # back to the context only
                    layer.keys, layer.values = layer.keys[:, :, :context], layer.values[:, :, :context]
                return logits

            step()
            pairs({"n": n}, step, steps)


def kernel(rows: list[int], head: bool, reps: int = 5) -> None:
    import torch

    from ragspec.runtime.gguf_kernel import load_kernels

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
    p.add_argument("--interleave", type=int, default=0, metavar="N",
                   help="both candidates loaded at once, N single steps of each in turn (t(1), t(16))")
    p.add_argument("--amx", type=int, default=0, metavar="N",
                   help="dtype gguf with the AMX tiles off and on, N prefills of each in turn (then steps)")
    p.add_argument("--paired", type=int, default=0, metavar="N",
                   help="dtype gguf on AVX2 without VNNI: one chunk per widening and up to four, N prefills of each")
    p.add_argument("--unpacked", type=int, default=0, metavar="N",
                   help="dtype gguf on AVX2 without AVX-512: u5/u6 blocks unpacked per tile of rows and once per "
                        "call, N prefills of each")
    p.add_argument("--q8k", type=int, default=0, metavar="N",
                   help="dtype gguf's Q4_K linears on the group and the Q8_K activation rule, N prefills of each")
    p.add_argument("--prompt-copy", type=int, default=0, metavar="N",
                   help="dtype gguf's prompt chunks on the integer kernel and on the bf16 prompt copy, N of each")
    p.add_argument("--int8-prompt", type=int, default=0, metavar="N",
                   help="dtype gguf's prompts on the integer kernel and on the int8 prompt copy, N of each")
    p.add_argument("--prompt-kernels", type=int, default=0, metavar="N",
                   help="dtype gguf's prompt rows on the step kernels and on the prompt kernels (attention; the "
                        "int8 copy's steps where it runs), N of each")
    p.add_argument("--step-forward", type=int, default=0, metavar="N",
                   help="dtype gguf's steps on the module tree and on the lean step loop, N of each")
    p.add_argument("--cache-only", type=int, default=0, metavar="N",
                   help="dtype gguf's prefill with the last layer whole and cut to its keys and values in chunks "
                        "read for the cache, N of each")
    args = p.parse_args(argv)
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))))
    print(json.dumps({"utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                      "model": args.model, "flags": flags}), flush=True)
    if args.kernel:
        kernel([int(r) for r in args.rows.split(",")], args.head)
    elif args.amx:
        amx_pairs(args.model, args.amx)
    elif args.paired:
        paired_pairs(args.model, args.paired)
    elif args.unpacked:
        unpacked_pairs(args.model, args.unpacked)
    elif args.q8k:
        q8k_pairs(args.model, args.q8k)
    elif args.cache_only:
        cache_only_pairs(args.model, args.cache_only)
    elif args.prompt_copy:
        prompt_copy_pairs(args.model, args.prompt_copy)
    elif args.int8_prompt:
        int8_prompt_pairs(args.model, args.int8_prompt)
    elif args.prompt_kernels:
        prompt_kernel_pairs(args.model, args.prompt_kernels)
    elif args.step_forward:
        step_forward_pairs(args.model, args.step_forward)
    elif args.interleave:
        interleaved(args.model, args.interleave)
    else:
        candidates(args.model, args.rounds)


if __name__ == "__main__":
    main()

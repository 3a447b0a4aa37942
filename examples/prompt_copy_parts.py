"""Where the int8 prompt copy pays: one prompt read with the copy on every linear (`int8`), on the MLPs' alone
(`int8-mlp`), on gate and up alone, and on none, interleaved round by round in one process, with the copy's
bytes for each. The linears without a copy read the prompt on their GGUF blocks.

Usage: python examples/prompt_copy_parts.py [--model NAME] [--tokens 1024] [--rounds 5] [--json OUT]
Run it alone: the machine is shared and the rounds are compared by their medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ragspec.cpu_flags import read_cpuinfo

SETTINGS = ("int8", "int8-mlp", "gate-up", "none")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    from transformers import DynamicCache

    from ragspec.decoding.backends.base import PREFILL_CHUNK
    from ragspec.decoding.backends.transformers import cache_arg
    from ragspec.models.generator import load_generator
    from ragspec.runtime.fused_layers import FusedMLP
    from ragspec.runtime.gguf_linear import GGUFLinear, make_prompt_copies
    from ragspec.runtime.options import RuntimeOptions
    from ragspec.runtime.prompt_mode import prompt_forward, reading_prompt

    cpu, flags = read_cpuinfo()
    flags = [f for f in flags if f.startswith(("avx2", "avx512", "avx_vnni", "amx"))]
    print(f"CPU: {cpu} · flags: {' '.join(flags)}")
    model, _ = load_generator(a.model, "cpu", "gguf", RuntimeOptions(prompt_copy="int8"))
    make_prompt_copies(model)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, GGUFLinear) and m._int8 is not None}
    copies = {n: m._int8 for n, m in linears.items()}
    mlps = [m for m in model.modules() if isinstance(m, FusedMLP)]
    fused = FusedMLP.forward

    def gate_up_only(self, x):  # the copy for gate and up, down on its blocks
        if reading_prompt() and self._int8 and not self.down_proj.wants_int8:
            g, u = self.gate_proj.prompt_int8, self.up_proj.prompt_int8
            x_q, x_scale = g.quantize(x.reshape(-1, g.in_features).float())
            h = self.act_fn(g.product(x_q, x_scale)) * u.product(x_q, x_scale)
            return self.down_proj(h.reshape(*x.shape[:-1], g.out_features))
        return fused(self, x)

    FusedMLP.forward = gate_up_only

    def has_copy(setting: str, name: str) -> bool:
        return {"int8": True, "int8-mlp": ".mlp." in name, "none": False,
                "gate-up": ".gate_proj" in name or ".up_proj" in name}[setting]

    def use(setting: str) -> int:
        for n, m in linears.items():
            m.use_int8_copy(copies[n] if has_copy(setting, n) else None)
        for m in mlps:
            m._int8 = m.gate_proj.wants_int8 and m.up_proj.wants_int8
        return sum(c.nbytes() for n, c in copies.items() if has_copy(setting, n))

    ids = torch.randint(1000, 50000, (1, a.tokens))

    def read() -> float:
        cache = DynamicCache(config=model.config)
        t = time.perf_counter()
        with torch.inference_mode(), prompt_forward():
            for lo in range(0, a.tokens, PREFILL_CHUNK):
                model(input_ids=ids[:, lo : lo + PREFILL_CHUNK], **cache_arg(model, cache), use_cache=True,
                      logits_to_keep=1)
        return time.perf_counter() - t

    times = {s: [] for s in SETTINGS}
    sizes = {}
    for r in range(a.rounds + 1):
        for s in SETTINGS:
            sizes[s] = use(s)
            took = read()
            if r:  # the first round warms each setting
                times[s].append(took)
    base = statistics.median(times["int8"])
    rows = [{"setting": s, "copy_gb": round(sizes[s] / 1e9, 3), "read_s": round(statistics.median(times[s]), 3),
             "ratio_to_int8": round(statistics.median(times[s]) / base, 3)} for s in SETTINGS]
    for row in rows:
        print(json.dumps(row))
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu": cpu, "flags": flags, "date": time.strftime("%Y-%m-%d"),
                                            "model": a.model, "tokens": a.tokens, "rounds": a.rounds,
                                            "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

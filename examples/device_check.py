"""Check the decoding engine on whatever device this machine has (CUDA when present), without model packages.

Builds a randomly initialised model of Qwen2.5-0.5B's shape (the architecture code is the real one; only the
weights are random), then: t(n) for n = 1…256, greedy identity of every drafter with `generate` on a
repetitive prompt, and the per-step time split (draft, inputs, forward, accept, trim). Prints one JSON.

    python examples/device_check.py --tokenizer DIR [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from ragspec.bench.decoding import cpu_info, top2_margin
from ragspec.decoding.backends import calibrate
from ragspec.decoding.budget import AdaptiveBudget
from ragspec.decoding.drafters import make_drafter
from ragspec.decoding.drafters.oracle import OracleDrafter
from ragspec.decoding.generate import SpeculativeGenerator


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--sharpen", type=float, default=20.0)
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # random logits are nearly flat, so near-ties would decide; sharpen them (tied weights)
        model.model.embed_tokens.weight.mul_(a.sharpen)
    model = model.to(dtype=getattr(torch, a.dtype), device=a.device).eval()
    cost = calibrate(model, force=True)
    g = torch.Generator().manual_seed(1)
    base = torch.randint(100, 30000, (200,), generator=g).tolist()
    prompt = base + base[:150] + base[40:190]  # repeated stretches: the context can be copied
    eos = [cfg.vocab_size - 1]
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=a.device)
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=a.new,
                             eos_token_id=eos, pad_token_id=eos[0])
        if a.device == "cuda":
            torch.cuda.synchronize()
        vanilla_ms = (time.perf_counter() - t) * 1000
    ref = out[0, len(prompt):].tolist()
    result = {"device": a.device, "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None,
              "cpu": cpu_info(), "dtype": a.dtype, "torch": torch.__version__, "cost_model": cost.as_dict(),
              "vanilla_ms": round(vanilla_ms, 1), "methods": {}}
    for name in ("none", "pld", "trie", "suffix", "oracle"):
        drafter = OracleDrafter(ref, cost) if name == "oracle" else make_drafter(name)
        budget = 256 if name == "oracle" else AdaptiveBudget(cost)
        gen = SpeculativeGenerator(model, tok, drafter=drafter, max_new_tokens=a.new, eos_token_ids=eos, budget=budget)
        t = time.perf_counter()
        for _ in gen.stream(prompt):
            pass
        ms = (time.perf_counter() - t) * 1000
        s = gen.stats
        div = next((i for i, (x, y) in enumerate(zip(gen.tokens, ref)) if x != y), None)
        result["methods"][name] = {
            "identical": gen.tokens == ref,
            "divergence": None if div is None else {"position": div,
                                                    "top2_margin": round(top2_margin(model, prompt, ref[:div]), 5)}, "ms": round(ms, 1), "speedup": round(vanilla_ms / ms, 3),
            "tokens_per_step": round(s.mean_accepted, 2), "nodes_per_step": round(s.tree_nodes / s.steps, 1),
            "step_ms": {"draft": round(s.draft_ms / s.steps, 3),
                        **{k: round(v / s.steps, 3) for k, v in s.step_ms.items()}},
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

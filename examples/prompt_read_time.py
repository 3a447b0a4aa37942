"""How long dtype gguf takes to read a prompt: N random tokens in 512-token chunks as the backends read them
(the forwards marked as prompt reads), the median of R rounds after one warm-up, with the model's default prompt
copy (or RAGSPEC_GGUF_PROMPT's). It runs on older checkouts too (their `prompt_mode` lived in `decoding/`), so a
change can be timed before and after on one machine:

    git worktree add /tmp/before COMMIT
    (cd /tmp/before && PYTHONPATH=/tmp/before python /path/to/examples/prompt_read_time.py --model M)
    python examples/prompt_read_time.py --model M

Run it alone: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    from transformers import DynamicCache

    import ragspec
    from ragspec.cpu_flags import read_cpuinfo
    from ragspec.models.generator import load_generator

    try:
        from ragspec.runtime.prompt_mode import prompt_forward
    except ImportError:  # before the runtime had a room of its own
        from ragspec.decoding.prompt_mode import prompt_forward
    cpu, flags = read_cpuinfo()
    model, _ = load_generator(a.model, "cpu", "gguf")
    ids = torch.randint(1000, 50000, (1, a.tokens), generator=torch.Generator().manual_seed(0))

    def read() -> float:
        cache = DynamicCache(config=model.config)
        t = time.perf_counter()
        with torch.inference_mode(), prompt_forward():
            for lo in range(0, a.tokens, 512):
                model(input_ids=ids[:, lo : lo + 512], past_key_values=cache, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t

    read()
    times = [read() for _ in range(a.rounds)]
    print(json.dumps({"ragspec": ragspec.__file__, "cpu": cpu,
                      "flags": [f for f in flags if f.startswith(("avx2", "avx512", "avx_vnni", "amx"))],
                      "model": a.model, "tokens": a.tokens, "read_s": round(statistics.median(times), 3),
                      "rounds": [round(t, 3) for t in times]}))


if __name__ == "__main__":
    main()

"""How far a context drafter can go when it must find its copy from the tokens it has already seen.

The bench's `oracle` knows plain greedy's output, so it can start a copy anywhere. A real drafter (pld, trie,
suffix, hf-pld) can only continue from positions in the context that follow an occurrence of the last k
generated tokens. This replays plain greedy's recorded output (`"vanilla_outputs"` of a `ragspec bench --json`
result with `oracle`) and at every step drafts, as one chain, the longest continuation of that output found
right after an occurrence of the last k tokens (k = 0 is the oracle): a perfect choice among the positions
such a drafter could reach, with the run's own t(n). The decode speed-up is scaled so that k = 0 gives the
oracle's measured decode, and turned into an end-to-end speed-up with the run's own prefill share.

Usage: python examples/anchored_ceiling.py RESULT.json [--spec-bench ../shared/data/spec_bench/question.jsonl]
"""

import argparse
import json

from transformers import AutoTokenizer

from ragspec.bench.decoding import chat_ids
from ragspec.decoding.budget import CostModel
from ragspec.models.generator import generator_source


def replay(prompt: list[int], output: list[int], k: int, max_new: int) -> tuple[int, int, list[int]]:
    """(steps, tokens, draft lengths) of the perfect k-anchored chooser over one prompt."""
    ctx, out, done, steps, drafts = list(prompt), output[:max_new], 0, 0, []
    while done < len(out):
        target, n, best = out[done:], len(ctx), 0
        anchor = ctx[n - k:] if k else None
        for p in range(k, n):
            if k and ctx[p - k:p] != anchor:
                continue
            length = 0
            while length < len(target) - 1 and p + length < n and ctx[p + length] == target[length]:
                length += 1
            best = max(best, length)
        steps += 1
        drafts.append(best)
        ctx += out[done:done + best + 1]
        done += best + 1
    return steps, len(out), drafts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result")
    ap.add_argument("--spec-bench", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--anchors", default="0,1,2,3")
    args = ap.parse_args()
    res = json.load(open(args.result))
    prompts = {str(json.loads(line)["question_id"]): json.loads(line) for line in open(args.spec_bench)}
    for cat, r in (res.get("categories") or {res["category"]: res}).items():
        tok = AutoTokenizer.from_pretrained(generator_source(r["model"]))
        cost, methods, max_new = CostModel(**r["cost_model"]), r["methods"], r["max_new_tokens"]
        vanilla_decode = methods["vanilla"]["decode_tokens_per_s"]
        oracle_decode = methods["oracle"]["decode_tokens_per_s"] / vanilla_decode
        ceiling = methods["oracle"]["speedup"]
        prefill = (1 - ceiling / oracle_decode) / (ceiling - 1)  # prefill time over vanilla's decode time
        rows, scale = [], None
        for k in (int(a) for a in args.anchors.split(",")):
            steps = tokens = 0
            ms = 0.0
            for qid, output in r["vanilla_outputs"].items():
                s, t, drafts = replay(chat_ids(tok, prompts[qid]["turns"][0]), output, k, max_new)
                steps, tokens, ms = steps + s, tokens + t, ms + sum(cost.time(d + 1) for d in drafts)
            decode = cost.time(1) * tokens / ms
            scale = scale or (oracle_decode / decode if k == 0 else 1.0)
            decode *= scale
            e2e = (prefill + 1) / (prefill + 1 / decode)
            rows.append((k, tokens / steps, decode, e2e))
        print(f"{cat}: {len(r['vanilla_outputs'])} prompts; measured end to end: "
              + ", ".join(f"{m} {v['speedup']:.3f}x" for m, v in methods.items() if m != "vanilla"))
        for k, per_step, decode, e2e in rows:
            print(f"  anchor {k}: {per_step:5.2f} tokens/step, decode {decode:5.2f}x, end to end {e2e:.3f}x "
                  f"= {e2e / methods['hf-pld']['speedup']:.3f}x hf-pld, {e2e / ceiling:.3f} of the ceiling")


if __name__ == "__main__":
    main()

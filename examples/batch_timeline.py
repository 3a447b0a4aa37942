"""Where the model's time goes when questions are asked at once (`Pipeline.ask_many`, continuous batching).

    python examples/batch_timeline.py INDEX [--pipeline pipelines/default.yaml] [--questions 8] [--max-tokens 64]
                                            [--json out.json]

Records every use of the model through its step batcher: the exclusive turns (prompt chunks, drafters' calls)
and the batched step forwards, with how many generations each batch stepped. Prints the model's busy time split
into the two, the batches by generation count and their mean time, each answer's length and first token, and
the CPU flags. Distinct questions (the quickstart's), earlier prompts forgotten first. Run it alone.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    from source_stats import QUESTIONS

    from ragspec.cpu_flags import read_cpuinfo
    from ragspec.decoding import step_batcher as sb
    from ragspec.pipeline import Pipeline
    from ragspec.spec import load_spec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("index")
    ap.add_argument("--pipeline", default="pipelines/default.yaml")
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    pipe = Pipeline(load_spec(args.pipeline), args.index)
    pipe.ask("What is a file?", max_new_tokens=4)  # loads, kernels, t(n): out of the timeline
    log: list[tuple[str, float, float, int]] = []  # (kind, start, seconds, generations)
    run, exclusive = sb.StepBatcher._run, sb.StepBatcher.exclusive

    def timed_run(self, batch):
        t = time.perf_counter()
        run(self, batch)
        log.append(("steps", t, time.perf_counter() - t, len(batch)))

    @contextmanager
    def timed_exclusive(self):
        with exclusive(self):
            t = time.perf_counter()
            try:
                yield
            finally:
                log.append(("turn", t, time.perf_counter() - t, 0))

    sb.StepBatcher._run, sb.StepBatcher.exclusive = timed_run, timed_exclusive
    pipe.forget()
    t0 = time.perf_counter()
    answers = pipe.ask_many(QUESTIONS[: args.questions], max_new_tokens=args.max_tokens)
    wall = time.perf_counter() - t0
    steps = [x for x in log if x[0] == "steps"]
    turns = [x for x in log if x[0] == "turn"]
    sizes = collections.Counter(x[3] for x in steps)
    cpu, flags = read_cpuinfo()
    out = {
        "pipeline": args.pipeline, "questions": args.questions, "max_tokens": args.max_tokens, "cpu": cpu,
        "cpu_flags": sorted(set(flags) & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8"}),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "wall_s": round(wall, 2), "model_busy_s": round(sum(x[2] for x in log), 2),
        "turns": len(turns), "turns_s": round(sum(x[2] for x in turns), 2),
        "batches": len(steps), "batches_s": round(sum(x[2] for x in steps), 2),
        "last_turn_ends_s": round(max((x[1] + x[2] - t0 for x in turns), default=0.0), 2),
        "batches_by_generations": {k: sizes[k] for k in sorted(sizes)},
        "batch_ms_by_generations": {k: round(1000 * sum(x[2] for x in steps if x[3] == k) / sizes[k], 1)
                                    for k in sorted(sizes)},
        "answer_tokens": [a.stats.new_tokens for a in answers],
        "first_token_s": [round(a.stats.ttft_ms / 1000, 2) for a in answers],
    }
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

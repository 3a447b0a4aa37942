"""The relevance gate alone on CLAP NQ dev: how well its score separates answerable from unanswerable questions,
and what it would decline at given floors.

Each record's first passage, scored as a pipeline without an index scores it (`retrieve.windows.measure`,
float32 MiniLM). Prints the AUC on the tuning records (151-300 of each file) and the held-out ones (1-150), and
at each floor the held-out refusal (unanswerable declined) and false refusal (answerable declined), with their
standard errors. Usage: python examples/gate_clapnq.py [--floors 0.415,0.435,0.44,0.47,0.52] [--data DIR] [--json OUT]
"""

import argparse
import json
import time
from types import SimpleNamespace

import numpy as np

from ragspec.cpu_flags import read_cpuinfo
from ragspec.models.embedder import load_embedder
from ragspec.retrieve.windows import measure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--floors", default="0.415,0.435,0.44,0.47,0.52")
    ap.add_argument("--data", default="../shared/data/clapnq")
    ap.add_argument("--json")
    args = ap.parse_args()
    model, flags = read_cpuinfo()
    print("cpu:", model, " ".join(f for f in flags if f.startswith(("avx512", "amx", "avx2"))))
    emb = load_embedder("all-minilm-l6-v2", "cpu", "float32")
    scores, t0 = {}, time.perf_counter()
    for kind in ("answerable", "unanswerable"):
        with open(f"{args.data}/clapnq_dev_{kind}.jsonl", encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
        scores[kind] = [measure(emb, r["input"], [SimpleNamespace(text=p["text"], title=p.get("title", ""))
                                                  for p in r["passages"][:1]]).score for r in records]
    seconds = time.perf_counter() - t0
    a, u = np.asarray(scores["answerable"]), np.asarray(scores["unanswerable"])

    def auc(p, n):
        return float((p[:, None] > n[None]).mean())

    def se(p):
        return (p * (1 - p) / 150) ** 0.5

    out = {"seconds": round(seconds, 1), "auc_tuning": auc(a[150:300], u[150:300]), "auc_held_out": auc(a[:150], u[:150]),
           "floors": {}, "scores": scores}
    print(f"{len(a) + len(u)} records in {seconds:.0f} s; AUC tuning 151-300 {out['auc_tuning']:.3f}, "
          f"held-out 1-150 {out['auc_held_out']:.3f}")
    for floor in (float(x) for x in args.floors.split(",")):
        r, fr = float((u[:150] < floor).mean()), float((a[:150] < floor).mean())
        out["floors"][str(floor)] = {"refusal": r, "refusal_se": se(r), "false_refusal": fr, "false_refusal_se": se(fr)}
        print(f"floor {floor}: held-out refusal {r:.3f} ± {se(r):.3f}, false refusal {fr:.3f} ± {se(fr):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()

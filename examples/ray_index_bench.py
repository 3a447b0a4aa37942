"""Indexing throughput, local vs `--executor ray` with 1…N embedding actors, on one corpus.

    python examples/ray_index_bench.py CORPUS [--actors 1,2] [--files N] [--no-local] [--json out.json]

Each run builds a fresh index of the same corpus (same settings) and reports: chunks, total seconds, the
chunk-and-embed stage's seconds and chunks/s (for Ray: cluster start and actor start-up included), and the
driver-side rest (reading, SQLite, FAISS, BM25, manifest) as a share of the local build's total. Runs one after
another, never side by side. `--files N` takes the first N files (sorted) of CORPUS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def machine_line() -> str:
    from ragspec.cpu_flags import cpu_flags, read_cpuinfo

    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "fma", "f16c")
    return f"CPU: {read_cpuinfo()[0]} · {os.cpu_count()} cores · {' '.join(f for f in wanted if f in cpu_flags())}"


def subset(corpus: Path, n: int, into: Path) -> Path:
    files = sorted(p for p in corpus.rglob("*") if p.is_file())[:n]
    for p in files:
        dst = into / p.relative_to(corpus)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dst)
    return into


def one_build(corpus: Path, executor, label: str, work: Path) -> dict:
    from ragspec.index.builder import build_index
    from ragspec.settings import IndexSettings

    target = work / f"idx-{label}"
    t0 = time.perf_counter()
    s = build_index(corpus, target, IndexSettings(embedder="all-minilm-l6-v2"), show_progress=False,
                    executor=executor)
    total = time.perf_counter() - t0
    shutil.rmtree(target.parent / target.name, ignore_errors=True)
    for p in work.glob(f"idx-{label}*"):
        shutil.rmtree(p, ignore_errors=True)
    return {"run": label, "chunks": s.chunks, "seconds": round(total, 2), "stage_seconds": round(s.embed_seconds, 2),
            "ray_start_seconds": round(getattr(executor, "connect_seconds", 0.0), 2),
            "chunks_per_s": round(s.chunks / s.embed_seconds, 2), "driver_seconds": round(total - s.embed_seconds, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", type=Path)
    ap.add_argument("--actors", default="1,2", help="embedding actor counts to run, comma-separated")
    ap.add_argument("--files", type=int, default=0, help="only the first N files")
    ap.add_argument("--no-local", action="store_true", help="skip the local build")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not args.corpus.is_dir():
        print(f"{args.corpus} is not a folder", file=sys.stderr)
        return 2
    from ragspec.cluster.indexing import RayExecutor

    print(machine_line(), flush=True)
    from ragspec.models.embedder import load_embedder

    load_embedder("all-minilm-l6-v2")  # imports torch and sentence-transformers: not a cost of the first build
    rows = []
    with tempfile.TemporaryDirectory(prefix="ragspec-raybench-") as tmp:
        work = Path(tmp)
        corpus = subset(args.corpus, args.files, work / "corpus") if args.files else args.corpus
        runs = [] if args.no_local else [("local", None)]
        runs += [(f"ray-{n}", RayExecutor(embed_actors=n)) for n in map(int, args.actors.split(","))]
        for label, executor in runs:
            rows.append(one_build(corpus, executor, label, work))
            print(json.dumps(rows[-1]), flush=True)
    local = next((r for r in rows if r["run"] == "local"), None)
    print(f"{'run':8} {'chunks':>7} {'total s':>8} {'stage s':>8} {'ray start':>9} {'chunks/s':>9} {'driver s':>9} "
          f"{'driver/local':>12}")
    for r in rows:
        share = f"{r['driver_seconds'] / local['seconds']:.1%}" if local else "-"
        print(f"{r['run']:8} {r['chunks']:7} {r['seconds']:8.1f} {r['stage_seconds']:8.1f} {r['ray_start_seconds']:9.1f} "
              f"{r['chunks_per_s']:9.1f} {r['driver_seconds']:9.1f} {share:>12}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(), "runs": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

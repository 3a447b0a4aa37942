"""Pack what the GPU device check needs into parts that each travel in one device call (≤ 64 MiB with the
working tree): `.dev/a` (wheels the device image lacks, SmolLM2's GGUF, first part), `.dev/b` (the GGUF's
rest), `.dev/c` (MiniLM in float16, Spec-Bench's prompts, the quickstart corpus). examples/gpu_check.sh gathers
and joins them there. `.dev/` is git-ignored.

    make gpu-payload     # = pip download (cp312 wheels) + python examples/gpu_payload.py --wheels .whl

MiniLM travels in float16 (45 MB instead of 91): on CUDA the embedder runs in float16 anyway, and the device
check names its folder, so nothing takes it for the pinned package.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

PART = 58 * 2**20  # what call 1 carries (wheels + the GGUF's first part), beside the ~2 MB working tree


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wheels", type=Path, required=True, help="folder of cp312 manylinux wheels (device README)")
    ap.add_argument("--shared", type=Path, default=Path("../shared"))
    ap.add_argument("--dest", type=Path, default=Path(".dev"))
    a = ap.parse_args()
    from ragspec.models.registry import EMBEDDED, part_paths

    shutil.rmtree(a.dest, ignore_errors=True)
    pa, pb, pc = (a.dest / x for x in "abc")
    for p in (pa, pb, pc):
        p.mkdir(parents=True)
    shutil.copytree(a.wheels, pa / "whl")
    wheels = sum(f.stat().st_size for f in (pa / "whl").iterdir())
    gguf = part_paths(EMBEDDED["smollm2-135m-instruct"])[0].read_bytes()
    first = max(0, PART - wheels)  # call 1 carries the wheels too
    (pa / "smol.part1").write_bytes(gguf[:first])
    (pb / "smol.part2").write_bytes(gguf[first:])
    import torch
    from safetensors.torch import load_file, save_file

    st = part_paths(EMBEDDED["all-minilm-l6-v2"])[0]
    shutil.copytree(st, pc / "minilm", ignore=shutil.ignore_patterns("model.safetensors", "README.md", ".git*"))
    save_file({k: v.to(torch.float16).contiguous() for k, v in load_file(st / "model.safetensors").items()},
              pc / "minilm" / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(a.shared / "data/spec_bench/question.jsonl", pc / "question.jsonl")
    subprocess.run(["tar", "-cJf", str((pc / "python-3.11-docs.tar.xz").resolve()), "python-3.11-docs"],
                   cwd=a.shared / "data/corpus", check=True)
    for p in (pa, pb, pc):
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        print(f"{p}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()

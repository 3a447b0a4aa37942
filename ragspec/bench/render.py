"""README's headline table, rendered from the bench JSONs under `benchmarks/`: a figure the README quotes is
one a reader can recompute from a committed file. `benchmarks/headline.yaml` names the runs and methods, in
order; every cell is read from the JSON, never typed. `--check` fails when README differs (CI runs it through
tests/test_docs.py), so a hand-edited or stale figure cannot stay.

    python -m ragspec.bench.render           # rewrite the table between README's markers
    python -m ragspec.bench.render --check   # exit 1 when README's table is not what the JSONs give
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
START = "<!-- headline:start — rendered from benchmarks/ by `make benchmarks`; edit benchmarks/headline.yaml -->"
END = "<!-- headline:end -->"
MAX_ROWS, MAX_CELL = 12, 200
COLUMNS = ("run (JSON)", "method", "vs plain greedy", "vs llama.cpp, end to end", "prompt read (prefill)",
           "decode", "identical", "machine")
KEY_FLAGS = ("amx_int8", "avx512_vnni", "avx512_bf16", "avx512f", "avx2")


def _x(v) -> str:
    return "–" if v is None else f"{v:.2f}×"


def machine(run: dict, folder: Path) -> str:
    """The card, or the CPU with its threads and the flags that pick its kernels."""
    if str(run.get("device", "cpu")).startswith("cuda"):
        env = folder / "env.json"
        m = json.loads(env.read_text(encoding="utf-8"))["machine"] if env.exists() else {}
        return f"{m.get('gpu', 'a CUDA GPU')}, CUDA {m.get('cuda', '?')}"
    m = run["machine"]
    name = m["model"].replace("(R)", "").replace("(TM)", "").replace(" Processor", "").split(" @")[0].strip()
    flags = [f for f in KEY_FLAGS if f in m["flags"]][:3]
    return f"{name}, {m['threads']} threads, {' '.join(flags)}"


def rows_of(entry: dict, root: Path) -> list[list[str]]:
    """One table row per (category, method) of one manifest entry."""
    path = root / "benchmarks" / entry["json"]
    data = json.loads(path.read_text(encoding="utf-8"))
    cats = data["categories"] if "categories" in data else {data["category"]: data}
    out = []
    for cat in entry.get("categories") or list(cats):
        run = cats[cat]
        what = (f"[Spec-Bench {cat}, {run['prompts']} prompts, {run['max_new_tokens']} tokens, {run['model']}"
                f"{' ' + run['dtype'] if run.get('dtype') else ''}](benchmarks/{entry['json']})")
        for m in entry["methods"]:
            r = run["methods"][m]
            vs = r.get("vs_llama") or {}
            same = "reference" if m == run.get("reference", "vanilla") else (
                "–" if r["identical"] is None else f"{r['identical']}/{run['prompts']}")
            out.append([what, f"`{m}`", _x(r["speedup"]), _x(vs.get("end_to_end")), _x(vs.get("prefill")),
                        _x(vs.get("decode")), same, machine(run, path.parent)])
    return out


def render(root: Path = ROOT) -> str:
    """The table (Markdown, between the markers) from `benchmarks/headline.yaml` and the JSONs it names."""
    manifest = yaml.safe_load((root / "benchmarks" / "headline.yaml").read_text(encoding="utf-8"))
    rows = [row for entry in manifest["rows"] for row in rows_of(entry, root)]
    if len(rows) > MAX_ROWS:
        raise SystemExit(f"benchmarks/headline.yaml gives {len(rows)} rows; the README's table holds {MAX_ROWS}")
    long = [c for row in rows for c in row if len(c) > MAX_CELL]
    if long:
        raise SystemExit(f"a cell over {MAX_CELL} characters: {long[0]!r}")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join([START, *lines, END])


def splice(readme: str, table: str) -> str:
    """README with its marked table replaced by `table`."""
    a, b = readme.find(START), readme.find(END)
    if a < 0 or b < a:
        raise SystemExit(f"README.md has no table between {START!r} and {END!r}")
    return readme[:a] + table + readme[b + len(END):]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when README.md's table differs from the JSONs")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository root")
    args = ap.parse_args(argv)
    path = args.root / "README.md"
    old = path.read_text(encoding="utf-8")
    new = splice(old, render(args.root))
    if args.check:
        if new != old:
            print("README.md's headline table differs from benchmarks/: run `make benchmarks`", file=sys.stderr)
            return 1
        return 0
    if new != old:
        path.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

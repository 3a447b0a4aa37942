"""Write a real corpus that ships with every CPython: the language-reference topics of `pydoc_data.topics`.

One `.txt` file per topic, so `ragspec index` has real documents to index on a machine with no network.
Usage: python examples/pydoc_corpus.py OUT_DIR
"""

import sys
from pathlib import Path
from pydoc_data.topics import topics


def main(out: str) -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    for name, text in sorted(topics.items()):
        path = folder / f"{name}.txt"
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written += 1
    print(f"{len(topics)} pydoc topics in {folder} ({written} written)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "build/pydoc-topics")

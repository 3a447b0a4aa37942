"""Corpus walking and reading: every format, and every kind of bad file skipped with a reason."""

from __future__ import annotations

import json
import os

from ragspec.corpus.loader import ScanReport, iter_documents, walk
from ragspec.corpus.readers import html_to_text


def minimal_pdf(text: str) -> bytes:
    """A one-page PDF with `text` in Helvetica, cross-reference table computed exactly."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length " + str(len(stream)).encode() + b" >>\nstream\n" + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    for off in offsets:
        out += f"{off:010d} 00000 n \n".encode()
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


def test_bad_files_are_skipped_with_reasons(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "good.txt").write_text("A good document about rivers.")
    (root / "empty.txt").write_text("")
    (root / "blob.txt").write_bytes(b"\x00\x01\x02binary\x00" * 50)
    (root / "latin.txt").write_bytes("Café crème brûlée à la française, très bien.".encode("latin-1"))
    (root / "image.png").write_bytes(b"\x89PNG....")
    outside = tmp_path / "outside.txt"
    outside.write_text("secret outside the root")
    os.symlink(outside, root / "escape.txt")
    os.symlink(root / "good.txt", root / "alias.txt")  # inside the root: followed
    (tmp_path / "outdir").mkdir()
    os.symlink(tmp_path / "outdir", root / "linkdir")
    report = ScanReport()
    docs = list(iter_documents(root, report))
    rels = sorted(d.rel for d in docs)
    assert rels == ["alias.txt", "good.txt", "latin.txt"]
    reasons = dict(report.skipped)
    assert reasons["empty.txt"] == "empty file"
    assert "binary" in reasons["blob.txt"]
    assert "symlink out of the corpus root" in reasons["escape.txt"]
    assert "symlink out of the corpus root" in reasons["linkdir/"]
    assert report.unsupported[".png"] == 1
    latin = next(d for d in docs if d.rel == "latin.txt")
    assert "Café crème brûlée" in latin.text
    assert dict(report.decoded)["latin.txt"] != "utf-8"
    assert report.skipped_count == 5


def test_walk_is_sorted_and_deterministic(corpus):
    a = [f.rel for f in walk(corpus, ScanReport())]
    assert a == sorted(a) == [f.rel for f in walk(corpus, ScanReport())]
    assert "sub/bread.rst" in a


def test_html_drops_scripts_and_styles(tmp_path):
    html = (
        "<html><head><title>T</title><style>body{color:red}</style></head><body>"
        "<script>var x = 'hidden';</script><h1>Heading</h1><p>Visible <b>text</b> here.</p><!-- note --></body></html>"
    )
    text = html_to_text(html)
    assert "Heading" in text and "Visible text here." in text
    assert "hidden" not in text and "color" not in text and "note" not in text


def test_jsonl_beir_records_and_bad_lines(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    lines = [
        json.dumps({"_id": "d1", "title": "Aspirin", "text": "Aspirin reduces fever."}),
        "{not json",
        json.dumps({"_id": "d2", "title": "", "text": "Untitled record text."}),
        json.dumps({"_id": "d3", "nothing": 1}),
    ]
    (root / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    (root / "one.json").write_text(json.dumps([{"id": 7, "contents": "Seven."}]))
    report = ScanReport()
    docs = list(iter_documents(root, report))
    keys = [(d.rel, d.key) for d in docs]
    assert keys == [("corpus.jsonl", "d1"), ("corpus.jsonl", "d2"), ("one.json", "7")]
    assert docs[0].text == "Aspirin\n\nAspirin reduces fever." and docs[0].title == "Aspirin"
    assert len(report.problems) == 2


def test_pdf_text(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    (root / "doc.pdf").write_bytes(minimal_pdf("Hello from a PDF document"))
    (root / "broken.pdf").write_bytes(b"%PDF-1.4 garbage")
    report = ScanReport()
    docs = list(iter_documents(root, report))
    assert [d.rel for d in docs] == ["doc.pdf"]
    assert "Hello from a PDF document" in docs[0].text
    assert "broken.pdf" in dict(report.skipped)


def test_crlf_offsets_match_raw_file(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    (root / "w.txt").write_bytes(b"line one\r\nline two\r\n\r\nline three")
    (doc,) = list(iter_documents(root))
    with open(root / "w.txt", newline="", encoding="utf-8") as f:
        assert f.read() == doc.text

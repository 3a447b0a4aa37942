"""Turn one file's bytes into document text, per format. Offsets are into the text these return."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

TEXT_SUFFIXES = {".txt", ".md", ".markdown", ".rst"}
HTML_SUFFIXES = {".html", ".htm"}
JSON_SUFFIXES = {".json", ".jsonl"}
PDF_SUFFIXES = {".pdf"}
SUPPORTED = TEXT_SUFFIXES | HTML_SUFFIXES | JSON_SUFFIXES | PDF_SUFFIXES

BLOCK_TAGS = [
    "p", "div", "section", "article", "header", "footer", "nav", "aside", "main", "h1", "h2", "h3", "h4", "h5",
    "h6", "li", "ul", "ol", "dl", "dt", "dd", "pre", "blockquote", "table", "tr", "td", "th", "figure",
    "figcaption", "hr", "title",
]
TEXT_FIELDS = ("text", "contents", "content", "body", "passage")
ID_FIELDS = ("_id", "id", "doc_id", "docid")


class SkipFile(Exception):
    """This file is skipped; the message says why (one line)."""


@dataclass
class Record:
    """One document read from a file: a whole text file, or one record of a JSON/JSONL file."""

    key: str  # "" for a whole file, else the record id
    title: str
    text: str
    meta: dict = field(default_factory=dict)  # a JSON record's other scalar fields (what filters can test)


def decode(data: bytes) -> tuple[str, str]:
    """(text, encoding): UTF-8 when valid, else the detected encoding (≥ 2 KB), else cp1252, else latin-1.

    No newline translation: offsets index the file exactly as `open(path, newline="").read()` sees it.
    """
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        pass
    if len(data) >= 2048:  # detection is reliable only on enough text
        try:
            from charset_normalizer import from_bytes

            best = from_bytes(data).best()
            if best is not None and best.encoding:
                return data.decode(best.encoding), best.encoding
        except Exception:  # noqa: BLE001 - a detector failure must not lose the file
            pass
    try:  # short texts: the most common non-UTF-8 encoding, then the one that never fails
        return data.decode("cp1252"), "cp1252"
    except UnicodeDecodeError:
        return data.decode("latin-1"), "latin-1"


def looks_binary(data: bytes) -> bool:
    return b"\x00" in data[:8192]


def html_to_text(markup: str) -> str:
    """Visible text of an HTML page: scripts, styles and comments dropped, blocks on their own lines."""
    from bs4 import BeautifulSoup, Comment

    soup = BeautifulSoup(markup, "html.parser")
    title = soup.title.get_text(strip=True) if soup.title else ""
    for tag in soup(["script", "style", "noscript", "template", "head"]):
        tag.decompose()
    for comment in soup.find_all(string=lambda s: isinstance(s, Comment)):
        comment.extract()
    for tag in soup.find_all(BLOCK_TAGS):
        tag.insert_before("\n")
        tag.insert_after("\n")
    for br in soup.find_all("br"):
        br.replace_with("\n")
    lines = [" ".join(line.split()) for line in soup.get_text().splitlines()]
    text = "\n".join(line for line in lines if line)
    return text if text else title


def json_records(text: str, suffix: str) -> tuple[list[Record], list[str]]:
    """Records from JSON Lines or a JSON document; BEIR's `_id/title/text` understood. Returns problems too."""
    problems: list[str] = []
    raw: list[tuple[int, object]] = []
    if suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                raw.append((n, json.loads(line)))
            except ValueError as exc:
                problems.append(f"line {n}: not JSON ({exc.msg})")
    else:
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise SkipFile(f"not valid JSON ({exc.msg} at line {exc.lineno})") from None
        items = doc if isinstance(doc, list) else [doc]
        raw = list(enumerate(items, 1))
    records: list[Record] = []
    first_seen: dict[str, int] = {}  # key -> line (JSONL) or record number (JSON) where it first appeared
    where = "line" if suffix == ".jsonl" else "record"
    for n, obj in raw:
        if not isinstance(obj, dict):
            problems.append(f"record {n}: not an object")
            continue
        body = next((obj[f] for f in TEXT_FIELDS if isinstance(obj.get(f), str)), None)
        if body is None:
            problems.append(f"record {n}: no text field ({'/'.join(TEXT_FIELDS)})")
            continue
        key = next((str(obj[f]) for f in ID_FIELDS if f in obj), str(n))
        title = obj.get("title") if isinstance(obj.get("title"), str) else ""
        full = f"{title}\n\n{body}" if title and body else (title or body)
        if not full.strip():
            continue
        if key in first_seen:
            unique = _unique_key(key, f"{where}{n}", first_seen)
            problems.append(f"{where} {n}: duplicate key {key!r} (first on {where} {first_seen[key]}); "
                            f"kept as {unique!r}")
            key = unique
        first_seen[key] = n
        records.append(Record(key=key, title=title, text=full, meta=record_meta(obj)))
    return records, problems


def record_meta(obj: dict) -> dict:
    """A record's scalar fields other than its id, title and text: strings, numbers and booleans."""
    skip = {"title", *ID_FIELDS, *TEXT_FIELDS}
    return {k: v for k, v in obj.items()
            if k not in skip and isinstance(k, str) and (v is None or isinstance(v, (str, int, float, bool)))}


def _unique_key(key: str, at: str, taken: dict[str, int]) -> str:
    """`key@line7` for a repeated key found on line 7 (`key@line7.2`, … if that is taken too): the store keys
    documents by (path, key), so a repeat is kept under a new key instead of aborting the run."""
    candidate, i = f"{key}@{at}", 2
    while candidate in taken:
        candidate, i = f"{key}@{at}.{i}", i + 1
    return candidate


def pdf_text(data: bytes) -> str:
    try:
        from pypdf import PdfReader
    except ImportError:
        raise SkipFile("PDF support is not installed: pip install 'ragspec[pdf]'") from None
    import io

    try:
        reader = PdfReader(io.BytesIO(data))
        return "\n\n".join((page.extract_text() or "").strip() for page in reader.pages).strip()
    except Exception as exc:  # noqa: BLE001 - pypdf raises many kinds on a malformed file
        raise SkipFile(f"unreadable PDF ({type(exc).__name__}: {exc})") from None


def read_records(data: bytes, suffix: str) -> tuple[list[Record], str, list[str]]:
    """(records, encoding, problems) for one file's bytes; raises SkipFile when nothing usable is in it."""
    if not data.strip():
        raise SkipFile("empty file")
    if suffix in PDF_SUFFIXES:
        text = pdf_text(data)
        if not text:
            raise SkipFile("PDF has no extractable text")
        return [Record("", "", text)], "pdf", []
    if looks_binary(data):
        raise SkipFile("binary content (NUL bytes)")
    text, encoding = decode(data)
    if suffix in HTML_SUFFIXES:
        text = html_to_text(text)
        if not text.strip():
            raise SkipFile("HTML has no visible text")
        return [Record("", "", text)], encoding, []
    if suffix in JSON_SUFFIXES:
        records, problems = json_records(text, suffix)
        if not records:
            raise SkipFile("no usable records" + (f" ({problems[0]})" if problems else ""))
        return records, encoding, problems
    return [Record("", "", text)], encoding, []


def title_of(text: str, fallback: str) -> str:
    """A display title: the first non-blank line that is not just punctuation (reST over/underlines)."""
    for line in text.splitlines()[:20]:
        s = line.strip().lstrip("#").strip()
        if s and any(ch.isalnum() for ch in s):
            return s[:200]
    return fallback

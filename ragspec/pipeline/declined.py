"""The declined answer: one fixed string the prompts ask for when the sources do not contain the answer."""

from __future__ import annotations

import re
import unicodedata

# The one answer that means "the sources do not say": every prompt style asks the model to reply exactly this
# when the sources do not contain the answer, and `Answer.declined` is set when it does (see `is_declined`).
DECLINED = "The sources do not contain the answer."


def _squash(text: str) -> str:
    """Lower-cased words only: punctuation, quotes and markdown emphasis dropped, whitespace collapsed."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(" " if unicodedata.category(ch)[0] in "PS" else ch for ch in text)
    return " ".join(text.split())


_DECLINED_WORDS = _squash(DECLINED)


def is_declined(text: str) -> bool:
    """True when the answer is the fixed DECLINED string: compared case-, punctuation- and whitespace-
    insensitively (so "the sources do not contain the answer" or "**The sources do not contain the answer**!"
    count), either the whole answer or its first line / first sentence followed by more text (a small model
    sometimes adds a clause after it). Any other wording is an answer, not a decline."""
    if not text or not text.strip():
        return False
    if _squash(text) == _DECLINED_WORDS:
        return True
    first = re.split(r"\n|(?<=[.!?])\s", text.strip(), maxsplit=1)[0]
    return _squash(first) == _DECLINED_WORDS

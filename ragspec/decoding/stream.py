"""Incremental detokenization: token ids in, text deltas out, correct across multi-byte characters and
tokens that only make sense merged with their neighbours (the prefix/read offset method of HF's streamers
and vLLM)."""

from __future__ import annotations


class IncrementalDecoder:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the text that is now final (may be '' while a character is incomplete)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix) or not full.startswith(prefix):
            if not full.startswith(prefix):  # a rare re-segmentation: resynchronise on the full text
                whole = self._decode(self.ids)
                done = self._decode(self.ids[: self.read_offset])
                if whole.startswith(done) and not whole.endswith("\ufffd"):
                    self.prefix_offset = self.read_offset = len(self.ids)
                    return whole[len(done) :]
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return delta

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character is emitted as decoded)."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if full.startswith(prefix) else full

"""Per-request incremental detokenization (the SGLang `surr_offset` / `read_offset` scheme).

Tokens do not map to characters: byte-level BPE splits one CJK char or emoji over several ids,
and SentencePiece decodes a token's leading space differently at the start of a sequence. So we
never decode a token alone. We decode a short window twice -- `ids[surr:read]` (text already
emitted, kept as left context) and `ids[surr:]` -- and emit the difference. The window start only
advances to a point where the decode ended on a complete character, so decoding from there
yields exactly the suffix of the full decode and the cost per step stays bounded.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

# What lossy UTF-8 decoding puts where the bytes so far form an incomplete (or invalid) char.
REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Turns a growing list of output ids into text deltas; one instance per request.

    `surr_offset` and `read_offset` index into `ids`, which starts with the prompt context ids:
    `ids[surr_offset:read_offset]` is already-emitted text kept as decode context, and
    `ids[read_offset:]` is not emitted yet (held back while it ends in an incomplete char).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids)
        # Context that itself ends mid-char would have its trailing U+FFFD "repaired" by the
        # first output bytes, which would break the prefix arithmetic; drop it (rare: only
        # prompts given as raw ids can end that way).
        if context and self._decode(context).endswith(REPLACEMENT):
            context = []
        self.ids: list[int] = context
        self.num_context = len(context)
        self.surr_offset = 0
        self.read_offset = len(context)
        # Decode of ids[surr_offset:read_offset]; None = recompute (it changes only on emit).
        self._prefix: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self, final: bool) -> str:
        if self._prefix is None:
            self._prefix = self._decode(self.ids[self.surr_offset : self.read_offset])
        full = self._decode(self.ids[self.surr_offset :])
        # A trailing U+FFFD may be a char whose remaining bytes are still to come: hold it back.
        # At the finish it is genuine (the full decode shows it too), so let it out.
        if len(full) <= len(self._prefix) or (not final and full.endswith(REPLACEMENT)):
            return ""
        # The window start is on a char boundary, so `full` extends the prefix exactly.
        delta = full[len(self._prefix) :]
        self.surr_offset = self.read_offset
        self.read_offset = len(self.ids)
        self._prefix = None
        return delta

    def push(self, new_ids: Sequence[int]) -> str:
        """Append `new_ids`; return the text they complete ("" while a char is still partial)."""
        self.ids.extend(new_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """At finish: return whatever is still held back, a genuine trailing U+FFFD included."""
        return self._step(final=True)

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self.num_context :]

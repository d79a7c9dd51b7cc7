"""Stop strings, checked where the request's life is decided: the scheduler.

Decodes only the tail of the output (enough tokens to hold the longest stop string even when every
character is split over 4 byte-level tokens) and looks for a stop string in it; the detokenizer trims
the same match from the text it streams.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class StopChecker:
    def __init__(self, model_dir: str) -> None:
        self._path = Path(model_dir) / "tokenizer.json"
        self._tok: Tokenizer | None = None

    def _tokenizer(self) -> Tokenizer:
        if self._tok is None:  # loaded on first use: most requests have no stop strings
            self._tok = Tokenizer.from_file(str(self._path))
        return self._tok

    def find(self, output_ids: list[int], stops: list[str], skip_special_tokens: bool) -> str | None:
        """The stop string that the newest token completed, if any (earliest-ending, then longest)."""
        if not stops or not output_ids:
            return None
        window = 4 * max(len(s) for s in stops) + 4
        tail = self._tokenizer().decode(output_ids[-window:], skip_special_tokens=skip_special_tokens)
        best: tuple[int, int, str] | None = None
        for s in stops:
            i = tail.find(s)
            if i >= 0:
                key = (i + len(s), -len(s), s)
                if best is None or key < best:
                    best = key
        return None if best is None else best[2]

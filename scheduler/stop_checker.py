"""Stop strings, decided in one place: the scheduler, where the request's life is decided.

After each committed token (once min_tokens are out) it decodes the tail of the output with a few
tokens of left context, so a SentencePiece token's leading space decodes as it does mid-text and a stop
string that begins with a space matches. Only a stop string that the newest token completed counts:
an earlier one was either taken then or ignored (before min_tokens). The match says how many characters
to cut from the end of the output text, which the detokenizer applies: text, token ids, finish reason
and matched stop describe the same event.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from tandem.protocol.sampling_params import SamplingParams
from tandem.protocol.tokenizer_loader import load_fast_tokenizer

CONTEXT_TOKENS = 4  # left context before the window: enough to settle a leading space or a split char
REPLACEMENT = "\ufffd"  # what the decoder puts for the bytes of an incomplete character


@dataclass(frozen=True)
class StopMatch:
    stop: str
    cut: int  # characters to drop from the end of the output text (the stop too, unless included)


class StopChecker:
    def __init__(self, model_dir: str) -> None:
        self._model = model_dir
        self._tok: Tokenizer | None = None

    def _tokenizer(self) -> Tokenizer:
        if self._tok is None:  # loaded on first use: most requests have no stop strings
            self._tok = load_fast_tokenizer(self._model)
        return self._tok

    def find(self, prompt_ids: list[int], output_ids: list[int], params: SamplingParams) -> StopMatch | None:
        """The stop string the newest output token completed (earliest-ending, then longest), if any."""
        stops = [s for s in params.stop if s]
        if not stops or not output_ids:
            return None
        # Enough tokens to hold the longest stop string even with every character split over 4 tokens.
        n = min(len(output_ids), 4 * max(len(s) for s in stops) + 4)
        context = (prompt_ids[-CONTEXT_TOKENS:] + output_ids[:-n])[-CONTEXT_TOKENS:]
        ids = context + output_ids[-n:]
        tok = self._tokenizer()

        def decode(x: list[int]) -> str:
            return tok.decode(x, skip_special_tokens=params.skip_special_tokens)

        text = decode(ids)
        out_start = len(decode(context).rstrip(REPLACEMENT)) if context else 0
        new_start = len(decode(ids[:-1]).rstrip(REPLACEMENT))  # where the newest token's text begins
        best: tuple[int, int, str, int] | None = None
        for s in stops:
            i = text.find(s, max(out_start, new_start - len(s) + 1))
            if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
                best = (i + len(s), -len(s), s, i)
        if best is None:
            return None
        end, _, stop, start = best
        return StopMatch(stop, len(text) - (end if params.include_stop_str_in_output else start))

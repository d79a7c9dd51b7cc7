"""Logprobs in OpenAI's two shapes: completions (columns of tokens) and chat (a list of entries)."""
from __future__ import annotations

from tandem.frontend.http.state import ServerState
from tandem.protocol.messages import Logprobs


def chat_logprobs(st: ServerState, lp: Logprobs) -> list[dict]:
    out = []
    for tid, logprob, top_ids, top_lps in zip(lp.token_ids, lp.logprobs, lp.top_ids, lp.top_logprobs):
        tok = st.token_text(tid)
        out.append(
            {
                "token": tok,
                "logprob": logprob,
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {"token": st.token_text(t), "logprob": v, "bytes": list(st.token_text(t).encode())}
                    for t, v in zip(top_ids, top_lps)
                ],
            }
        )
    return out


class CompletionLogprobs:
    """The completions `logprobs` object, grown as tokens arrive; text_offset counts from `offset`."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add_first(self, st: ServerState, tid: int) -> None:
        """The prompt's first token: echoed, with no logprob (nothing predicts it)."""
        self._token(st.token_text(tid), None, None)

    def add(self, st: ServerState, lp: Logprobs) -> None:
        for tid, logprob, top_ids, top_lps in zip(lp.token_ids, lp.logprobs, lp.top_ids, lp.top_logprobs):
            self._token(st.token_text(tid), logprob, {st.token_text(t): v for t, v in zip(top_ids, top_lps)})

    def _token(self, text: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def body(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}

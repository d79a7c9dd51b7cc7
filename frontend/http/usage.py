"""The `usage` object: the prompt counted once per prompt (not per choice), every choice's outputs."""
from __future__ import annotations

from tandem.frontend.completion import CompletionDelta


class Usage:
    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self._prompts_counted: set[int] = set()

    def add(self, d: CompletionDelta, prompt_index: int) -> None:
        if not d.finished:
            return
        if prompt_index not in self._prompts_counted:
            self._prompts_counted.add(prompt_index)
            self.prompt_tokens += d.prompt_tokens
            self.cached_tokens += d.cached_tokens
        self.completion_tokens += d.completion_tokens

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

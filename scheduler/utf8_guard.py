"""Keeps constrained output valid UTF-8.

xgrammar's byte-level character classes admit the UTF-8 encodings of surrogates (ED A0..BF xx), bytes
no decoder accepts, which then reach the client as U+FFFD. The guard runs the UTF-8 decoder automaton
over each request's output bytes and, for each automaton state, knows which tokens keep the bytes valid;
a request's bitmask row is narrowed to those.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Automaton states: what the next byte must be. ACCEPT = on a character boundary.
ACCEPT, CONT1, CONT2, CONT3, AFTER_E0, AFTER_ED, AFTER_F0, AFTER_F4 = range(8)
NUM_STATES = 8
REJECT = -1
# Continuation states: (lowest byte, highest byte, next state). ED excludes A0..BF (the surrogates),
# E0/F0 the overlong forms, F4 the code points past U+10FFFF.
_CONTINUE = {
    CONT1: (0x80, 0xBF, ACCEPT),
    CONT2: (0x80, 0xBF, CONT1),
    CONT3: (0x80, 0xBF, CONT2),
    AFTER_E0: (0xA0, 0xBF, CONT1),
    AFTER_ED: (0x80, 0x9F, CONT1),
    AFTER_F0: (0x90, 0xBF, CONT2),
    AFTER_F4: (0x80, 0x8F, CONT2),
}


def _lead(b: int) -> int:
    if b < 0x80:
        return ACCEPT
    if 0xC2 <= b <= 0xDF:
        return CONT1
    if b == 0xE0:
        return AFTER_E0
    if b == 0xED:
        return AFTER_ED
    if 0xE1 <= b <= 0xEF:
        return CONT2
    if b == 0xF0:
        return AFTER_F0
    if 0xF1 <= b <= 0xF3:
        return CONT3
    if b == 0xF4:
        return AFTER_F4
    return REJECT


def advance(state: int, data: bytes) -> int:
    """The automaton state after `data`, or REJECT when the bytes cannot be valid UTF-8."""
    for b in data:
        if state == ACCEPT:
            state = _lead(b)
        else:
            lo, hi, nxt = _CONTINUE[state]
            state = nxt if lo <= b <= hi else REJECT
        if state == REJECT:
            return REJECT
    return state


class Utf8Guard:
    """Per automaton state, the bitmask (xgrammar's int32 layout) of tokens valid from that state."""

    def __init__(self, token_bytes: Sequence[bytes], vocab_size: int) -> None:
        self.token_bytes = token_bytes
        words = (vocab_size + 31) // 32
        allowed = np.zeros((NUM_STATES, words * 32), dtype=bool)
        for i, data in enumerate(token_bytes[:vocab_size]):
            if data and data[0] < 0x80:  # most tokens: valid on a character boundary only
                allowed[ACCEPT, i] = data.isascii() or advance(ACCEPT, data) != REJECT
                continue
            for s in range(NUM_STATES):
                allowed[s, i] = advance(s, data) != REJECT
        packed = np.packbits(allowed, axis=1, bitorder="little").view("<i4")
        self.masks = torch.from_numpy(packed.copy())

    def next_state(self, state: int, token_id: int) -> int:
        data = self.token_bytes[token_id] if token_id < len(self.token_bytes) else b""
        return advance(state, data)

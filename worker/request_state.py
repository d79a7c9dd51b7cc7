"""Persistent per-request state on the worker: one row per live request for its whole life.

The scheduler sends a request's tokens once; afterwards the worker appends what it samples, so a
step only needs "compute n more tokens of row r" (DESIGN.md §4).
"""
from __future__ import annotations

import torch

from protocol.messages import NewReqData

_GOLDEN = 0x9E3779B97F4A7C15


class RequestState:
    def __init__(self, max_reqs: int, max_context: int, device: torch.device) -> None:
        self.device = device
        self.max_context = max_context
        self.tokens = torch.zeros(max_reqs, max_context, dtype=torch.int64, device=device)
        # CPU mirrors of the counters: the reference input prep reads them without a device sync.
        self.num_tokens = [0] * max_reqs  # prompt + sampled tokens known to the worker
        self.num_computed = [0] * max_reqs
        self.num_prompt = [0] * max_reqs
        self.live = [False] * max_reqs
        self.temperature = torch.zeros(max_reqs, dtype=torch.float32, device=device)
        self.top_k = torch.full((max_reqs,), -1, dtype=torch.int64, device=device)
        self.top_p = torch.ones(max_reqs, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(max_reqs, dtype=torch.float32, device=device)
        self.seed: list[int | None] = [None] * max_reqs
        self.generators: list[torch.Generator | None] = [None] * max_reqs

    def add(self, r: NewReqData) -> None:
        i = r.req_idx
        if self.live[i]:
            raise RuntimeError(f"request row {i} is already live")
        n = len(r.token_ids)
        self.tokens[i, :n] = torch.tensor(r.token_ids, dtype=torch.int64)
        self.num_tokens[i] = n
        self.num_computed[i] = r.num_cached
        self.num_prompt[i] = r.num_prompt
        self.live[i] = True
        s = r.sampling
        self.temperature[i] = s.temperature
        self.top_k[i] = s.top_k
        self.top_p[i] = s.top_p
        self.min_p[i] = s.min_p
        self.seed[i] = s.seed
        if s.seed is not None and self.generators[i] is None:
            self.generators[i] = torch.Generator(device=self.device)

    def free(self, i: int) -> None:
        if not self.live[i]:
            raise RuntimeError(f"request row {i} freed but not live")
        self.live[i] = False

    def seeded_generator(self, i: int) -> torch.Generator | None:
        """The row's generator, seeded by (seed, output position): the draw for the k-th output of
        a request is the same whatever the batch, and after a retraction."""
        seed = self.seed[i]
        if seed is None:
            return None
        g = self.generators[i]
        assert g is not None
        k = self.num_tokens[i] - self.num_prompt[i]
        g.manual_seed((seed * _GOLDEN + k) % (2**63))
        return g

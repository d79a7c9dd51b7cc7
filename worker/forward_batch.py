"""What one model forward step computes: the new tokens of several requests, laid out request after
request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, tokens of all requests this step, request after request
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    out_cache_loc: torch.Tensor  # [T] int64, KV slot where each token's K/V is written
    req_pool_indices: torch.Tensor  # [B] int64, row of each request in the req_to_token table
    seq_lens: torch.Tensor  # [B] int64, KV length of each request AFTER this step (prefix + new)
    extend_lens: torch.Tensor  # [B] int64, new tokens of each request this step (1 for a decode); sum == T
    logits_indices: torch.Tensor  # [N] int64, indices into T whose logits are wanted
    # Host-side copies of the small per-request vectors, so per-layer code never reads device memory.
    # Taken from the tensors when not given (one sync per step on a GPU; pass them to avoid it).
    seq_lens_cpu: list[int] | None = None
    extend_lens_cpu: list[int] | None = None
    req_pool_indices_cpu: list[int] | None = None
    # Images (worker/image_rows.py): the rows of T that take an image's encoder output instead of their
    # token's embedding, and those outputs [len(image_rows), hidden]; None: no image token this step.
    image_rows: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    # Per request, the [start, end) positions of images whose tokens attend each other both ways (Gemma 3)
    # and that this step computes; None: every query is causal.
    image_spans: list[list[tuple[int, int]]] | None = None
    # Multimodal RoPE: each token's three positions (frame, row, column) where a request of the step holds
    # images; None: `positions` are the rotary's
    rope_positions: torch.Tensor | None = None
    # Derived once in __post_init__.
    extend_starts_cpu: list[int] = field(init=False)  # index in T of each request's first new token
    max_seq_len: int = field(init=False)
    num_tokens: int = field(init=False)
    all_decode: bool = field(init=False)  # every request has extend_len == 1

    def __post_init__(self) -> None:
        if self.seq_lens_cpu is None:
            self.seq_lens_cpu = self.seq_lens.tolist()
        if self.extend_lens_cpu is None:
            self.extend_lens_cpu = self.extend_lens.tolist()
        if self.req_pool_indices_cpu is None:
            self.req_pool_indices_cpu = self.req_pool_indices.tolist()
        starts, t = [], 0
        for e in self.extend_lens_cpu:
            starts.append(t)
            t += e
        self.extend_starts_cpu = starts
        self.num_tokens = t
        self.max_seq_len = max(self.seq_lens_cpu, default=0)
        self.all_decode = all(e == 1 for e in self.extend_lens_cpu)

    def place_images(self, h: torch.Tensor) -> torch.Tensor:
        """The step's token embeddings h [T, hidden] with the image rows' encoder outputs in place."""
        if self.image_rows is not None:
            assert self.image_embeds is not None
            h.index_copy_(0, self.image_rows, self.image_embeds.to(h.dtype))
        return h

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @classmethod
    def build(cls, **fields: torch.Tensor | list[int] | None) -> ForwardBatch:
        """Keyword constructor from ready tensors (and optionally the *_cpu lists); same as
        ForwardBatch(...)."""
        return cls(**fields)  # type: ignore[arg-type]

    @classmethod
    def from_lists(
        cls,
        input_ids: Sequence[int],
        out_cache_loc: Sequence[int],
        req_pool_indices: Sequence[int],
        seq_lens: Sequence[int],
        extend_lens: Sequence[int],
        logits_indices: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Build from host lists; positions follow from seq_lens/extend_lens, logits default to the last
        new token of every request."""
        positions: list[int] = []
        last: list[int] = []
        for s, e in zip(seq_lens, extend_lens, strict=True):
            positions.extend(range(s - e, s))
            last.append(len(positions) - 1)
        if len(positions) != len(input_ids) or len(out_cache_loc) != len(input_ids):
            raise ValueError("input_ids/out_cache_loc must have sum(extend_lens) entries")

        def t(x: Sequence[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64).to(device, non_blocking=True)

        return cls(
            input_ids=t(input_ids),
            positions=t(positions),
            out_cache_loc=t(out_cache_loc),
            req_pool_indices=t(req_pool_indices),
            seq_lens=t(seq_lens),
            extend_lens=t(extend_lens),
            logits_indices=t(last if logits_indices is None else logits_indices),
            seq_lens_cpu=list(seq_lens),
            extend_lens_cpu=list(extend_lens),
            req_pool_indices_cpu=list(req_pool_indices),
        )

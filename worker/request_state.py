"""Persistent per-request state on the worker: one row per live request for its whole life.

The scheduler sends a request's tokens once; afterwards the worker appends what it samples, so a
step only needs "compute n more tokens of row r" (docs/architecture.md §4).
"""
from __future__ import annotations

import torch

from tandem.protocol.embed_params import EmbedParams
from tandem.protocol.image_item import ImageItem
from tandem.protocol.messages import NewReqData
from tandem.worker.draft_record import DraftRecord
from tandem.worker.host_to_device import to_device
from tandem.worker.sampler import DeviceParams

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
        # Drafts the proposer matched for each row's next step, where it runs on the host (CPU), and the
        # row's draft acceptance record (worker/draft_record.py), which bounds how many it verifies.
        self.num_proposed = [0] * max_reqs
        self.draft_record = [DraftRecord() for _ in range(max_reqs)]
        # Host lists: the sampler decides per row on the host, so reading them never waits for the device.
        # Their device twins are written once, when a request is added, and gathered by row each step.
        self.temperature_t = torch.zeros(max_reqs, dtype=torch.float32, device=device)
        self.top_k_t = torch.full((max_reqs,), -1, dtype=torch.int64, device=device)
        self.top_p_t = torch.ones(max_reqs, dtype=torch.float32, device=device)
        self.min_p_t = torch.zeros(max_reqs, dtype=torch.float32, device=device)
        self.temperature = [0.0] * max_reqs
        self.top_k = [-1] * max_reqs
        self.top_p = [1.0] * max_reqs
        self.min_p = [0.0] * max_reqs
        self.seed: list[int | None] = [None] * max_reqs
        self.generators: list[torch.Generator | None] = [None] * max_reqs
        # Penalties: device tensors for the vectorised logits processing (only read for penalty_rows, so
        # written only for those); the host copies decide which terms to compute without a device sync.
        self.repetition_penalty = torch.ones(max_reqs, dtype=torch.float32, device=device)
        self.presence_penalty = torch.zeros(max_reqs, dtype=torch.float32, device=device)
        self.frequency_penalty = torch.zeros(max_reqs, dtype=torch.float32, device=device)
        self.repetition_penalty_cpu = [1.0] * max_reqs
        self.presence_penalty_cpu = [0.0] * max_reqs
        self.frequency_penalty_cpu = [0.0] * max_reqs
        self.min_tokens = [0] * max_reqs
        self.suppress_ids: list[list[int]] = [[] for _ in range(max_reqs)]
        self.logprobs = [-1] * max_reqs  # top-N with each sampled token; -1: none
        self.prompt_logprobs = [-1] * max_reqs  # top-N at each prompt position; -1: none
        self.prompt_logprob_start = [0] * max_reqs  # first prompt index whose logprob is reported
        # Live rows that use each feature: when these are empty (the common case) a step pays one
        # truthiness test per feature and nothing else.
        self.penalty_rows: set[int] = set()
        self.min_tokens_rows: set[int] = set()
        self.logprob_rows: set[int] = set()
        self.prompt_logprob_rows: set[int] = set()
        # Embedding rows (worker/pooling.py): what each asked for, and its partial pool (float32 [hidden]).
        self.pool_params: dict[int, EmbedParams] = {}
        self.pool_acc: dict[int, torch.Tensor] = {}
        self.images: dict[int, list[ImageItem]] = {}  # rows whose prompts hold images (worker/image_rows.py)
        self.rope: dict[int, tuple[torch.Tensor, int]] = {}  # their multimodal RoPE positions and delta
        self.lora_slot: dict[int, int] = {}  # rows run under a LoRA adapter: its device slot

    def add(self, r: NewReqData) -> None:
        i = r.req_pool_idx
        if self.live[i]:
            raise RuntimeError(f"request row {i} is already live")
        n = len(r.token_ids)
        self.tokens[i, :n] = to_device([r.token_ids], self.device)[0]
        self.num_tokens[i] = n
        self.num_computed[i] = r.num_cached
        self.num_prompt[i] = r.num_prompt
        self.live[i] = True
        self.num_proposed[i] = 0
        self.draft_record[i] = DraftRecord()
        s = r.sampling
        self.temperature[i] = s.temperature
        self.top_k[i] = s.top_k
        self.top_p[i] = s.top_p
        self.min_p[i] = s.min_p
        # Scalar fills: queued on the device like any kernel, no copy from host memory.
        self.temperature_t[i] = s.temperature
        self.top_k_t[i] = s.top_k
        self.top_p_t[i] = s.top_p
        self.min_p_t[i] = s.min_p
        self.seed[i] = s.seed
        if s.seed is not None and self.generators[i] is None:
            self.generators[i] = torch.Generator(device=self.device)
        self.repetition_penalty_cpu[i] = s.repetition_penalty
        self.presence_penalty_cpu[i] = s.presence_penalty
        self.frequency_penalty_cpu[i] = s.frequency_penalty
        if s.repetition_penalty != 1.0 or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0:
            self.repetition_penalty[i] = s.repetition_penalty
            self.presence_penalty[i] = s.presence_penalty
            self.frequency_penalty[i] = s.frequency_penalty
            self.penalty_rows.add(i)
        self.min_tokens[i] = s.min_tokens
        self.suppress_ids[i] = list(s.suppress_ids)
        if s.min_tokens > 0 and s.suppress_ids:
            self.min_tokens_rows.add(i)
        self.logprobs[i] = s.logprobs
        if s.logprobs >= 0:
            self.logprob_rows.add(i)
        self.prompt_logprobs[i] = s.prompt_logprobs
        self.prompt_logprob_start[i] = s.prompt_logprob_start
        if s.prompt_logprobs >= 0:
            self.prompt_logprob_rows.add(i)
        if r.pool is not None:
            self.pool_params[i] = r.pool
        if r.images:
            self.images[i] = r.images
        if r.lora_slot >= 0:
            self.lora_slot[i] = r.lora_slot

    def free(self, i: int) -> None:
        if not self.live[i]:
            raise RuntimeError(f"request row {i} freed but not live")
        self.live[i] = False
        for rows in (self.penalty_rows, self.min_tokens_rows, self.logprob_rows, self.prompt_logprob_rows):
            rows.discard(i)
        self.pool_params.pop(i, None)
        self.pool_acc.pop(i, None)
        self.images.pop(i, None)
        self.lora_slot.pop(i, None)
        self.rope.pop(i, None)

    def device_params(self, rows: torch.Tensor) -> DeviceParams:
        """The sampling parameters of `rows` (a device tensor of row indices), gathered on the device."""
        return DeviceParams(
            self.temperature_t[rows], self.top_k_t[rows], self.top_p_t[rows], self.min_p_t[rows]
        )

    def num_outputs(self, i: int) -> int:
        return self.num_tokens[i] - self.num_prompt[i]

    def seeded_generator(self, i: int, ahead: int = 0) -> torch.Generator | None:
        """The row's generator, seeded by (seed, output position): the draw for the k-th output of
        a request is the same whatever the batch, and after a retraction. `ahead`: for the output that
        many positions after the next (a draft token's verification)."""
        seed = self.seed[i]
        if seed is None:
            return None
        g = self.generators[i]
        assert g is not None
        k = self.num_tokens[i] - self.num_prompt[i] + ahead
        g.manual_seed((seed * _GOLDEN + k) % (2**63))
        return g

"""A worker without a model: the same persistent row state and step semantics as ModelRunner, with a
toy next-token function, so scheduler behaviour can be checked step by step on CPU in milliseconds."""
from __future__ import annotations

from collections.abc import Callable

from tandem.protocol.messages import ModelRunnerOutput, SchedulerOutput, StepFailed

VOCAB = 97


def toy_next(prev: int, pos: int) -> int:
    """Depends on the previous token and the position, so a wrong input or position shows."""
    return (prev * 31 + pos * 7 + 3) % VOCAB


def true_drafts(tokens: list[int], k: int) -> list[int]:
    """The k tokens the toy model will produce next: every draft is accepted."""
    return expected_output(tokens, k)


class FakeWorker:
    """`next_token(prev, pos)`: the token sampled there. `drafter(tokens, k)`: up to k draft tokens proposed
    after each sample (speculative decoding; fewer, or none, where it matched nothing); the default
    proposes the toy model's own continuation, so all are accepted."""

    def __init__(self, num_slots: int, next_token: Callable[[int, int], int] = toy_next,
                 drafter: Callable[[list[int], int], list[int]] = true_drafts, k: int = 0,
                 encoder_layers: int = 0) -> None:
        self.next_token = next_token
        # images: an encoding is encoder_layers pieces; a step may compute an image's tokens only after all
        self.encoder_layers = encoder_layers
        self.encoded: dict[str, int] = {}  # digest -> pieces run (kept once all have)
        self.images: dict[int, list] = {}  # row -> its ImageItems
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.kv: dict[int, dict[int, int]] = {}  # row -> position -> slot
        # What each KV slot holds: a hash of the token prefix it was computed for. A wrong slot in a
        # request's row (a prefix-cache or release bug) shows as a mismatch, like wrong KV would.
        self.slot_content: dict[int, int] = {}
        self.host_content: dict[int, int | None] = {}  # the host tier's slots, filled by the step's copies
        self.num_slots = num_slots
        self.copied_to_host = self.copied_to_device = 0
        self.steps: list[SchedulerOutput] = []
        self.drafter, self.k = drafter, k
        self.drafts: dict[int, list[int]] = {}  # row -> drafts proposed after its last sample

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(so)
        for row in so.freed_req_pool_indices:
            del self.tokens[row], self.computed[row], self.kv[row]
            self.images.pop(row, None)
        for r in so.new_reqs:
            if r.req_pool_idx in self.tokens:
                raise AssertionError(f"row {r.req_pool_idx} added while live")
            self.tokens[r.req_pool_idx] = list(r.token_ids)
            self.computed[r.req_pool_idx] = r.num_cached
            self.kv[r.req_pool_idx] = {}
            self.images[r.req_pool_idx] = r.images
        kept = self._encode(so)
        c = so.kv_copies
        if c is not None:  # device -> host first, then host -> device, before the step's compute
            for d, h in zip(c.to_host_src, c.to_host_dst, strict=True):
                self.host_content[h] = self.slot_content.get(d)
            for h, d in zip(c.to_device_src, c.to_device_dst, strict=True):
                if h not in self.host_content:
                    raise AssertionError(f"load from host slot {h}, which was never written")
                self.slot_content[d] = self.host_content[h]  # type: ignore[assignment]
            self.copied_to_host += len(c.to_host_src)
            self.copied_to_device += len(c.to_device_src)
        sampled: list[int] = []
        counts: list[int] = []
        verified: list[int] = []  # drafts verified per sampling request
        for s in so.scheduled:
            row = s.req_pool_idx
            start = self.computed[row]
            for i, slot in enumerate(s.slots):
                if not 1 <= slot <= self.num_slots:
                    raise AssertionError(f"slot {slot} out of range")
                self.kv[row][s.slot_start + i] = slot
            # Like the CPU worker: only the drafts the proposer matched are verified (none: a plain decode).
            drafts = self.drafts.get(row, [])[: s.num_drafts]
            end = start + s.num_tokens - (s.num_drafts - len(drafts))
            toks = self.tokens[row] + drafts  # drafts sit past the known tokens
            if end > len(toks):
                raise AssertionError(f"row {row}: computing to {end} but only {len(toks)} known")
            # With drafts in flight the scheduler's positions run ahead of the worker's (rejected drafts
            # shift later steps down), but every position computed must have its slot.
            unready = [im.offset for im in self.images[row] if start <= im.offset < end
                       and self.encoded.get(im.digest, 0) < self.encoder_layers]
            if unready:
                raise AssertionError(f"row {row}: computes the image at {unready[0]} before it is encoded")
            missing = [pos for pos in range(start, end) if pos not in self.kv[row]]
            if missing:
                raise AssertionError(f"row {row}: no KV slot for positions {missing}")
            for pos in range(start, end):
                self.slot_content[self.kv[row][pos]] = hash(tuple(toks[: pos + 1]))
            for pos in range(end):
                if self.slot_content.get(self.kv[row][pos]) != hash(tuple(toks[: pos + 1])):
                    raise AssertionError(f"row {row} position {pos}: its KV slot holds another prefix's KV")
            if not s.sample:
                self.computed[row] = end
                continue
            if end != len(toks):
                raise AssertionError("sample before the end of the known tokens")
            # Greedy verification: each position's target; drafts are accepted while they equal it.
            known = len(self.tokens[row])
            out = []
            for j in range(len(drafts) + 1):
                out.append(self.next_token(toks[known - 1 + j], known + j))
                if j == len(drafts) or drafts[j] != out[-1]:
                    break
            self.tokens[row] += out
            self.computed[row] = known - 1 + len(out)  # the rejected drafts' KV is not the row's
            self.drafts[row] = self.drafter(self.tokens[row], self.k) if self.k else []
            sampled += out
            counts.append(len(out))
            verified.append(len(drafts))
        spec = any(s.num_drafts for s in so.scheduled)
        return ModelRunnerOutput(so.step_id, sampled, num_sampled=counts if spec else None,
                                 num_drafts=verified if spec else None, images_kept=kept or None)

    def _encode(self, so: SchedulerOutput) -> list[str]:
        """The step's encoding work, as the worker's EncoderCache runs it."""
        for d in so.encode_drop:
            if self.encoded.get(d, 0) >= self.encoder_layers:
                raise AssertionError(f"dropped the finished encoding {d}")
            self.encoded.pop(d, None)
        kept = []
        for w in so.encode:
            done = self.encoded.get(w.digest)
            if done == self.encoder_layers:
                kept.append(w.digest)
                continue
            if (done is None) != (w.image is not None):
                raise AssertionError(f"encoding {w.digest}: pixels {'missing' if done is None else 'again'}")
            if (done or 0) + w.pieces > self.encoder_layers:
                raise AssertionError(f"encoding {w.digest}: more pieces than the encoder's layers")
            self.encoded[w.digest] = (done or 0) + w.pieces
        return kept


def expected_output(prompt: list[int], n: int, stop: set[int] | None = None) -> list[int]:
    out: list[int] = []
    seq = list(prompt)
    while len(out) < n:
        t = toy_next(seq[-1], len(seq))
        out.append(t)
        seq.append(t)
        if stop and t in stop:
            break
    return out


class FaultyWorker:
    """The fake worker with the real worker's failure semantics: a step that prefills a request whose
    prompt holds `marker` raises (StepFailed naming its row), and the rows of a failed step are poisoned
    until freed, so a later step that schedules one is skipped (StepFailed naming none)."""

    def __init__(self, inner: FakeWorker, marker: int, name_culprit: bool = True) -> None:
        self.inner, self.marker = inner, marker
        self.name_culprit = name_culprit  # False: the failure names no row (all of the step are suspects)
        self.poisoned: set[int] = set()
        self.failed: list[SchedulerOutput] = []

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput | StepFailed:
        self.poisoned -= set(so.freed_req_pool_indices)
        rows = {s.req_pool_idx for s in so.scheduled}
        blamed = [r.req_pool_idx for r in so.new_reqs if self.marker in r.token_ids[: r.num_prompt]]
        if not blamed and not self.poisoned & rows:
            return self.inner.execute(so)
        # rows only
        self.inner.execute(SchedulerOutput(so.step_id, so.freed_req_pool_indices, so.new_reqs, []))
        self.poisoned |= rows
        self.failed.append(so)
        return StepFailed(
            so.step_id, blamed if self.name_culprit else [], "request_failed.internal", "injected"
        )

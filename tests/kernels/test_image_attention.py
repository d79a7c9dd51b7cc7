"""Images attended both ways (Gemma 3: an image's tokens see the whole image, other tokens stay causal), with
and without a sliding window, in the torch path every backend takes for such a step: against dense float64
attention with transformers' mask rule, AND(window, OR(causal, same image)); and through the C backend,
which hands such a step to it."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.ops import resolve_ops
from tandem.kernels.reference.paged_attention import build_attention_plan, paged_attention_ref
from tandem.worker.attention_backend import CpuBackend, TorchPlan
from tandem.worker.forward_batch import ForwardBatch
from tests.kernels.test_paged_attention import make_case

# (seq_len, extend_len) per request and its images' [start, end) positions: a fresh prefill with two images,
# a chunk over a cached prefix that starts inside an image (its earlier tokens cached), a decode, a prefill
# with none.
REQS = [(60, 60), (90, 50), (33, 1), (20, 20)]
SPANS = [[(5, 21), (30, 46)], [(35, 60), (70, 86)], [], []]


def dense(c: dict, window: int) -> torch.Tensor:
    group = c["q"].shape[1] // c["k_pool"].shape[1]
    outs, t = [], 0
    for slots, (s, e), spans in zip(c["slot_lists"], REQS, SPANS, strict=True):
        k = c["k_pool"][slots].repeat_interleave(group, dim=1).double()
        v = c["v_pool"][slots].repeat_interleave(group, dim=1).double()
        scores = torch.einsum("ehd,shd->hes", c["q"][t : t + e].double(), k) * c["scale"]
        pos, key = torch.arange(s - e, s)[:, None], torch.arange(s)[None, :]
        same = torch.zeros(e, s, dtype=torch.bool)
        for a, b in spans:
            same |= (pos >= a) & (pos < b) & (key >= a) & (key < b)
        seen = (key <= pos) | same
        if window:
            seen &= key > pos - window
        outs.append(torch.einsum("hes,shd->ehd", scores.masked_fill(~seen, float("-inf")).softmax(-1), v))
        t += e
    return torch.cat(outs).float()


@pytest.mark.parametrize("window", [0, 9, 40])
def test_images_attend_both_ways_as_transformers_masks_them(window: int) -> None:
    c = make_case(REQS, hkv=2, group=2, seed=window)
    spans = [[(a, b) for a, b in sp if a < s and b > s - e] for sp, (s, e) in zip(SPANS, REQS, strict=True)]
    plan = build_attention_plan(c["req_to_token"], c["req_pool_indices"], c["seq_lens"], c["extend_lens"],
                                window=window, image_spans=spans)
    out = paged_attention_ref(c["q"], c["k_pool"], c["v_pool"], c["req_to_token"], c["req_pool_indices"],
                              c["seq_lens"], c["extend_lens"], c["scale"], plan=plan)
    torch.testing.assert_close(out, dense(c, window), atol=2e-5, rtol=2e-5)
    causal = paged_attention_ref(c["q"], c["k_pool"], c["v_pool"], c["req_to_token"], c["req_pool_indices"],
                                 c["seq_lens"], c["extend_lens"], c["scale"], window=window)
    assert not torch.allclose(causal, out, atol=1e-3)  # the spans changed what the images' tokens saw


def test_the_cpu_backend_hands_a_step_with_images_to_the_masked_path() -> None:
    ops = resolve_ops("cpu", torch.float32)
    backend = CpuBackend(ops.native)
    c = make_case(REQS, hkv=2, group=2, seed=3)
    batch = ForwardBatch.build(
        input_ids=torch.zeros(int(c["extend_lens"].sum()), dtype=torch.int64), positions=torch.zeros(1),
        out_cache_loc=torch.zeros(1), req_pool_indices=c["req_pool_indices"], seq_lens=c["seq_lens"],
        extend_lens=c["extend_lens"], logits_indices=torch.zeros(1))
    batch.image_spans = [[(a, b) for a, b in sp if a < s and b > s - e]
                         for sp, (s, e) in zip(SPANS, REQS, strict=True)]

    class Pools:
        req_to_token, swa_map = c["req_to_token"], None

    plan = backend.plan(batch, Pools())  # type: ignore[arg-type]
    assert isinstance(plan, TorchPlan)
    out = paged_attention_ref(c["q"], c["k_pool"], c["v_pool"], c["req_to_token"], c["req_pool_indices"],
                              c["seq_lens"], c["extend_lens"], c["scale"], plan=plan.attn)
    torch.testing.assert_close(out, dense(c, 0), atol=2e-5, rtol=2e-5)

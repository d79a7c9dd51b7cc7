"""A step's image tokens: which rows of the batch take an image's encoder output, and their positions.

A request's images came with it (NewReqData.images). A step computes some of its tokens, [start, end) of
its sequence; every image whose placeholder tokens overlap that range gives those rows its encoder output
(all of an image's rows come from one encoding, so a chunk boundary inside an image changes nothing), kept
by the worker's EncoderCache; an image whose KV is cached is not even looked up, its tokens are not
computed.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.protocol.image_item import ImageItem
from tandem.protocol.messages import ScheduledReq
from tandem.worker.encoder_cache import EncoderCache
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.request_state import RequestState


def attach_images(batch: ForwardBatch, sched: Sequence[ScheduledReq], state: RequestState,
                  cache: EncoderCache, bidirectional: bool) -> None:
    """Set batch.image_rows / image_embeds (and image_spans where images attend both ways) for the image
    tokens this step computes. Called after prepare_inputs, before the step advances the state."""
    pieces: list[tuple[int, ImageItem, int, int]] = []  # (first batch row, image, from, to) in image tokens
    spans: list[list[tuple[int, int]]] = []
    for i, s in enumerate(sched):
        images = state.images.get(s.req_pool_idx)
        mine: list[tuple[int, int]] = []
        if images:
            start = batch.seq_lens_cpu[i] - batch.extend_lens_cpu[i]  # type: ignore[index]
            end = batch.seq_lens_cpu[i]  # type: ignore[index]
            for im in images:
                a, b = max(im.offset, start), min(im.offset + im.length, end)
                if a < b:
                    pieces.append((batch.extend_starts_cpu[i] + a - start, im, a - im.offset, b - im.offset))
                    mine.append((im.offset, im.offset + im.length))
        spans.append(mine)
    if not pieces:
        return
    outputs = cache.get([im for _, im, _, _ in pieces])
    rows = [r0 + k for r0, _, a, b in pieces for k in range(b - a)]
    batch.image_rows = torch.tensor(rows, dtype=torch.int64, device=batch.input_ids.device)
    batch.image_embeds = torch.cat([outputs[im.digest][a:b] for _, im, a, b in pieces]).to(
        batch.input_ids.device)
    if bidirectional:
        batch.image_spans = spans


def attach_rope_positions(batch: ForwardBatch, state: RequestState, model: torch.nn.Module) -> None:
    """Multimodal RoPE (Qwen2.5-VL): batch.rope_positions [3, T] where a row of the step holds images; a
    request's prompt positions are worked out once (worker/models/mrope.py), its later tokens run `delta`
    behind their index."""
    if not any(r in state.images for r in batch.req_pool_indices_cpu):  # type: ignore[union-attr]
        return
    from tandem.worker.models.mrope import mrope_positions

    parts = []
    for row, s, e in zip(batch.req_pool_indices_cpu, batch.seq_lens_cpu, batch.extend_lens_cpu, strict=True):  # type: ignore[arg-type]
        start = s - e
        table = state.rope.get(row)
        if table is None and row in state.images:
            n = state.num_prompt[row]
            table = state.rope[row] = mrope_positions(
                state.tokens[row, :n].tolist(), [im.grid for im in state.images[row]], model.image_token_id,
                model.spatial_merge_size)
        if table is None:
            parts.append(torch.arange(start, s).expand(3, e))
            continue
        pos, delta = table
        n = pos.shape[1]
        lo = max(start, n)
        after = torch.arange(lo, max(lo, s)) + delta  # past the prompt: positions run delta behind
        parts.append(torch.cat([pos[:, start:min(s, n)], after.expand(3, after.numel())], 1))
    batch.rope_positions = torch.cat(parts, 1).to(batch.input_ids.device)

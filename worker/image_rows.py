"""A step's image tokens: which rows of the batch take an image's encoder output, and the encoder cache.

A request's images came with it (NewReqData.images). A step computes some of its tokens, [start, end) of
its sequence; every image whose placeholder tokens overlap that range gives those rows its encoder output
(all of an image's rows come from one encoding, so a chunk boundary inside an image changes nothing). The
encoder runs once per image digest: its outputs are kept, least recently used first out, within a byte
budget, so an image sent again (the next turn of a conversation, another request with the same picture)
whose KV is no longer cached is not encoded again; one whose KV is cached is not even looked up, its tokens
are not computed.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tandem.protocol.image_item import ImageItem
from tandem.protocol.messages import ScheduledReq
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.request_state import RequestState

DEFAULT_CACHE_BYTES = 512 << 20


def image_pixels(item: ImageItem) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(item.pixels, dtype="<f4").reshape(item.shape).copy())


def model_encoder(model: torch.nn.Module) -> Callable[[list[ImageItem]], list[torch.Tensor]]:
    """The model's image encoder over images of one shape: batched, or one at a time for a
    dynamic-resolution model (an image's grid shapes its encoding)."""
    def encode(items: list[ImageItem]) -> list[torch.Tensor]:
        if items[0].grid:
            return [model.encode_images(image_pixels(im).to(model.device, model.dtype), im.grid)
                    for im in items]
        pixels = torch.stack([image_pixels(im) for im in items]).to(model.device, model.dtype)
        return list(model.encode_images(pixels))

    return encode


class EncoderCache:
    """digest -> the image's encoder output [length, hidden]. encode(items) runs the model's encoder over
    images of one shape and returns one tensor per image."""

    def __init__(self, encode: Callable[[list[ImageItem]], list[torch.Tensor]],
                 budget_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.encode, self.budget = encode, budget_bytes
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.encoded = 0  # images run through the encoder (a count for tests and stats)

    def get(self, items: Sequence[ImageItem]) -> dict[str, torch.Tensor]:
        """The outputs of items (by digest), encoding those not kept, those of one shape together."""
        out: dict[str, torch.Tensor] = {}
        todo: dict[tuple, list[ImageItem]] = {}
        for im in items:
            t = self.entries.get(im.digest)
            if t is not None:
                self.entries.move_to_end(im.digest)
                out[im.digest] = t
            elif im.digest not in out:
                out[im.digest] = None  # type: ignore[assignment]
                todo.setdefault((tuple(im.shape), tuple(im.grid)), []).append(im)
        for group in todo.values():
            for im, t in zip(group, self.encode(group), strict=True):
                if t.shape[0] != im.length:
                    raise ValueError(f"the encoder gave {t.shape[0]} tokens for an image of {im.length}")
                out[im.digest] = t
                self._keep(im.digest, t)
                self.encoded += 1
        return out

    def _keep(self, digest: str, t: torch.Tensor) -> None:
        self.entries[digest] = t
        self.bytes += t.numel() * t.element_size()
        while self.bytes > self.budget and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()


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

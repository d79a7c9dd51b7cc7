"""The worker's image encodings: those done, kept by digest within a byte budget (least recently used first
out), and those in progress, which the scheduler advances a few pieces a step (protocol EncodeWork).

An image sent again (the next turn of a conversation, another request with the same picture) whose KV is no
longer cached is not encoded again while its output is kept. The scheduler counts the pieces it sent, so it
knows when an image is ready; if an output is nevertheless missing when a step needs it (the worker lost an
encoding in progress, or the budget pushed a finished one out), `get` encodes what is left there and then:
the pieces are a matter of time, never of the result.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from tandem.protocol.image_item import ImageItem
from tandem.protocol.messages import EncodeWork
from tandem.worker.models.encoder_stages import Stages, run_pieces, run_stages

DEFAULT_CACHE_BYTES = 512 << 20


def image_pixels(item: ImageItem) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(item.pixels, dtype="<f4").reshape(item.shape).copy())


def model_stages(model: torch.nn.Module) -> Callable[[ImageItem], Stages]:
    """An image's encoding by the model, in pieces (models/encoder_stages.py): [length, hidden] at the end.
    A dynamic-resolution model's image comes with its grid."""
    def start(item: ImageItem) -> Stages:
        px = image_pixels(item).to(model.device, model.dtype)
        if item.grid:
            return model.image_stages(px, item.grid)
        return _first(model.image_stages(px[None]))

    return start


def _first(stages: Stages) -> Stages:
    """The single image of a batch of one."""
    out = yield from stages
    return out[0]


class EncoderCache:
    def __init__(self, start: Callable[[ImageItem], Stages], budget_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.start, self.budget = start, budget_bytes
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.partial: dict[str, tuple[ImageItem, Stages]] = {}  # encodings in progress
        self.encoded = 0  # images whose encoding ended here (a count for tests and stats)

    def run(self, work: Iterable[EncodeWork]) -> list[str]:
        """A step's encoding work; the digests of images it found kept already (the scheduler need send
        no more of their pieces)."""
        kept = []
        for w in work:
            if w.digest in self.entries:
                kept.append(w.digest)
                continue
            job = self.partial.get(w.digest)
            if job is None:
                if w.image is None:
                    continue  # its start was lost: `get` encodes it whole if a step needs it
                job = self.partial[w.digest] = (w.image, self.start(w.image))
            try:
                out = run_pieces(job[1], w.pieces)
            except BaseException:
                del self.partial[w.digest]  # a generator that raised is spent: `get` starts it again
                raise
            if out is not None:
                del self.partial[w.digest]
                self._finish(job[0], out)
        return kept

    def drop(self, digests: Iterable[str]) -> None:
        """Encodings in progress that no request needs any more."""
        for d in digests:
            job = self.partial.pop(d, None)
            if job is not None:
                job[1].close()

    def get(self, items: Sequence[ImageItem]) -> dict[str, torch.Tensor]:
        """The outputs of items (by digest), finishing those not kept."""
        out: dict[str, torch.Tensor] = {}
        for im in items:
            t = self.entries.get(im.digest)
            if t is not None:
                self.entries.move_to_end(im.digest)
            elif im.digest not in out:
                job = self.partial.pop(im.digest, None)
                t = self._finish(im, run_stages(job[1] if job else self.start(im)))
            out[im.digest] = t  # type: ignore[assignment]
        return out

    def _finish(self, im: ImageItem, t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] != im.length:
            raise ValueError(f"the encoder gave {t.shape[0]} tokens for an image of {im.length}")
        self.encoded += 1
        self.entries[im.digest] = t
        self.bytes += t.numel() * t.element_size()
        while self.bytes > self.budget and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        return t

"""Image encoding spread over steps, so a step never carries more than a bounded amount of it.

An image's encoding is its encoder's layers (a large fixed-size encoder's layers cut further, over blocks of
patches: VisionConfig.row_blocks), run a few pieces a step (protocol EncodeWork; the worker keeps the encoding
in progress). Each step advances the images that requests need, those already in progress first, then the
running requests' in their order, then the waiting ones' that admission would take next, at most `budget`
image tokens through one layer each (a piece of an image of T tokens costs T, or its share of T where a layer
is several pieces; a piece larger than the whole budget runs alone). A request's prefill stops before an image
not yet ready (Req.chunk_end): the text before it, and every other request, goes on meanwhile. The scheduler
counts the pieces it sent; steps run in order, so an image is ready for the step after its last piece, even
before that piece's result is back.

A step of encoding only goes to the worker when no step is in flight (not queued behind one, as steps with
tokens are): a request that arrives while images encode waits for one piece, not two.
"""
from __future__ import annotations

from collections.abc import Iterable
from itertools import chain, islice

from tandem.protocol.image_item import ImageItem
from tandem.protocol.messages import EncodeWork
from tandem.scheduler.req import Req


class ImageEncoding:
    def __init__(self, pieces: int, per_layer: int, budget: int) -> None:
        self.pieces, self.per_layer, self.budget = max(pieces, 1), per_layer, budget
        self.sent: dict[str, int] = {}  # digest -> pieces sent to the worker (all of them: ready)
        self.drops: list[str] = []  # encodings in progress no request needs: for the worker to drop

    def ready(self, im: ImageItem) -> bool:
        return self.sent.get(im.digest, 0) >= self.pieces

    def kept(self, digests: Iterable[str]) -> None:
        """The worker had these encodings already (kept from an earlier request): ready now."""
        for d in digests:
            if d in self.sent:
                self.sent[d] = self.pieces

    def plan(self, running: list[Req], waiting: Iterable[Req], max_running: int) -> list[EncodeWork]:
        """The next step's encoding work (max_running: --max-running-requests, which bounds how many
        waiting requests admission may take next)."""
        needed: dict[str, ImageItem] = {}  # images still to be computed, in order of need
        for req in chain(running, waiting):
            if not req.finished():
                for im in req.images:
                    if im.offset + im.length > req.num_computed_tokens:
                        needed.setdefault(im.digest, im)
        for d in [d for d in self.sent if d not in needed]:
            if self.sent.pop(d) < self.pieces:
                self.drops.append(d)
        near = chain(running, islice(waiting, max(max_running - len(running), 1)))
        first = {im.digest for r in near for im in r.images}
        todo = [im for im in needed.values() if im.digest in first and not self.ready(im)]
        todo.sort(key=lambda im: im.digest not in self.sent)  # those in progress first (stable)
        work, left = [], self.budget
        for im in todo:
            done, cost = self.sent.get(im.digest, 0), self.cost(im)
            k = min(self.pieces - done, left // cost if work else max(left // cost, 1))
            if k < 1:
                break
            work.append(EncodeWork(im.digest, k, im if done == 0 else None))
            self.sent[im.digest] = done + k
            left -= k * cost
        return work

    def cost(self, im: ImageItem) -> int:
        """A piece of im's encoding against the budget: its tokens through (a share of) one layer."""
        return max(1, im.length // self.per_layer)

    def take_drops(self) -> list[str]:
        out, self.drops = self.drops, []
        return out

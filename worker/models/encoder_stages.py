"""An image encoder as a sequence of pieces, so the scheduler can spread one image's encoding over steps.

A model that reads images writes its encoder once, as a generator that yields between its layers (the
`stages` of its vision tower): `next()` on it runs the next piece, the last one returns the encoder's output
(StopIteration's value). `run_stages` runs all of it at once; that is the model's `encode_images`, so the
pieced and the whole encoding are the same code. The pieces of an image are its encoder's layers: the
embedding runs with the first, the projection with the last (`encoder_pieces`).
"""
from __future__ import annotations

from collections.abc import Generator

import torch

Stages = Generator[None, None, torch.Tensor]


def run_stages(stages: Stages) -> torch.Tensor:
    """Every remaining piece of an encoding: its output."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value


def run_pieces(stages: Stages, pieces: int) -> torch.Tensor | None:
    """Run up to `pieces` more pieces: the output if the encoding ended in them, else None."""
    for _ in range(pieces):
        try:
            next(stages)
        except StopIteration as done:
            return done.value
    return None

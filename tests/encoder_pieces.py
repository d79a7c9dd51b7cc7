"""Encodings run in pieces interleaved, as steps run them (worker/models/encoder_stages.py)."""
from __future__ import annotations

from tandem.worker.models.encoder_stages import Stages, run_pieces


def interleaved(jobs: list[Stages]) -> tuple[list, int]:
    """A piece of each unfinished encoding in turn until all end: their outputs, and the first's pieces."""
    outs: list = [None] * len(jobs)
    pieces = 0
    while any(o is None for o in outs):
        for i, job in enumerate(jobs):
            if outs[i] is None:
                outs[i] = run_pieces(job, 1)
                pieces += i == 0
    return outs, pieces

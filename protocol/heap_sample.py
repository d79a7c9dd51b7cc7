"""What the worker's heap holds: sent by rank 0 with a step's result, reported in the engine's stats."""
from __future__ import annotations

import msgspec


class HeapSample(msgspec.Struct):
    """Rank 0's glibc heap after a periodic trim (worker/heap_keeper.py), in bytes."""

    in_use: int  # allocated: arena chunks plus mmapped blocks
    free: int  # free chunks the arenas hold (their whole pages are back with the OS after a trim)
    rss: int  # the worker's resident set after the trim
    trims: int  # trims so far
    released: int  # resident bytes the trims gave back, summed

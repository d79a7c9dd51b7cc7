"""Memory for a recorded CPU decode step (worker/step_recorder.py): every buffer an op made while recording
was a temporary of its own; here each is given memory from a pool by its live range, the first to the last
node naming it, so a step's activations share a few buffers (and stay in cache) as one hand-laid step would.
Outputs read after the replay keep their own buffers; named scratch (the attention's, the int8 activations')
is one buffer each, as large as its largest user asked."""

from __future__ import annotations

import torch

from tandem.kernels.native import step_graph as sg
from tandem.kernels.native.step_graph import Node, Ptr


def lay_out(nodes: list[Node], temps: dict[int, torch.Tensor], outputs: list[torch.Tensor],
            scratch: dict[str, int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the nodes as the replayer takes them [n, NODE_ARGS + 1], the buffers they point into: keep them
    alive). temps: storage address -> the temporary owning it."""
    kept = {t.untyped_storage().data_ptr() for t in outputs}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, node in enumerate(nodes):
        for p in node.pointers():
            if isinstance(p.base, int) and p.base in temps and p.base not in kept:
                first.setdefault(p.base, i)
                last[p.base] = i
    where: dict[int | str, int] = {}
    buffers = [temps[k].zero_() for k in kept if k in temps]
    starts: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}
    for k in first:
        starts.setdefault(first[k], []).append(k)
        ends.setdefault(last[k], []).append(k)
    free: list[torch.Tensor] = []
    held: dict[int, torch.Tensor] = {}
    for i in range(len(nodes)):
        for k in starts.get(i, ()):  # live from node i: a buffer no node before it still needs
            need = temps[k].untyped_storage().nbytes()
            fits = [j for j, b in enumerate(free) if b.numel() >= need]
            if fits:  # the smallest free buffer that holds it
                buf = free.pop(min(fits, key=lambda j: free[j].numel()))
            else:
                buf = torch.zeros(need, dtype=torch.uint8)
                buffers.append(buf)
            held[k], where[k] = buf, buf.data_ptr()
        for k in ends.get(i, ()):  # after node i, its last reader
            free.append(held.pop(k))
    for name, nbytes in scratch.items():
        buffers.append(torch.zeros(max(nbytes, 8), dtype=torch.uint8))
        where[name] = buffers[-1].data_ptr()

    def address(p: Ptr) -> int:
        return where[p.base] + p.offset if p.base in where else int(p.base) + p.offset

    rows = [node.row(address) for node in nodes]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), sg.NODE_ARGS + 1), buffers

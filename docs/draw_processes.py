"""Draws docs/processes.png, the picture of tandem's processes and sockets in docs/architecture.md.

Run `python docs/draw_processes.py` after changing which process talks to which; the PNG is committed."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

# name: (x, y, label, colour); one box a process or, dashed, a library inside the caller's process.
BOXES = {
    "client": (0.6, 4.2, "Client / AsyncClient\nfrontend/client/\n(in the user's process)", "#f4f4f4"),
    "http": (0.6, 2.4, "HTTP server\nfrontend/http/\n(OpenAI API)", "#e3f0fb"),
    "frontend": (3.6, 3.3, "frontend\nfrontend/server/\ntokenize, chat template,\nvalidate, route", "#e3f0fb"),
    "scheduler": (6.8, 3.3, "scheduler\nscheduler/\nReq, KV, prefix tree,\nbatches, grammar, stops", "#fdf0dc"),
    "worker": (10.0, 3.3, "worker rank 0\nworker/ + kernels/\nweights, KV pool,\nforward, sampling", "#e5f5e3"),
    "ranks": (10.0, 1.2, "worker ranks 1..N-1\n(tensor parallel)", "#e5f5e3"),
    "detok": (6.8, 1.2, "detokenizer\ndetokenizer/\ntext deltas, stop cuts", "#f3e6f7"),
    "launcher": (3.6, 5.6, "launcher  launch/\nstarts every process, one Ready handshake, teardown", "#ffffff"),
}
W, H = 2.5, 1.25
# (from, to, label, bend, label offset in y)
ARROWS = [
    ("client", "frontend", "DEALER→ROUTER\nGenerateRequest", 0.0, 0.35),
    ("http", "frontend", "same client socket", 0.0, 0.35),
    ("frontend", "scheduler", "PUSH\nTokenizedRequest", 0.0, 0.35),
    ("scheduler", "worker", "PUSH\nSchedulerOutput", 0.15, -0.55),
    ("worker", "scheduler", "PUSH\nModelRunnerOutput", 0.15, 0.55),
    ("scheduler", "detok", "PUSH\nTokenBatch", 0.0, 0.0),
    ("detok", "frontend", "PUSH\nOutputBatch", -0.2, 0.0),
    ("worker", "ranks", "gloo / NCCL", 0.0, 0.0),
]


def _centre(name: str) -> tuple[float, float]:
    x, y, *_ = BOXES[name]
    return x + W / 2, y + H / 2


def draw(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(13, 7))
    for name, (x, y, label, colour) in BOXES.items():
        width = 8.9 if name == "launcher" else W
        height = 0.7 if name == "launcher" else H
        style = "--" if name == "client" else "-"
        ax.add_patch(FancyBboxPatch((x, y), width, height, boxstyle="round,pad=0.05", fc=colour, ec="#333",
                                    ls=style))
        ax.text(x + width / 2, y + height / 2, label, ha="center", va="center", fontsize=9)
    for a, b, label, bend, dy in ARROWS:
        (x0, y0), (x1, y1) = _centre(a), _centre(b)
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                    arrowprops={"arrowstyle": "-|>", "shrinkA": 45, "shrinkB": 45, "color": "#444",
                                "connectionstyle": f"arc3,rad={bend}"})
        ax.text((x0 + x1) / 2, (y0 + y1) / 2 + dy, label, ha="center", va="center",
                fontsize=7.5, color="#224", backgroundcolor="white")
    ax.set_xlim(0, 13)
    ax.set_ylim(0.5, 6.7)
    ax.axis("off")
    ax.set_title("tandem: one process per box, ZeroMQ between them (msgspec structs from protocol/)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    draw(Path(__file__).with_name("processes.png"))

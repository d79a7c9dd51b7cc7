"""`tandem list`: the models in the models folder (`$TANDEM_MODELS`, else models/), as `ollama list` shows
them: NAME, SIZE, MODIFIED, and the PATH `tandem run NAME` serves."""
from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

from tandem.launch.known_models import KNOWN_MODELS
from tandem.launch.model_names import PulledModel, models_dir, pulled_models

COLUMNS = ("NAME", "SIZE", "MODIFIED", "PATH")
GAP = 4  # spaces between columns


def human_size(n: int) -> str:
    """Decimal units, as ollama writes them: 5 B, 98 MB, 1.2 GB, 270 MB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            value = n / scale
            if value >= 10 or value == int(value):
                return f"{int(value)} {unit}"
            return f"{value:.1f} {unit}"
    return f"{n} B"


def human_ago(seconds: float) -> str:
    """How long ago, as ollama (docker's units.HumanDuration) words it: "3 days ago"."""
    s = max(0, int(seconds))
    m, h = s // 60, s // 3600
    if s < 1:
        text = "Less than a second"
    elif s == 1:
        text = "1 second"
    elif s < 60:
        text = f"{s} seconds"
    elif m == 1:
        text = "About a minute"
    elif m < 60:
        text = f"{m} minutes"
    elif h == 1:
        text = "About an hour"
    elif h < 48:
        text = f"{h} hours"
    elif h < 24 * 7 * 2:
        text = f"{h // 24} days"
    elif h < 24 * 30 * 2:
        text = f"{h // (24 * 7)} weeks"
    elif h < 24 * 365 * 2:
        text = f"{h // (24 * 30)} months"
    else:
        text = f"{h // (24 * 365)} years"
    return text + " ago"


def table(models: list[PulledModel], now: float | None = None) -> str:
    now = time.time() if now is None else now
    rows = [COLUMNS, *((m.name, human_size(m.size_bytes), human_ago(now - m.modified), str(m.path))
                       for m in models)]
    widths = [max(len(r[i]) for r in rows) + GAP for i in range(len(COLUMNS) - 1)]
    return "".join("".join(c.ljust(w) for c, w in zip(r, widths)) + r[-1] + "\n" for r in rows)


def list_models(out: TextIO | None = None) -> int:
    out = out or sys.stdout
    models = pulled_models()
    if not models:
        out.write(f"No models in {models_dir()}/ yet: tandem pull NAME "
                  f"(one of: {', '.join(sorted(KNOWN_MODELS))})\n")
        return 0
    out.write(table(models))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem list", description=__doc__, allow_abbrev=False)
    p.parse_args(argv)
    return list_models()

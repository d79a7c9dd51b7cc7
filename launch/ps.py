"""`tandem ps [--host URL]`: what a running server has loaded (its /api/ps, as `ollama ps` shows it)."""
from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from datetime import datetime, timezone

from tandem.launch.list_models import human_size

DEFAULT_HOST = "http://127.0.0.1:8000"


def _until(expires_at: str, now: datetime) -> str:
    try:
        t = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    except ValueError:
        return expires_at
    left = (t - now).total_seconds()
    if left > 365 * 86400:
        return "Forever"
    if left <= 0:
        return "Stopping..."
    for unit, div in (("hours", 3600), ("minutes", 60)):
        if left >= div:
            return f"{int(left // div)} {unit} from now"
    return f"{int(left)} seconds from now"


def ps_table(models: list[dict], now: datetime | None = None) -> str:
    now = now or datetime.now(timezone.utc)
    rows = [("NAME", "SIZE", "CONTEXT", "UNTIL")] + [
        (m.get("name", "?"), human_size(int(m.get("size", 0))), str(m.get("context_length", "")),
         _until(str(m.get("expires_at", "")), now)) for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("    ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem ps", description=__doc__, allow_abbrev=False)
    p.add_argument("--host", default=DEFAULT_HOST, help=f"the server (default {DEFAULT_HOST})")
    p.add_argument("--api-key", help="the server's --api-key")
    args = p.parse_args(argv)
    req = urllib.request.Request(args.host.rstrip("/") + "/api/ps")
    if args.api_key:
        req.add_header("authorization", f"Bearer {args.api_key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            models = json.loads(r.read())["models"]
    except urllib.error.HTTPError as e:
        said = e.read()[:200].decode(errors="replace")
        raise SystemExit(f"tandem ps: {args.host} answered {e.code}: {said}") from None
    except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
        why = f"no tandem server at {args.host} ({e}); start one with tandem serve"
        raise SystemExit(f"tandem ps: {why}") from None
    print(ps_table(models))
    return 0

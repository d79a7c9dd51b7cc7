"""Test-only fault injection: make one request's step raise, to test that it fails alone.

TANDEM_INJECT_FAULT="SITE:TOKEN[,SITE:TOKEN...]" makes SITE raise InjectedFault for any request whose
prompt contains token id TOKEN. Sites: "scheduler.commit" (committing a sampled token), "worker.step" (the
worker's step that prefills the request) and "worker.fatal" (the worker's loop, before that step: a fault
that ends the engine). Read once per process; unset, a check
costs one dict lookup.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

ENV = "TANDEM_INJECT_FAULT"
SITES = ("scheduler.commit", "worker.step", "worker.fatal")


class InjectedFault(RuntimeError):
    """Raised by an injected fault; never in production."""


def _parse(spec: str) -> dict[str, int]:
    faults: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        site, _, token = item.rpartition(":")
        if site not in SITES or not token.isdigit():
            raise ValueError(f"{ENV}: expected SITE:TOKEN with SITE in {SITES}, got {item!r}")
        faults[site] = int(token)
    return faults


_FAULTS = _parse(os.environ.get(ENV, ""))
ARMED = bool(_FAULTS)  # a per-token call site asks this first: unset, it calls nothing


def check(site: str, prompt_ids: Sequence[int]) -> None:
    token = _FAULTS.get(site)
    if token is not None and token in prompt_ids:
        raise InjectedFault(f"injected fault at {site}")

"""One Prometheus page for many models: each loaded model's own page (its series already labelled
`model_name`) merged family by family, with the router's own series (which models are loaded) beside them.
Concatenating the pages would split a family's samples in two, which the text format forbids."""
from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge_pages(pages: Iterable[str], own: CollectorRegistry) -> bytes:
    """PAGES (text exposition) and the registry OWN as one page."""
    merged: dict[str, Metric] = {}
    for page in pages:
        for fam in text_string_to_metric_families(page):
            have = merged.get(fam.name)
            if have is None:
                merged[fam.name] = fam
            elif have.type == fam.type:
                have.samples.extend(fam.samples)
    registry = CollectorRegistry()
    registry.register(_Families(list(merged.values())))  # type: ignore[arg-type]
    return generate_latest(own) + generate_latest(registry)

"""The /metrics registry fed engine totals (EngineLoad): counters move by what is new since the last
load, per-position acceptance under a `position` label, and a restarted engine (totals back to 0)
never moves a counter backwards."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tandem.frontend.http.metrics import Metrics
from tandem.protocol.messages import EngineLoad


def samples(m: Metrics) -> dict[tuple[str, str | None], float]:
    """(sample name, position label) -> value, for the tandem:spec_* and preemption counters."""
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            if s.name.endswith("_total") and ("spec_decode" in s.name or "preemptions" in s.name):
                out[(s.name, s.labels.get("position"))] = s.value
    return out


def test_spec_decode_counters_follow_engine_totals() -> None:
    m = Metrics("tiny")
    m.on_load(EngineLoad(preemptions=1, spec_num_drafts=3, spec_draft_tokens=12, spec_accepted_tokens=5,
                         spec_accepted_per_position=[3, 2]))
    m.on_load(EngineLoad(preemptions=1, spec_num_drafts=5, spec_draft_tokens=20, spec_accepted_tokens=9,
                         spec_accepted_per_position=[5, 3, 1]))
    got = samples(m)
    assert got[("tandem:spec_decode_num_drafts_total", None)] == 5
    assert got[("tandem:spec_decode_num_draft_tokens_total", None)] == 20
    assert got[("tandem:spec_decode_num_accepted_tokens_total", None)] == 9
    per_pos = {pos: v for (name, pos), v in got.items() if name.endswith("_per_pos_total")}
    assert per_pos == {"0": 5, "1": 3, "2": 1}
    assert got[("tandem:num_preemptions_total", None)] == 1
    # The engine restarted: its totals start over, and the counters only move by what is new after that.
    m.on_load(EngineLoad(spec_num_drafts=1, spec_draft_tokens=4, spec_accepted_tokens=2,
                         spec_accepted_per_position=[1, 1]))
    m.on_load(EngineLoad(spec_num_drafts=2, spec_draft_tokens=8, spec_accepted_tokens=3,
                         spec_accepted_per_position=[2, 1]))
    got = samples(m)
    assert got[("tandem:spec_decode_num_draft_tokens_total", None)] == 24
    assert got[("tandem:spec_decode_num_accepted_tokens_total", None)] == 10
    assert got[("tandem:spec_decode_num_accepted_tokens_per_pos_total", "0")] == 6

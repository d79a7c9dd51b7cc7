"""A row's draft acceptance record decides how many matched drafts a CPU verify step pays for."""

from __future__ import annotations

from tandem.worker.draft_record import ROW_COST, DraftRecord


def test_prior_verifies_every_match_at_batch_1_and_fewer_as_the_batch_grows() -> None:
    rec = DraftRecord()
    assert rec.alpha == 0.5
    assert rec.worth(4, batch=1) == 4
    assert rec.worth(2, batch=1) == 2  # never more than matched
    assert rec.worth(0, batch=1) == 0
    assert rec.worth(4, batch=16) == 1  # 0.5 > 16 * ROW_COST > 0.25
    assert rec.worth(4, batch=int(1 / ROW_COST) + 1) == 0


def test_accepted_drafts_earn_longer_runs_and_rejections_take_them_away() -> None:
    rec = DraftRecord()
    for _ in range(8):
        rec.verified(4, 4)
    assert rec.alpha > 0.9 and rec.worth(4, batch=16) == 4
    shorter = [rec.worth(4, batch=16)]
    for _ in range(6):  # a run of full rejections: fewer drafts each time, then none
        rec.verified(max(shorter[-1], 1), 0)
        shorter.append(rec.worth(4, batch=16))
    assert shorter == sorted(shorter, reverse=True) and shorter[-1] == 0
    assert rec.worth(4, batch=1) >= 1  # at batch 1 a draft still pays off


def test_partial_acceptance_counts_the_first_rejection_as_a_trial() -> None:
    rec = DraftRecord(accepted=0.0, trials=0.0)
    rec.verified(4, 2)  # two accepted, the third rejected, the fourth never judged
    assert (rec.accepted, rec.trials) == (2.0, 3.0)
    rec = DraftRecord(accepted=0.0, trials=0.0)
    rec.verified(3, 3)  # all accepted: no rejection to count
    assert (rec.accepted, rec.trials) == (3.0, 3.0)


def test_a_row_that_stopped_drafting_drifts_back_and_tries_again() -> None:
    rec = DraftRecord()
    for _ in range(6):
        rec.verified(1, 0)
    assert rec.worth(4, batch=16) == 0
    steps = 0
    while rec.worth(4, batch=16) == 0:
        rec.skipped()
        steps += 1
        assert steps < 50, "never tries again"
    assert rec.worth(4, batch=16) == 1

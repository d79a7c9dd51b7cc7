"""How many of a row's drafts are worth verifying on a CPU, from the row's record of accepted drafts.

On a GPU the extra query rows of a verify step cost next to nothing, so every matched draft is verified.
On a CPU each row costs: SmolLM2's layers and head take ~2.5 ms more per added row at batch 16, ~2% of
that step (`python -m tandem.benchmarks.linear_shape`), while an accepted draft saves one row's share of a
step,
1/B of it at batch B. Draft position j (1-based) pays off when the chance that it is accepted,
alpha^j, exceeds ROW_COST * B: at batch 1 nearly every draft does, at batch 16 only those of rows whose
drafts keep being accepted, and from batch ~50 none (the scheduler's reservation for them is rolled
back like a rejection).
"""

from __future__ import annotations

from dataclasses import dataclass

# A verify row's cost as a fraction of a step's, measured on the 2-core AVX2 machine (see module doc).
ROW_COST = 0.02
# The weight of the record so far against each new trial: the last few trials count most.
DECAY = 0.75


@dataclass
class DraftRecord:
    """Decayed counts of drafts accepted and of draft trials (an accepted draft, or the first rejected
    one: the drafts after it were never judged), each trial discounting the ones before by DECAY.
    Starts at one success in two trials (alpha = 0.5)."""

    accepted: float = 1.0
    trials: float = 2.0

    @property
    def alpha(self) -> float:
        """Estimated chance that the next draft is accepted."""
        return self.accepted / self.trials

    def worth(self, matched: int, batch: int) -> int:
        """How many of the `matched` drafts to verify in a step of `batch` sampling rows."""
        a, bar = self.alpha, ROW_COST * batch
        n, p = 0, a
        while n < matched and p > bar:
            n, p = n + 1, p * a
        return n

    def verified(self, drafts: int, accepted: int) -> None:
        """Records a verify of `drafts` drafts of which the first `accepted` were accepted."""
        trials = accepted + (accepted < drafts)
        keep = DECAY**trials
        self.accepted = keep * self.accepted + accepted
        self.trials = keep * self.trials + trials

    def skipped(self) -> None:
        """A step without drafts for this row: the record drifts back to the prior, so a row that lost
        its drafts to a bad run tries again later."""
        self.accepted = DECAY * self.accepted + (1 - DECAY) * 1.0
        self.trials = DECAY * self.trials + (1 - DECAY) * 2.0

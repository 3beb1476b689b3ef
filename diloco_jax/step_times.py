"""Each worker's seconds per inner step as a syncer measures them: the median of its last
KEPT timings, so one noisy phase (a compile, a busy host) moves nothing. Asynchronous DiLoCo's
DyLU counts (`arrival_rule.ArrivalRule`) and Decoupled DiLoCo's adaptive grace on processes
(`decoupled_syncer.DecoupledSyncer`) read them."""

import statistics

KEPT = 5


class StepTimes:
    """`recent`: each timed worker's last KEPT seconds per step, oldest first (what a
    checkpoint keeps)."""

    def __init__(self, recent: dict[int, list[float]] | None = None):
        self.recent = {m: list(s)[-KEPT:] for m, s in (recent or {}).items()}

    def add(self, worker: int, seconds_per_step: float) -> None:
        """One timing of the worker (> 0 seconds per step)."""
        self.recent[worker] = [*self.recent.get(worker, []), seconds_per_step][-KEPT:]

    def timed(self) -> list[int]:
        """The workers timed so far, in order."""
        return sorted(self.recent)

    def __getitem__(self, worker: int) -> float:
        """The worker's median seconds per step; 0.0 for one not timed yet."""
        recent = self.recent.get(worker)
        return statistics.median(recent) if recent else 0.0


__all__ = ["KEPT", "StepTimes"]

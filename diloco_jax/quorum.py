"""Decoupled DiLoCo's merge rule, with no clock of its own: when each fragment's sync merges
and whose pushes it takes. Both clocks run this one rule: the real syncer
(`decoupled_syncer.DecoupledSyncer`) feeds it the learners' pushes as they arrive, timed by
the host's monotonic clock; the simulated clock (`DecoupledDiLoCo.schedule`) feeds it every
learner's pushes at step x step_seconds. Each then merges what the rule says, in its order.

- A learner's push of sync (p, k) counts once; a push of a sync already merged is late.
- Sync (p, k) is due its grace after its K-th push (`Grace`: a fixed window, or the
  paper's adaptive one on the simulated clock), and never before fragment p's sync k - 1
  merged (a fragment's syncs merge in order). Of the syncs due, the earliest merges first
  (ties: the lower fragment).
- It merges the learners whose pushes are in when it merges.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

# Seconds sync (p, k) waits after its K-th push, from (its first push's time, its K-th's,
# the K-th push's learner).
Grace = Callable[[float, float, int], float]


def fixed_grace(seconds: float) -> Grace:
    """A window of `seconds` (>= 0) after the K-th push, whoever pushed."""
    return lambda first, quorum, learner: seconds


class Due(NamedTuple):
    """The sync that merges next: at `time` (the clock's seconds), fragment p's sync k."""

    time: float
    fragment: int
    sync: int


class QuorumRule:
    """The rule's state: each fragment's next sync, the pushes in of each sync not merged,
    when each sync with a quorum is due, and each fragment's last merge time.

    fragments: P >= 1. quorum: K >= 1. grace: `Grace`. Times are the clock's seconds (any
    origin; only differences and order matter)."""

    def __init__(self, fragments: int, quorum: int, grace: Grace):
        self.quorum, self.grace = quorum, grace
        self.next_sync = [0] * fragments
        self.last_merge = [-math.inf] * fragments
        self.pushed: dict[tuple[int, int], dict[int, float]] = {}  # learner -> push time
        self.due_at: dict[tuple[int, int], float] = {}

    def push(self, fragment: int, sync: int, learner: int, now: float) -> bool:
        """Takes learner's push of (fragment, sync) at `now`: False if that sync has merged
        (late). A learner's second push of the same sync counts once (its first time stays)."""
        if sync < self.next_sync[fragment]:
            return False
        key = (fragment, sync)
        pushed = self.pushed.setdefault(key, {})
        if learner in pushed:
            return True
        pushed[learner] = now
        if len(pushed) == self.quorum:
            first = min(pushed.values())
            self.due_at[key] = now + self.grace(first, now, learner)
        return True

    def next_due(self) -> Due | None:
        """The sync to merge next and when it is due (None while no fragment's next sync
        has its quorum)."""
        due = [
            Due(max(self.due_at[(p, k)], self.last_merge[p]), p, k)
            for p, k in enumerate(self.next_sync)
            if (p, k) in self.due_at
        ]
        return min(due, default=None)

    def merge(self, due: Due, now: float) -> tuple[int, ...]:
        """Marks `due`'s sync merged at `now` (>= due.time); the learners it takes, sorted."""
        key = (due.fragment, due.sync)
        del self.due_at[key]
        self.next_sync[due.fragment] = due.sync + 1
        self.last_merge[due.fragment] = now
        return tuple(sorted(self.pushed.pop(key)))

    def resume(self, next_sync: list[int]) -> None:
        """A restarted syncer's rule: each fragment's next sync from its checkpoint, no
        pushes in (the learners push again)."""
        self.next_sync = list(next_sync)
        self.pushed, self.due_at = {}, {}
        self.last_merge = [-math.inf] * len(next_sync)


__all__ = ["Due", "Grace", "QuorumRule", "fixed_grace"]

"""DiLoCo's round on the elastic syncer, as a rule with no clock of its own: when a round
opens and for whom, whose pushes it takes, when its sync closes, and when the run is short of
workers. The syncer (`syncer.Syncer`) feeds it its members and the host's monotonic clock and
does what it decides (hands out the round, merges the sync, ends the run); each of the
elastic runtime's servers keeps its decisions in a part like this one
(`arrival_rule.ArrivalRule` for asynchronous DiLoCo and HALoS, `quorum.QuorumRule` for
Decoupled DiLoCo), its members in `membership.Membership`.

- The first round opens once all M workers are present, a resumed syncer's once every member
  it had is back (with min_workers present), and either after join_timeout with min_workers
  present. Its participants are the members present then.
- It takes one push from each participant (the first; a push from anyone else is late).
- Its sync closes once min_workers have pushed and no live participant is still to push, or
  grace_seconds after the min_workers-th push.
- A live participant without a push round_timeout after the opening is stuck: the syncer
  removes it.
- A round that can no longer reach min_workers opens again for the members there (where they
  differ from its participants).
- Short of min_workers for longer than quorum_timeout (`Shortage`), the run ends.
"""

from typing import Any, NamedTuple


class Decision(NamedTuple):
    """What the rule says now: "wait"; "open" the round for `participants` (`why`: "start",
    "resumed", "quorum lost", "next"); "close" its sync; or "end" the run (`why`: what was
    short)."""

    action: str
    participants: frozenset[int] = frozenset()
    why: str = ""


WAIT = Decision("wait")


class Shortage:
    """How long a server has been short of workers: after `short(now)` calls spanning more
    than `timeout` seconds with no `clear()` between, the run ends."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.since: float | None = None

    def short(self, now: float) -> bool:
        """Notes a shortage at `now`; whether it has lasted longer than the timeout."""
        if self.since is None:
            self.since = now
        return now - self.since > self.timeout

    def clear(self) -> None:
        self.since = None


class RoundRule:
    """The round's state: whether it is open, its participants, the pushes it took (each
    worker's payload, whatever the syncer keeps), when it opened and when its quorum came.

    num_workers: M >= 1. min_workers: the quorum, in [1, M]. grace_seconds, round_timeout:
    None or seconds >= 0. join_timeout, quorum_timeout: seconds >= 0. Times are the clock's
    seconds (any origin)."""

    def __init__(
        self, num_workers: int, min_workers: int, *, grace_seconds: float | None,
        round_timeout: float | None, join_timeout: float, quorum_timeout: float,
    ):  # fmt: skip
        self.num_workers, self.min_workers = num_workers, min_workers
        self.grace_seconds, self.round_timeout = grace_seconds, round_timeout
        self.join_timeout = join_timeout
        self.shortage = Shortage(quorum_timeout)
        self.is_open = False
        self.participants: set[int] = set()
        self.pushed: dict[int, Any] = {}
        self.opened_at: float | None = None
        self.quorum_at: float | None = None

    def open(self, participants: set[int], now: float) -> None:
        """Opens a round at `now` for `participants`, no pushes in."""
        self.is_open, self.participants, self.pushed = True, set(participants), {}
        self.opened_at, self.quorum_at = now, None
        self.shortage.clear()

    def awaits(self, worker: int) -> bool:
        """Whether the open round waits for `worker`'s push."""
        return self.is_open and worker in self.participants and worker not in self.pushed

    def push(self, worker: int, payload: Any, now: float) -> bool:
        """Takes `worker`'s push at `now` (its first counts); False (late) unless the round
        is open and the worker takes part in it."""
        if not self.is_open or worker not in self.participants:
            return False
        if worker not in self.pushed:
            self.pushed[worker] = payload
            if self.quorum_at is None and len(self.pushed) >= self.min_workers:
                self.quorum_at = now
        return True

    def leave(self, worker: int) -> None:
        """`worker` left (removed, or its process replaced): unless its push is in, the round
        no longer waits for it, even if it comes back."""
        if worker not in self.pushed:
            self.participants.discard(worker)

    def stuck(self, now: float, members: set[int]) -> list[int]:
        """The live participants still to push round_timeout after the opening, sorted."""
        if not self.is_open or self.round_timeout is None:
            return []
        if now - self.opened_at <= self.round_timeout:
            return []
        return sorted((self.participants & members) - set(self.pushed))

    def close(self) -> dict[int, Any]:
        """Closes the round's sync: the pushes it took."""
        self.is_open = False
        return self.pushed

    def decide(
        self, now: float, members: set[int], awaited: set[int], resumed: bool, started: float
    ) -> Decision:
        """What is due at `now`, with `members` live, `awaited` (a resumed syncer's members
        not back yet), `resumed` (the syncer started from a checkpoint) and `started` (when
        it started)."""
        if not self.is_open:
            present = members - awaited
            everyone = len(present) == self.num_workers
            back = resumed and not awaited and len(present) >= self.min_workers
            waited = now - started >= self.join_timeout
            if everyone or back or (waited and len(present) >= self.min_workers):
                return Decision("open", frozenset(present), "resumed" if resumed else "start")
            if waited:
                return self._short(now, f"{len(present)} of {self.num_workers} workers joined")
            return WAIT
        waiting = (self.participants & members) - set(self.pushed)
        count = len(self.pushed)
        if count >= self.min_workers and (  # then quorum_at is set
            not waiting
            or (self.grace_seconds is not None and now - self.quorum_at >= self.grace_seconds)
        ):
            return Decision("close")
        if count + len(waiting) < self.min_workers:  # this round can't reach its quorum
            if len(members) >= self.min_workers and members != self.participants:
                return Decision("open", frozenset(members), "quorum lost")
            return self._short(now, f"{len(members)} live workers")
        self.shortage.clear()
        return WAIT

    def _short(self, now: float, what: str) -> Decision:
        return Decision("end", why=what) if self.shortage.short(now) else WAIT


__all__ = ["WAIT", "Decision", "RoundRule", "Shortage"]

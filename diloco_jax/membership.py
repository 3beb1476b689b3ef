"""Who is in an elastic run, with no clock of its own: each member's incarnation and when it
was last heard. Every syncer keeps its members in one (`syncer.Syncer` and its asynchronous
and HALoS kinds, `decoupled_syncer.DecoupledSyncer`, `gossip_syncer.GossipSyncer`), fed the
host's monotonic clock; what a syncer does with a silent member (remove it, or wait for it)
is its own rule.

- An incarnation is one process of a worker: a random id the syncer hands out when the
  worker joins. A worker that joins with the incarnation the syncer holds is reattaching (a
  restarted syncer keeps its members' incarnations); any other join is a new process, whose
  new incarnation replaces the old one.
- A call from a worker counts as heard only with the incarnation held for it; any other is
  told to join again.
"""

import dataclasses
import uuid
from collections.abc import Iterator
from typing import NamedTuple


@dataclasses.dataclass
class Member:
    """A member: its incarnation, and when it was last heard (the clock's seconds)."""

    incarnation: str
    last_seen: float


class Joined(NamedTuple):
    """A join's outcome: the member, whether it is a new incarnation (a new process, not a
    reattach), and whether that replaced one the syncer held."""

    member: Member
    new: bool
    replaced: bool


class Membership:
    """The members by worker id; iterating gives the worker ids."""

    def __init__(self, incarnations: dict[int, str] | None = None, now: float = 0.0):
        """Empty, or a restarted syncer's members (`incarnations`, from its checkpoint),
        each heard at `now`."""
        self.members = {m: Member(inc, now) for m, inc in (incarnations or {}).items()}

    def __contains__(self, worker: object) -> bool:
        return worker in self.members

    def __iter__(self) -> Iterator[int]:
        return iter(self.members)

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, worker: int) -> Member:
        return self.members[worker]

    def get(self, worker: int) -> Member | None:
        return self.members.get(worker)

    def join(self, worker: int, incarnation: str | None, now: float) -> Joined:
        """Worker `worker` joins at `now` with the incarnation it holds (None: a new
        process): reattached if the syncer holds it, else a new incarnation."""
        member = self.members.get(worker)
        if member is not None and incarnation == member.incarnation:
            member.last_seen = now
            return Joined(member, False, False)
        self.members[worker] = Member(uuid.uuid4().hex, now)
        return Joined(self.members[worker], True, member is not None)

    def heard(self, worker: int, incarnation: str, now: float) -> bool:
        """Notes a call of `worker` at `now`: False (not heard) unless it holds the
        incarnation the syncer holds for it."""
        member = self.members.get(worker)
        if member is None or member.incarnation != incarnation:
            return False
        member.last_seen = now
        return True

    def silent(self, now: float, timeout: float) -> list[tuple[int, float]]:
        """(worker, seconds silent) of each member not heard for more than `timeout` s."""
        quiet = [(m, now - x.last_seen) for m, x in self.members.items()]
        return [(m, seconds) for m, seconds in quiet if seconds > timeout]

    def remove(self, worker: int) -> None:
        del self.members[worker]

    def excuse(self, seconds: float) -> None:
        """Counts `seconds` the syncer was busy (deaf to calls) as heard for everyone."""
        for member in self.members.values():
            member.last_seen += seconds

    def incarnations(self) -> dict[int, str]:
        """Each member's incarnation (what a checkpoint keeps)."""
        return {m: x.incarnation for m, x in self.members.items()}


__all__ = ["Joined", "Member", "Membership"]

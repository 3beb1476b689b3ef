"""A gossip run's syncer (NoLoCo, GASLoC on real processes): the membership alone. It holds
no θ and takes no delta; the workers exchange their values with their groups directly
(`diloco_jax.peer`), each sync's groups drawn from the method's seed as the compiled round
draws them.

It tells each worker where its peers serve and how far every worker has saved its state:
- Join {worker, incarnation?, address} -> {incarnation, options, peers, floor}
- Heartbeat {worker, incarnation, saved} -> {status: "ok", peers, floor}, "rejoin", or the
  run's end ("done", "abort" with its reason)

`peers` maps each member to its peer address; `saved` is the syncs a worker has completed
and saved; `floor` the least over all M workers, below which no worker can ask a value
again. Every worker is needed at every sync (a worker's θ_m lives only in its own process
and its checkpoints), so a worker that dies is waited for: its partners wait for its values
until it comes back from its checkpoint. A worker silent for longer than heartbeat_timeout +
quorum_timeout (one that never joined: join_timeout, if longer) ends the run with a line
naming it. The run ends
("done") once every worker has saved all R syncs.

Its state is soft: a restarted syncer hears each worker again (told to rejoin, it joins with
its address and reports what it has saved).
"""

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diloco_jax.elastic_task import Elastic, ElasticTask, refuse_round_options
from diloco_jax.syncer_base import SyncerBase

log = logging.getLogger("diloco_jax.syncer")


class GossipSyncer(SyncerBase):
    """The membership's state machine; every method is safe to call from the gRPC threads.
    A silent member is waited for, never removed."""

    CLOCK_PERIOD = 0.1  # it only watches for absent workers

    def __init__(
        self, task: ElasticTask, options: Elastic, directory: Path, *,
        clock: Callable[[], float] = time.monotonic,
    ):  # fmt: skip
        super().__init__(task, clock)
        self.options = checked_for_gossip(options, task.num_workers)
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.addresses: dict[int, str] = {}  # each member's peer server
        self.saved = [0] * task.num_workers  # each worker's newest report, across restarts
        self.heard = [self.clock()] * task.num_workers  # when each was last heard
        self.silent: set[int] = set()  # logged as silent, not heard since
        self.joined: set[int] = set()  # the workers that ever joined this syncer

    def join(self, worker: int, incarnation: str | None, address: str = "") -> dict[str, Any]:
        self._check_worker(worker)
        if not isinstance(address, str) or not address.rpartition(":")[2].isdigit():
            raise ValueError(f"a gossip worker joins with its peer address HOST:PORT, got "
                             f"{address!r}")  # fmt: skip
        with self.cond:
            if self.done is not None:
                return self._ended(worker)
            joined = self.members.join(worker, incarnation, self.clock())
            if joined.new:
                log.info("worker %d joined (peer address %s)", worker, address)
                self.joined.add(worker)
            self.addresses[worker] = address
            self._seen(worker)
            return {"incarnation": joined.member.incarnation,
                    "options": self.options.to_message(), **self._view()}  # fmt: skip

    def heartbeat(self, worker: int, incarnation: str, saved: int = 0) -> dict[str, Any]:
        self._check_worker(worker)
        if isinstance(saved, bool) or not isinstance(saved, int):
            raise ValueError(f"saved must be an integer, got {saved!r}")
        if not 0 <= saved <= self.task.num_rounds:
            raise ValueError(f"saved must be in [0, {self.task.num_rounds}], got {saved}")
        with self.cond:
            ended = self._heard(worker, incarnation)
            if ended is not None:
                return ended
            self.saved[worker] = max(self.saved[worker], saved)
            if min(self.saved) == self.task.num_rounds:
                self.done = "finished"
                log.info("every worker saved its %d syncs: the run is done", self.task.num_rounds)
                return self._ended(worker)
            return {"status": "ok", **self._view()}

    def next_round(self, *args: Any) -> dict:
        raise ValueError("a gossip run has no rounds at the syncer: deltas go worker to worker")

    def push(self, *args: Any) -> dict:
        raise ValueError("a gossip run takes no pushes: deltas go worker to worker")

    def tick(self) -> None:
        """Ends the run when a worker has been absent past heartbeat_timeout +
        quorum_timeout (logging it as silent past heartbeat_timeout), or one that never
        joined past join_timeout if that is longer."""
        now, o = self.clock(), self.options
        with self.cond:
            if self.done is not None:
                return
            for m in range(self.task.num_workers):
                quiet, limit = now - self.heard[m], o.heartbeat_timeout + o.quorum_timeout
                if m not in self.joined:  # not yet started: as long as a first join may take
                    limit = max(limit, o.join_timeout)
                elif quiet > o.heartbeat_timeout and m not in self.silent:
                    self.silent.add(m)
                    log.info("worker %d silent for %.1f s: its partners wait for it", m, quiet)
                if quiet > limit:
                    self.done = (f"worker {m} was absent for {quiet:.0f} s: a gossip run needs "
                                 "every worker (its θ_m lives only in it)")  # fmt: skip
                    log.error("%s", self.done)
                    return

    def _noted(self, worker: int) -> None:
        self._seen(worker)

    def _seen(self, worker: int) -> None:
        self.heard[worker] = self.clock()
        self.silent.discard(worker)

    def _view(self) -> dict[str, Any]:
        peers = {str(m): self.addresses[m] for m in self.members}
        return {"peers": peers, "floor": min(self.saved)}


def checked_for_gossip(options: Elastic, num_workers: int) -> Elastic:
    """`options` checked for a gossip run; ValueError naming an option it can't honor: every
    worker takes part in every sync, from its own saved state."""
    options = options.checked(num_workers)
    if options.min_workers not in (1, num_workers):
        raise ValueError(
            f"Elastic.min_workers must be {num_workers} (or left at 1) for a gossip run: every "
            f"worker takes part in every sync, got {options.min_workers}"
        )
    refuse_round_options(
        options, "a gossip run",
        "a sync waits for each partner, which the run can't go on without",
        "a worker resumes its whole state from its own checkpoint",
    )  # fmt: skip
    return options

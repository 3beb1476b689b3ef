"""What every elastic syncer shares, whatever its rule: the lock its gRPC threads take, its
members (`membership.Membership`), the run's end and who has heard it, the check of a call's
worker id, and the thread that ticks its clock. `syncer.Syncer` (DiLoCo's rounds, and its
asynchronous and HALoS kinds), `decoupled_syncer.DecoupledSyncer` and
`gossip_syncer.GossipSyncer` are this with their own rule (`round_rule`, `arrival_rule`,
`quorum`, or the membership alone).
"""

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from diloco_jax.elastic_task import ElasticTask, check_worker, end_reply
from diloco_jax.membership import Membership

log = logging.getLogger("diloco_jax.syncer")


class SyncerBase:
    """The shared state: `task`; `clock` (seconds of any origin: the host's monotonic
    clock, or one a test sets); `cond` (the lock, and the condition workers' long polls wait
    on); `members`; `done` (None while the run goes on; "finished", or the line that ended
    it); `told` (the workers that heard the end)."""

    CLOCK_PERIOD = 0.05  # seconds between the clock's ticks

    def __init__(self, task: ElasticTask, clock: Callable[[], float] = time.monotonic):
        self.task, self.clock = task, clock
        self.cond = threading.Condition()
        self.members = Membership()
        self.done: str | None = None
        self.told: set[int] = set()

    def tick(self) -> None:
        """What the syncer's clock does every period (its rule's timeouts)."""
        raise NotImplementedError

    def run_clock(self, stop: threading.Event) -> None:
        """Ticks every CLOCK_PERIOD s until `stop` or the run's end; an error ends the run
        (`done`) with its line, never a hang."""
        while not stop.wait(self.CLOCK_PERIOD) and self.done is None:
            try:
                self.tick()
            except Exception as error:
                log.exception("the syncer failed")
                with self.cond:
                    self.done = f"the syncer failed: {type(error).__name__}: {error}"
                    self.cond.notify_all()
                return

    def all_told(self) -> bool:
        """Whether every member has heard the run's end."""
        with self.cond:
            return set(self.members) <= self.told

    def flush(self) -> None:
        """Waits for what the syncer still writes (nothing here)."""

    def _heard(self, worker: int, incarnation: str) -> dict[str, Any] | None:
        """With the lock held: the reply that ends a worker's call (the run's end, or
        "rejoin" for a worker not held as that incarnation), or None once it is noted
        alive."""
        if self.done is not None:
            return self._ended(worker)
        if not self.members.heard(worker, incarnation, self.clock()):
            return {"status": "rejoin"}
        self._noted(worker)
        return None

    def _noted(self, worker: int) -> None:
        """A live member's call, heard (nothing more here)."""

    def _ended(self, worker: int) -> dict[str, Any]:
        """The run's end as a reply to `worker`, which now knows it."""
        self.told.add(worker)
        return end_reply(self.done)

    def _check_worker(self, worker: Any) -> None:
        check_worker(worker, self.task.num_workers)


__all__ = ["SyncerBase"]

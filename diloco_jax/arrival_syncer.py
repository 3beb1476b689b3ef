"""Asynchronous DiLoCo's syncer (Liu et al. 2024, arXiv 2401.09135) for real worker processes:
the rule of `train_async`'s server on the real clock. `diloco_jax.syncer.Syncer` keeps the
membership (joins, heartbeats, removals, the quorum), the checkpoints and history.jsonl; this
rule (`diloco_jax.arrival_rule`, the one `train_async`'s simulated clock runs) replaces the
round:

- a worker that asks (`next_round`) gets a job at once: θ as it is, the updates applied so
  far (the job's start), its data position and its inner steps (H, or with
  `ElasticTask.dynamic_steps` DyLU's count from the workers' timed phases);
- its delta is applied the moment it arrives, with the outer rule and its age (the updates
  applied since the job started: `diloco_jax.outer.outer_update`'s `age`, which CGAD and
  Delayed Nesterov read), and its position advances; a delta of a job the syncer no longer
  holds (its worker was removed, or rejoined, or the syncer restarted past it) is "late" and
  its worker asks again, from the θ of then and the same position;
- each update is one history.jsonl line (the arrival log: update, worker, position, steps,
  start_update, staleness, loss, times) and a checkpoint (θ, the outer state, positions and
  the jobs handed out), so a restarted syncer takes the pushes of jobs it handed out before
  its checkpoint.

`elastic.arrivals(directory)` reads the log as `AsyncEvent`s, and
`train_async(..., arrivals=...)` replays it on the simulated clock: the same θ.
"""

import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax import wire
from diloco_jax.arrival_rule import ArrivalRule, Job
from diloco_jax.arrival_rule import age as arrival_age
from diloco_jax.decoupled_syncer import DecoupledSyncer
from diloco_jax.elastic_task import Elastic, ElasticTask
from diloco_jax.gossip_syncer import GossipSyncer
from diloco_jax.halos import HALoS
from diloco_jax.heloco_outer import job_start
from diloco_jax.outer import outer_update
from diloco_jax.round_rule import Shortage
from diloco_jax.step_times import StepTimes
from diloco_jax.syncer import Pushed, Syncer

log = logging.getLogger("diloco_jax.syncer")


class ArrivalSyncer(Syncer):
    """The syncer with asynchronous DiLoCo's rule (see the module docstring)."""

    def __init__(
        self, task: ElasticTask, options: Elastic, directory: Path, *,
        clock: Callable[[], float] = time.monotonic,
    ):  # fmt: skip
        if task.algo != "async":
            raise ValueError(f"ArrivalSyncer runs ElasticTask(algo='async'), got {task.algo!r}")
        self.handed_at: dict[int, float] = {}  # monotonic, for round_timeout
        self.shortage = Shortage(options.quorum_timeout)
        super().__init__(task, options, directory, clock=clock)
        self.awaited = set()  # nobody waits for anybody
        self._apply_one = jax.jit(functools.partial(outer_update, task.method.outer_optimizer))
        # The θ jobs start from: θ, or the outer rule's look-ahead (HeLoCo's θ̄), once per θ.
        start = job_start(task.method.outer)
        self._job_start = None if start is None else jax.jit(start)
        self._started: tuple[int, Any] = (-1, None)

    def _new_rule(self) -> ArrivalRule:
        """The jobs in hand and DyLU's timings (the median of a few phases, so one noisy
        phase does not move a count and compile a program for a new one)."""
        return ArrivalRule(self.task.inner_steps, self.task.dynamic_steps)

    def next_round(
        self, worker: int, incarnation: str, after: int, timeout: float, held: int = -1
    ) -> dict:
        """A new job for the worker at once: {"status": "round", serial, round (= its
        position: the job's key), position, steps, update (the updates applied before it),
        theta}; or "rejoin", "done", "abort".
        `held` is unused: θ travels whole (no compression here)."""
        self._check_worker(worker)
        with self.cond:
            ended = self._heard(worker, incarnation)
            if ended is not None:
                return ended
            self.serial += 1
            job = self.rule.hand_out(worker, self.serial, self.round, self.positions[worker],
                                     time.time())  # fmt: skip
            self.handed_at[worker] = self.clock()
            return {"status": "round", "serial": job.serial, "round": job.position,
                    "position": job.position, "steps": job.steps, "update": job.start_update,
                    "theta": wire.leaves(self._theta_for_jobs())}  # fmt: skip

    def _theta_for_jobs(self) -> Any:
        """The θ a job handed out now starts from (with the lock held)."""
        if self._job_start is None:
            return self.theta
        if self._started[0] != self.round:
            start = self._job_start(self.theta, self.outer_state)
            self._started = (self.round, jax.tree.map(np.asarray, start))
        return self._started[1]

    def _take(self, worker: int, serial: int, pushed: Pushed, steps_s: float) -> dict:
        """The delta of job `serial`, applied at once: "ok", or "late" (a job the syncer no
        longer holds: its worker asks again)."""
        job = None if self.done is not None else self.rule.take(worker, serial)
        if job is None:
            return {"status": "late"}
        if steps_s > 0:
            self.rule.timed(worker, steps_s / job.steps)
        if not pushed.finite:
            # Left out, as train_diloco's exclusion: the worker runs this position again.
            log.warning("worker %d's delta of position %d is not finite: left out",
                        worker, job.position)  # fmt: skip
            return {"status": "ok"}
        self._apply_arrival(worker, job, pushed, steps_s)
        return {"status": "ok"}

    def _apply_arrival(self, worker: int, job: Job, pushed: Pushed, steps_s: float) -> None:
        """Applies the job's delta with its age and records the update (`steps_s`: the
        seconds of the phase's inner steps)."""
        busy_since = self.clock()
        age = arrival_age(job, self.round)
        theta, outer = self._apply_one(self.theta, self.outer_state, pushed.leaves,
                                       jnp.int32(age))  # fmt: skip
        self.theta = jax.tree.map(np.asarray, theta)
        self.outer_state = jax.tree.map(np.asarray, outer)
        self.positions[worker] += 1
        record = {
            "round": self.round,  # the update's index (history.jsonl is cut back by it)
            "worker": worker,
            "position": job.position,
            "steps": job.steps,
            "start_update": job.start_update,
            "staleness": age,
            "loss": pushed.loss,
            "compute_s": round(pushed.compute_s, 4),
            "steps_s": round(steps_s, 4),
            "started": job.started,
            "time": time.time(),
            "positions": list(self.positions),
            **self._job_fields(job),
        }
        self._record(record, busy_since)
        log.info("update %d: worker %d's delta of position %d, age %d",
                 record["round"], worker, job.position, age)  # fmt: skip
        self._end_if_done()
        self.cond.notify_all()

    def _job_fields(self, job: Job) -> dict:
        """What a subclass's rule adds to an update's history line (none here)."""
        return {}

    def _drop(self, worker: int) -> None:
        """A removed worker, or one whose process was replaced: its job is no longer held
        (a push of it is late)."""
        self.rule.drop(worker)

    def _step(self) -> None:
        """No round to open or close: removes a worker whose job outlasts round_timeout, and
        ends the run after quorum_timeout with fewer than min_workers members."""
        if self.done is not None:
            return
        o, now = self.options, self.clock()
        if o.round_timeout is not None:
            for worker in list(self.rule.jobs):
                held = now - self.handed_at[worker]
                if worker in self.members and held > o.round_timeout:
                    self._remove(worker, f"no delta {held:.1f} s into its job")
        if len(self.members) < o.min_workers:
            if self.shortage.short(now):
                self._short_end(f"{len(self.members)} live workers")
        else:
            self.shortage.clear()

    def _saved_extra(self) -> dict:
        jobs = {str(m): [j.serial, j.start_update, j.position, j.steps, j.started]
                for m, j in self.rule.jobs.items()}  # fmt: skip
        # Copies: the writer thread reads them while pushes go on.
        step_seconds = {str(m): list(s) for m, s in self.rule.times.recent.items()}
        return {"jobs": jobs, "step_seconds": step_seconds}

    def _restore_extra(self, message: dict, path: Path) -> None:
        # A job handed out before the checkpoint gets a heartbeat timeout more, as members do.
        now = self.clock() + self.options.heartbeat_timeout
        self.rule.jobs = {
            int(m): Job(serial=int(serial), start_update=int(start), position=int(position),
                        steps=int(steps), started=float(started))
            for m, (serial, start, position, steps, started) in message["jobs"].items()
        }  # fmt: skip
        self.handed_at = dict.fromkeys(self.rule.jobs, now)
        self.rule.times = StepTimes(
            {int(m): [float(x) for x in s] for m, s in message["step_seconds"].items()}
        )


def make_syncer(
    task: ElasticTask, options: Elastic, directory: Path
) -> "Syncer | ArrivalSyncer | GossipSyncer | DecoupledSyncer":
    """The syncer of the task's algo: `Syncer` (rounds) or `ArrivalSyncer` (async); a gossip
    method's membership alone (`GossipSyncer`); Decoupled DiLoCo's (`DecoupledSyncer`);
    HALoS's global one (`halos_syncer.GlobalSyncer`; its regions' are started apart)."""
    if task.method.gossip is not None:
        return GossipSyncer(task, options, directory)
    if isinstance(task.server, HALoS):
        from diloco_jax.halos_syncer import GlobalSyncer

        return GlobalSyncer(task, options, directory)
    if task.server is not None:
        return DecoupledSyncer(task, options, directory)
    kind = ArrivalSyncer if task.algo == "async" else Syncer
    return kind(task, options, directory)


def arrival_events(lines: list[dict[str, Any]]) -> tuple:
    """An async run's history.jsonl lines as `AsyncEvent`s (times in seconds since the first
    job started), for `train_async(arrivals=...)`."""
    from diloco_jax.async_train import AsyncEvent

    origin = min((x["started"] for x in lines), default=0.0)
    return tuple(
        AsyncEvent(
            update=int(x["round"]),
            worker=int(x["worker"]),
            job=int(x["position"]),
            steps=int(x["steps"]),
            start=x["started"] - origin,
            time=x["time"] - origin,
            start_update=int(x["start_update"]),
            staleness=int(x["staleness"]),
        )
        for x in lines
    )


__all__ = ["ArrivalSyncer", "Job", "arrival_events", "make_syncer"]

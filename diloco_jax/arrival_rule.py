"""Asynchronous DiLoCo's server rule (Liu et al. 2024, arXiv 2401.09135), with no clock of
its own: the job a worker gets, whether its delta is still wanted, and the delta's age. Both
clocks run this one rule: the real syncer (`arrival_syncer.ArrivalSyncer`, and each HALoS
region's) on the workers' gRPC calls; `train_async`'s simulated clock (`async_schedule`) on
each worker's simulated finish times.

- A worker that asks gets a job at once: the updates applied so far (where it starts), its
  data position and its inner steps: H, or with DyLU floor(H v_m / max v), v = 1 / each
  timed worker's seconds per step (`step_times.StepTimes`: the median of its last few), over
  the workers timed so far (H for one not timed yet).
- A delta is taken when it is of the worker's job in hand (the job's serial); any other is
  late (its worker was removed or rejoined, or a syncer restarted past it). Its age is the
  updates applied since its job started, what the outer rule reads.
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from diloco_jax.checks import check_int
from diloco_jax.step_times import StepTimes


def checked_step_seconds(step_seconds: Any, num_workers: int | None = None) -> tuple[float, ...]:
    """step_seconds as floats, checked: one finite number > 0 per worker (`num_workers` of
    them when given, else at least one). Raises ValueError naming step_seconds."""
    try:
        seconds = tuple(step_seconds)
    except TypeError:
        raise ValueError(
            f"step_seconds must be a sequence of numbers, one per worker, got {step_seconds!r}"
        ) from None
    if not seconds or (num_workers is not None and len(seconds) != num_workers):
        want = "at least one" if num_workers is None else f"num_workers = {num_workers}"
        raise ValueError(
            f"step_seconds must hold one number per worker ({want}), got {len(seconds)}"
        )
    for s in seconds:
        if isinstance(s, bool) or not isinstance(s, int | float | np.number):
            raise ValueError(f"step_seconds must hold numbers, got {s!r}")
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"step_seconds must be finite and > 0, got {s!r}")
    return tuple(float(s) for s in seconds)


def dynamic_local_steps(step_seconds: Sequence[float], inner_steps: int) -> tuple[int, ...]:
    """DyLU step counts: h_m = floor(H v_m / max v), v = 1 / step_seconds, at least 1.

    step_seconds: M positive finite floats. inner_steps: H >= 1. A ratio within 1e-9 below
    an integer counts as that integer (e.g. 3 x 0.1 / 0.3 is 3 steps, not 2).
    """
    seconds = checked_step_seconds(step_seconds)
    check_int("inner_steps", inner_steps, 1)
    speeds = [1.0 / s for s in seconds]
    fastest = max(speeds)
    return tuple(max(1, math.floor(inner_steps * v / fastest + 1e-9)) for v in speeds)


@dataclasses.dataclass(frozen=True)
class Job:
    """A job handed out: its serial, the updates applied before it (`start_update`), the
    worker's data position, its inner steps, and when it was handed out (`started`, the
    clock's seconds)."""

    serial: int
    start_update: int
    position: int
    steps: int
    started: float


class ArrivalRule:
    """The rule's state: each worker's job in hand and its last timed seconds per step.

    inner_steps: H >= 1. dynamic_steps: DyLU's counts instead of H."""

    def __init__(self, inner_steps: int, dynamic_steps: bool):
        self.inner_steps, self.dynamic_steps = inner_steps, dynamic_steps
        self.jobs: dict[int, Job] = {}
        self.times = StepTimes()

    def hand_out(self, worker: int, serial: int, updates: int, position: int, now: float) -> Job:
        """The worker's new job (it replaces any it held): number `serial`, after `updates`
        updates, at data `position`, handed out at `now`."""
        job = Job(
            serial=serial,
            start_update=updates,
            position=position,
            steps=self.steps(worker),
            started=now,
        )
        self.jobs[worker] = job
        return job

    def take(self, worker: int, serial: int) -> Job | None:
        """The worker's job in hand if it is job `serial` (and it no longer holds one), or
        None: a late delta."""
        job = self.jobs.get(worker)
        if job is None or job.serial != serial:
            return None
        del self.jobs[worker]
        return job

    def timed(self, worker: int, seconds_per_step: float) -> None:
        """One of the worker's jobs took `seconds_per_step` (> 0) per inner step."""
        self.times.add(worker, seconds_per_step)

    def steps(self, worker: int) -> int:
        """The inner steps of the worker's next job."""
        timed = self.times.timed()
        if not self.dynamic_steps or worker not in timed:
            return self.inner_steps
        speeds = [self.times[m] for m in timed]
        return dynamic_local_steps(speeds, self.inner_steps)[timed.index(worker)]

    def drop(self, worker: int) -> None:
        """The worker is gone: its job in hand is no longer wanted."""
        self.jobs.pop(worker, None)


def age(job: Job, updates: int) -> int:
    """The job's delta's age when it is applied after `updates` updates."""
    return updates - job.start_update


__all__ = ["ArrivalRule", "Job", "age", "checked_step_seconds", "dynamic_local_steps"]

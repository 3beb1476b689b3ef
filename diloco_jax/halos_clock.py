"""HALoS on `train_async`'s simulated clock: when each server event happens, written as the
`halos_replay.Record` a real run's syncers write. The clock orders events only (each
worker's step seconds, each hop's latency, the LPS's push rule `HALoS.push_due`); the
servers themselves run in `halos_replay.Replay`, the same code for a simulated run and a real
one.

The order is the authors' simulator's (github.com/utnslab/halos, commit 4b5bf73):

- worker m's job of h_m steps starts `worker_seconds` after its answer left the LPS and
  reaches the LPS `worker_seconds` after its last step;
- at one instant, messages between the servers go before the workers' arrivals, and
  arrivals in worker order, each answered before the next;
- an LPS whose push is due (`HALoS.push_due`) sends Δ_L as it answers the arrival that made
  it due; `region_seconds[r]` later the GPS applies it and answers with θ_G, which reaches
  the LPS another `region_seconds[r]` later; a message of a 0 s hop arrives as it is sent,
  after the answer to the worker whose arrival set it off;
- a push's age at the GPS: its updates since the θ_G the region last merged.
"""

import dataclasses
from typing import Any, NamedTuple

from diloco_jax.halos_replay import Arrival, GlobalPush, Record, RegionMerge


class Clocked(NamedTuple):
    """A simulated run of `num_updates` LPS updates: its `record`, `elapsed_seconds` (the last
    update's time; 0 without one) and `utilization` (the workers' busy share of that time).
    The record looks past the run: on to the arrival of every job still running at its end
    and the merge of every θ_G then on its way, which a checkpoint keeps the θ of."""

    record: Record
    elapsed_seconds: float
    utilization: float


@dataclasses.dataclass
class _Job:
    """A worker's job: it starts at `at` from its LPS's θ_L after `start` updates and
    `start_merges` merges (its data position `job`), and arrives at `arrives`."""

    at: float
    arrives: float
    start: int
    start_merges: int
    job: int


@dataclasses.dataclass
class _Region:
    """An LPS's counts: updates, the updates at its last merge, merges, pushes sent, the θ_G
    version it last merged, whether a push is in flight, and its message in flight (due,
    what, θ_G's version) or None."""

    version: int = 0
    merged: int = 0
    merges: int = 0
    pushes: int = 0
    seen: int = 0
    in_flight: bool = False
    message: tuple[float, str, int] | None = None


def simulate(spec: Any, step_seconds: tuple[float, ...], steps: tuple[int, ...],
             num_updates: int) -> Clocked:  # fmt: skip
    """The first `num_updates` LPS updates of `spec` (a `halos.HALoS`) with workers of
    `step_seconds` (M floats > 0) and jobs of `steps` inner steps (M ints >= 1), and every
    server event until the last of them (a push it sets off over a 0 s hop included)."""
    clock = _Clock(spec, step_seconds, steps)
    for _ in range(num_updates):
        clock.next_arrival()
    elapsed, utilization = clock.utilization()
    running = set(range(len(steps)))  # every worker has a job running at the end
    until = clock.time + 2 * max(spec.hop_seconds(r) for r in range(spec.num_regions))
    while running or clock.time < until:
        running.discard(clock.next_arrival())
    record = Record(tuple(clock.arrivals), tuple(clock.merges), tuple(clock.pushes))
    return Clocked(record, elapsed, utilization)


class _Clock:
    def __init__(self, spec: Any, step_seconds: tuple[float, ...], steps: tuple[int, ...]):
        self.spec, self.seconds, self.steps = spec, step_seconds, steps
        self.regions = [_Region() for _ in range(spec.num_regions)]
        self.gps_version, self.time, self.busy = 0, 0.0, 0.0
        self.jobs = [self._job(m, float(spec.worker_seconds), 0, 0, 0) for m in range(len(steps))]
        self.arrivals: list[Arrival] = []
        self.merges: list[RegionMerge] = []
        self.pushes: list[GlobalPush] = []

    def _job(self, m: int, at: float, start: int, start_merges: int, job: int) -> _Job:
        arrives = at + self.steps[m] * self.seconds[m] + self.spec.worker_seconds
        return _Job(at=at, arrives=arrives, start=start, start_merges=start_merges, job=job)

    def next_arrival(self) -> int:
        """Handles the server messages due before the next arrival, then that arrival: its
        worker."""
        while True:
            time, kind, who = min(
                [(job.arrives, 1, m) for m, job in enumerate(self.jobs)]
                + [(x.message[0], 0, r) for r, x in enumerate(self.regions) if x.message]
            )
            if kind == 1:
                break
            _, what, version = self.regions[who].message
            self.regions[who].message = None
            self._serve(time, who, what, version)
        self.time = time
        self._arrive(who, time)
        return who

    def _arrive(self, m: int, time: float) -> None:
        job, r = self.jobs[m], self.spec.regions[m]
        local = self.regions[r]
        self.arrivals.append(
            Arrival(
                region=r,
                worker=m,
                job=job.job,
                steps=self.steps[m],
                start=job.start,
                start_merges=job.start_merges,
                staleness=local.version - job.start,
                time=time,
            )
        )
        local.version += 1
        self.busy += self.steps[m] * self.seconds[m]
        # Its next job starts from θ_L of now, before a push this update sets off is handled.
        at = time + self.spec.worker_seconds
        self.jobs[m] = self._job(m, at, local.version, local.merges, job.job + 1)
        if self.spec.push_due(local.version, local.merged, local.in_flight):
            local.in_flight = True
            self._send(time, r, "push", 0)

    def _send(self, time: float, r: int, what: str, version: int) -> None:
        hop = self.spec.hop_seconds(r)
        if hop > 0:
            self.regions[r].message = (time + hop, what, version)
        else:
            self._serve(time, r, what, version)

    def _serve(self, time: float, r: int, what: str, version: int) -> None:
        local = self.regions[r]
        if what == "push":  # Δ_L reaches the GPS, which answers with θ_G
            self.pushes.append(GlobalPush(r, local.pushes, self.gps_version - local.seen, time))
            local.pushes += 1
            self.gps_version += 1
            self._send(time, r, "reply", self.gps_version)
        else:  # θ_G of `version` reaches the LPS
            self.merges.append(RegionMerge(r, local.version, version, time))
            local.merges += 1
            local.merged, local.in_flight, local.seen = local.version, False, version

    def utilization(self) -> tuple[float, float]:
        """(elapsed seconds, the workers' busy share of them) so far."""
        if not self.arrivals:
            return 0.0, 0.0
        elapsed = self.time
        running = sum(  # the jobs started and not arrived: busy so far
            max(0.0, min(job.at + n * s, elapsed) - job.at)
            for job, n, s in zip(self.jobs, self.steps, self.seconds, strict=True)
        )
        return elapsed, (self.busy + running) / (len(self.jobs) * elapsed)


__all__ = ["Clocked", "simulate"]

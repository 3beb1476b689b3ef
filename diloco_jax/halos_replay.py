"""A real HALoS run's record, and its replay by `train_async(server=dj.HALoS(...),
arrivals=record)`: what happened at each server, in place of the simulated clock.

A run on processes (`diloco_jax.halos_syncer`: a global syncer, a syncer per region, the
workers) writes three kinds of lines, read back as a `Record` by `elastic.arrivals`:

- `Arrival`: an LPS applied worker m's delta of job j (its data position), of `steps` inner
  steps, whose θ_L was the LPS's after `start` updates and `start_merges` merges;
- `RegionMerge`: an LPS merged θ_G of `version` GPS updates, after `after` updates of its own;
- `GlobalPush`: the GPS applied region r's `index`-th Δ_L with age `staleness`.

An LPS's pushes are its rule's, not recorded: after an update that makes its count K more than
at its last merge, with no push in flight, it sends Δ_L = snapshot - θ_L.

The replay applies each server's events in its own order, each once what it needs exists
(a merge waits for the GPS to reach its version, the GPS for the region's push), arrivals in
the order of their times. Only the causal order matters: each value is a function of the
events before it at its own server, so the replay is the real run's θ_G to rounding.
"""

import hashlib
import json
from collections import Counter, deque
from typing import Any, NamedTuple

import jax.numpy as jnp


class Arrival(NamedTuple):
    """An update of region `region`'s LPS: worker `worker`'s delta of job `job` (its data
    position), `steps` inner steps from θ_L after `start` updates and `start_merges` merges;
    `staleness`: the LPS's updates since then; `time`: seconds since the run began."""

    region: int
    worker: int
    job: int
    steps: int
    start: int
    start_merges: int
    staleness: int
    time: float


class RegionMerge(NamedTuple):
    """Region `region`'s LPS merged θ_G of `version` GPS updates after `after` updates."""

    region: int
    after: int
    version: int


class GlobalPush(NamedTuple):
    """The GPS applied region `region`'s push number `index` (from 0) with age `staleness`."""

    region: int
    index: int
    staleness: int


class Record(NamedTuple):
    """A real HALoS run's events: arrivals (each region's in its order, all by time), each
    region's merges (in its order) and the GPS's pushes (in its order)."""

    arrivals: tuple[Arrival, ...]
    merges: tuple[RegionMerge, ...]
    pushes: tuple[GlobalPush, ...]

    @property
    def digest(self) -> str:
        text = json.dumps([list(map(list, part)) for part in self])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def checked(record: Any, regions: tuple[int, ...], inner_steps: int, num_updates: int) -> Record:
    """`record` as a `Record`, checked against the run: ValueError naming the first event that
    can't be this run's."""
    try:
        record = Record(
            tuple(Arrival(*a) for a in record[0]),
            tuple(RegionMerge(*m) for m in record[1]),
            tuple(GlobalPush(*p) for p in record[2]),
        )
    except (TypeError, IndexError) as error:
        raise ValueError(
            f"arrivals must be a halos.Record (arrivals, merges, pushes), got {error}"
        ) from None
    if len(record.arrivals) != num_updates:
        raise ValueError(
            f"arrivals holds {len(record.arrivals)} LPS updates; num_updates = {num_updates}"
        )
    count, jobs = Counter(), {}
    for i, a in enumerate(record.arrivals):
        why = None
        if not 0 <= a.worker < len(regions) or regions[a.worker] != a.region:
            why = f"worker {a.worker} is not in region {a.region}"
        elif not 1 <= a.steps <= inner_steps:
            why = f"steps {a.steps} outside [1, {inner_steps}]"
        elif not 0 <= a.start <= count[a.region] or a.start_merges < 0:
            why = f"a job from update {a.start} of region {a.region}'s {count[a.region]}"
        elif a.job < jobs.get(a.worker, 0):
            why = f"job {a.job} after job {jobs[a.worker] - 1} of worker {a.worker}"
        if why is not None:
            raise ValueError(f"arrivals.arrivals[{i}] can't be replayed: {why}")
        count[a.region] += 1
        jobs[a.worker] = a.job + 1
    num_regions = max(regions) + 1
    for i, m in enumerate(record.merges):
        if not 0 <= m.region < num_regions or m.after < 0 or m.version < 1:
            raise ValueError(f"arrivals.merges[{i}] can't be replayed: {m!r}")
    for i, p in enumerate(record.pushes):
        if not 0 <= p.region < num_regions or p.index < 0 or p.staleness < 0:
            raise ValueError(f"arrivals.pushes[{i}] can't be replayed: {p!r}")
    return record


class _Region:
    """An LPS in the replay: its events still to apply (arrivals with their index in the
    record), its merges so far and the pushes it sent."""

    def __init__(self, server: Any, arrivals: list, merges: list):
        self.server, self.arrivals, self.merges = server, deque(arrivals), deque(merges)
        self.merge_count = 0
        self.pushes: list = []  # each Δ_L it sent, by index


class Replay:
    """The `diloco_jax.loop` job replaying a `Record` with a HALoS run's programs (`job`,
    `halos._Job`): one iteration applies the next arrival, after every merge and GPS update it
    waits on; the last one also applies what remains."""

    def __init__(self, job: Any, record: Record):
        self.job, self.events = job, record
        # The θ_L a job starts from, kept from the moment it exists until its arrival.
        self.wanted = Counter((a.region, a.start, a.start_merges) for a in record.arrivals)
        self.wanted_global = Counter(m.version for m in record.merges)

    def evaluate(self, state: Any, done: int) -> Any:
        return self.job.evaluate(state, done)

    def record(self, i: int, item: Any, metrics: Any, evals: Any) -> dict:
        return self.job.record(i, item, metrics, evals)

    def initial(self) -> Any:
        state = self.job.initial()
        spec = self.job.spec
        state.regions = [
            _Region(state.lps[r], [(i, a) for i, a in enumerate(self.events.arrivals)
                                   if a.region == r],
                    [m for m in self.events.merges if m.region == r])
            for r in range(spec.num_regions)
        ]  # fmt: skip
        state.gps_queue = deque(self.events.pushes)
        state.kept = {}
        state.kept_global = {}
        for r in range(spec.num_regions):
            self._keep(state, r)
        self._keep_global(state)
        return state

    def items(self, start: int) -> range:
        return range(start, self.job.run.num_updates)

    def step(self, state: Any, update: int) -> tuple[Any, Any]:
        self._settle(state)
        ready = [r for r in state.regions if r.arrivals and not self._merge_due(r)]
        if not ready:
            raise ValueError(f"the record can't be replayed: update {update} waits on itself")
        region = min(ready, key=lambda r: r.arrivals[0][0])  # the record's order where it can
        _, arrival = region.arrivals.popleft()
        out = self._arrive(state, update, region, arrival)
        if update + 1 == self.job.run.num_updates:
            self._settle(state)
        return state, out

    def savable(self, state: Any) -> Any:
        raise ValueError("a replay of a real HALoS run saves no checkpoints")

    # ---- events ----------------------------------------------------------------------

    def _settle(self, state: Any) -> None:
        """Applies every merge and GPS update whose inputs exist, until none is left."""
        while True:
            moved = False
            for r, region in enumerate(state.regions):
                while self._merge_due(region) and region.merges[0].version in state.kept_global:
                    self._merge(state, r, region, region.merges.popleft())
                    moved = True
            queue = state.gps_queue
            while queue and queue[0].index < len(state.regions[queue[0].region].pushes):
                self._apply_global(state, queue.popleft())
                moved = True
            if not moved:
                return

    def _merge_due(self, region: _Region) -> bool:
        return bool(region.merges) and region.merges[0].after == region.server.version

    def _arrive(self, state: Any, update: int, region: _Region, a: Arrival) -> Any:
        job = self.job
        r, m = a.region, a.worker
        start = state.kept.get((r, a.start, a.start_merges))
        if start is None:  # its region was never there: merges out of the run's order
            raise ValueError(
                f"the record can't be replayed: update {update}'s job starts from region {r}'s "
                f"θ_L after {a.start} updates and {a.start_merges} merges, which it never had"
            )
        self.wanted[(r, a.start, a.start_merges)] -= 1
        if not self.wanted[(r, a.start, a.start_merges)]:
            del state.kept[(r, a.start, a.start_merges)]
        from diloco_jax.async_train import AsyncEvent

        e = AsyncEvent(update, m, a.job, a.steps, 0.0, a.time, a.start, a.staleness)
        delta, state.inner_states[m], means = job.run_job(
            job.where.to_worker(start, m), state.inner_states[m], job.job_data(e),
            jnp.int32(a.job), jnp.int32(m), num_steps=a.steps,
        )  # fmt: skip
        job.update_local(state, m, delta, a.staleness, a.steps)
        state.time = max(state.time, a.time)
        job.push_if_due(state, r, region.pushes.append)
        self._keep(state, r)
        return job.entry(state, update, a.time, m, a.steps, a.staleness), means

    def _merge(self, state: Any, r: int, region: _Region, merge: RegionMerge) -> None:
        self.job.merge_into(region.server, state.kept_global[merge.version], merge.version)
        region.merge_count += 1
        self.wanted_global[merge.version] -= 1
        if not self.wanted_global[merge.version]:
            del state.kept_global[merge.version]
        self._keep(state, r)

    def _apply_global(self, state: Any, push: GlobalPush) -> None:
        gps = state.gps
        delta = state.regions[push.region].pushes[push.index]
        gps.theta, gps.state = self.job.apply_global(
            gps.theta, gps.state, delta, jnp.int32(push.staleness)
        )
        gps.version += 1
        self._keep_global(state)

    def _keep(self, state: Any, r: int) -> None:
        region = state.regions[r]
        key = (r, region.server.version, region.merge_count)
        if self.wanted[key]:
            state.kept[key] = region.server.theta

    def _keep_global(self, state: Any) -> None:
        if self.wanted_global[state.gps.version]:
            state.kept_global[state.gps.version] = state.gps.theta

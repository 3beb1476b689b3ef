"""A HALoS run's record of events, and the loop job that runs HALoS's servers through one:
a real run's record (`train_async(server=dj.HALoS(...), arrivals=record)`) or the simulated
clock's (`halos_clock`, every `train_async(server=dj.HALoS(...))` without arrivals).

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
the record's order. Only the causal order matters for θ: each value is a function of the
events before it at its own server, so the replay is the real run's θ_G to rounding. The
simulated clock's merges and GPS updates also carry their times, which the replay keeps
(none happens before an arrival that came first), so each update's history line and
evaluation see the GPS as the clock had it.
"""

import dataclasses
import hashlib
import json
from collections import Counter
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax.outer import worker_delta


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
    """Region `region`'s LPS merged θ_G of `version` GPS updates after `after` updates; at
    `time` on the simulated clock (None in a real run's record: it merges as soon as it can)."""

    region: int
    after: int
    version: int
    time: float | None = None


class GlobalPush(NamedTuple):
    """The GPS applied region `region`'s push number `index` (from 0) with age `staleness`;
    at `time` on the simulated clock (None in a real run's record)."""

    region: int
    index: int
    staleness: int
    time: float | None = None


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


@dataclasses.dataclass
class Progress:
    """The replay's state between two LPS updates: the servers (`halos._State`), each
    region's merges applied and pushes sent, the pushes the GPS has not applied yet (Δ_L by
    (region, index)), and the θ still wanted: θ_L by (region, updates, merges) for jobs still
    to arrive, θ_G by version for merges still to come."""

    servers: Any
    merge_counts: list[int]
    push_counts: list[int]
    pushed: dict[tuple[int, int], Any]
    kept: dict[tuple[int, int, int], Any]
    kept_global: dict[int, Any]


class Replay:
    """The `diloco_jax.loop` job running a `Record` with a HALoS run's programs (`job`,
    `halos.Servers`): one iteration applies the next arrival, after every merge and GPS
    update it waits on. A simulated record's times order the servers' events as its clock
    did (each happens once the arrivals before it in time have); a real record's merges and
    pushes (no times) happen as soon as their inputs exist. Checkpoints resume bit for bit."""

    def __init__(self, job: Any, record: Record):
        self.job, self.events = job, record
        regions = range(job.spec.num_regions)
        self.arrivals = [[(i, a) for i, a in enumerate(record.arrivals) if a.region == r]
                         for r in regions]  # fmt: skip
        self.merges = [[m for m in record.merges if m.region == r] for r in regions]
        self.wanted: Counter = Counter()
        self.wanted_global: Counter = Counter()

    def evaluate(self, state: Progress, done: int) -> Any:
        return self.job.evaluate(state.servers, done)

    def record(self, i: int, item: Any, metrics: Any, evals: Any) -> dict:
        return self.job.record(i, item, metrics, evals)

    def initial(self) -> Progress:
        regions = self.job.spec.num_regions
        state = Progress(
            servers=self.job.initial(),
            merge_counts=[0] * regions,
            push_counts=[0] * regions,
            pushed={},
            kept={},
            kept_global={},
        )
        self._count_wanted(state)
        for r in range(regions):
            self._keep(state, r)
        self._keep_global(state)
        return state

    def items(self, start: int) -> range:
        return range(start, self.job.run.num_updates)

    def step(self, state: Progress, update: int) -> tuple[Progress, Any]:
        heads = {r: self._next_arrival(state, r) for r in range(len(self.arrivals))}
        heads = {r: head for r, head in heads.items() if head is not None}
        self._settle(state, until=min(heads.values())[1].time)  # what comes before it
        ready = [r for r in heads if not self._merge_due(state, r)]
        if not ready:
            raise ValueError(f"the record can't be replayed: update {update} waits on itself")
        r = min(ready, key=lambda r: heads[r][0])  # the record's order where it can
        a = heads[r][1]
        means = self._arrive(state, update, r, a)
        self._settle(state, until=a.time)  # what it set off over a 0 s hop
        return state, (self.job.entry(state.servers, update, a.time, a.worker, a.steps,
                                      a.staleness), means)  # fmt: skip

    # ---- checkpoints ----------------------------------------------------------------------

    def savable(self, state: Progress) -> dict:
        """The state as a dict of arrays; the θ still wanted and the pushes in flight under
        keys of their own, so its layout varies with the run (`restore_target`)."""
        saved = self.job.savable(state.servers)
        saved["progress"] = np.asarray([*state.merge_counts, *state.push_counts], np.int64)
        for (r, updates, merges), theta in state.kept.items():
            saved[f"kept-{r}-{updates}-{merges}"] = theta
        for version, theta in state.kept_global.items():
            saved[f"global-{version}"] = theta
        for (r, index), delta in state.pushed.items():
            saved[f"pushed-{r}-{index}"] = delta
        return saved

    def restore_target(self, state: Progress) -> Any:
        """The target of a checkpoint as it was saved: the servers like `state`'s, each θ
        like θ_G (where the run keeps it), each Δ_L in the delta dtype."""
        fixed = self.savable(state)
        theta = state.servers.gps.theta
        delta = jax.eval_shape(worker_delta, theta, theta)

        def on(like: Any, shaped: Any) -> Any:
            return jax.tree.map(
                lambda x, y: jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=x.sharding),
                like, shaped,
            )  # fmt: skip

        def target(saved_tree: Any) -> dict:
            out = {name: value for name, value in fixed.items() if "-" not in name}
            for name in saved_tree.keys():
                if name.startswith(("kept-", "global-")):
                    out[name] = on(theta, theta)
                elif name.startswith("pushed-"):
                    out[name] = on(theta, delta)
            return out

        return target

    def restored(self, saved: dict, done: int) -> Progress:
        regions = self.job.spec.num_regions
        counts = [int(x) for x in saved["progress"]]
        state = Progress(
            servers=self.job.restored(saved, done),
            merge_counts=counts[:regions],
            push_counts=counts[regions:],
            pushed={},
            kept={},
            kept_global={},
        )
        for name, value in saved.items():
            kind, *keys = name.split("-")
            if kind == "kept":
                state.kept[tuple(int(k) for k in keys)] = value
            elif kind == "global":
                state.kept_global[int(keys[0])] = value
            elif kind == "pushed":
                state.pushed[(int(keys[0]), int(keys[1]))] = value
        self._count_wanted(state)
        return state

    # ---- events ----------------------------------------------------------------------

    def _count_wanted(self, state: Progress) -> None:
        """Which θ_L and θ_G the events still to come start from or merge."""
        lps = state.servers.lps
        self.wanted = Counter(
            (a.region, a.start, a.start_merges)
            for r, arrivals in enumerate(self.arrivals)
            for _, a in arrivals[lps[r].version :]
        )
        self.wanted_global = Counter(
            m.version
            for r, merges in enumerate(self.merges)
            for m in merges[state.merge_counts[r] :]
        )

    def _next_arrival(self, state: Progress, r: int) -> tuple[int, Arrival] | None:
        arrivals, done = self.arrivals[r], state.servers.lps[r].version
        return arrivals[done] if done < len(arrivals) else None

    def _next_merge(self, state: Progress, r: int) -> RegionMerge | None:
        merges, done = self.merges[r], state.merge_counts[r]
        return merges[done] if done < len(merges) else None

    def _merge_due(self, state: Progress, r: int) -> bool:
        merge = self._next_merge(state, r)
        return merge is not None and merge.after == state.servers.lps[r].version

    def _settle(self, state: Progress, until: float) -> None:
        """Applies every merge and GPS update whose inputs exist and whose time (if any) is
        at most `until`, until none is left."""
        pushes = self.events.pushes
        while True:
            moved = False
            for r in range(len(self.merges)):
                while self._merge_due(state, r):
                    merge = self._next_merge(state, r)
                    if merge.version not in state.kept_global or not _by(merge, until):
                        break
                    self._merge(state, r, merge)
                    moved = True
            while state.servers.gps.version < len(pushes):
                push = pushes[state.servers.gps.version]
                if (push.region, push.index) not in state.pushed or not _by(push, until):
                    break
                self._apply_global(state, push)
                moved = True
            if not moved:
                return

    def _arrive(self, state: Progress, update: int, r: int, a: Arrival) -> Any:
        """Applies arrival `a` at LPS r (and its push, if due): its job's (loss, aux)."""
        job, servers, m = self.job, state.servers, a.worker
        key = (r, a.start, a.start_merges)
        start = state.kept.get(key)
        if start is None:  # its region was never there: merges out of the run's order
            raise ValueError(
                f"the record can't be replayed: update {update}'s job starts from region {r}'s "
                f"θ_L after {a.start} updates and {a.start_merges} merges, which it never had"
            )
        self.wanted[key] -= 1
        if not self.wanted[key]:
            del state.kept[key]
        from diloco_jax.async_train import AsyncEvent

        e = AsyncEvent(
            update=update,
            worker=m,
            job=a.job,
            steps=a.steps,
            start=0.0,
            time=a.time,
            start_update=a.start,
            staleness=a.staleness,
        )
        delta, servers.inner_states[m], means = job.run_job(
            job.where.to_worker(start, m), servers.inner_states[m], job.job_data(e),
            jnp.int32(a.job), jnp.int32(m), num_steps=a.steps,
        )  # fmt: skip
        job.update_local(servers, m, delta, a.staleness, a.steps)
        servers.time = max(servers.time, a.time)

        def send(delta_l: Any) -> None:
            state.pushed[(r, state.push_counts[r])] = delta_l
            state.push_counts[r] += 1

        job.push_if_due(servers, r, send)
        self._keep(state, r)
        return means

    def _merge(self, state: Progress, r: int, merge: RegionMerge) -> None:
        self.job.merge_into(state.servers.lps[r], state.kept_global[merge.version])
        state.merge_counts[r] += 1
        self.wanted_global[merge.version] -= 1
        if not self.wanted_global[merge.version]:
            del state.kept_global[merge.version]
        self._keep(state, r)

    def _apply_global(self, state: Progress, push: GlobalPush) -> None:
        gps = state.servers.gps
        delta = state.pushed.pop((push.region, push.index))
        gps.theta, gps.state = self.job.apply_global(
            gps.theta, gps.state, delta, jnp.int32(push.staleness)
        )
        gps.version += 1
        self._keep_global(state)

    def _keep(self, state: Progress, r: int) -> None:
        local = state.servers.lps[r]
        key = (r, local.version, state.merge_counts[r])
        if self.wanted[key]:
            state.kept[key] = local.theta

    def _keep_global(self, state: Progress) -> None:
        gps = state.servers.gps
        if self.wanted_global[gps.version]:
            state.kept_global[gps.version] = gps.theta


def _by(event: Any, until: float) -> bool:
    """Whether a merge or GPS update may happen by `until`: a real record's always."""
    return event.time is None or event.time <= until

"""HALoS (Kim et al., ICML 2025, arXiv 2506.04531): a local parameter server (LPS) per region
under a global one (GPS), as the `server=` part of `train_async`.

- worker m (in region r) runs a job of h_m inner steps (H, or DyLU's counts) from the θ_L its
  LPS sent it, then sends θ_start - θ_m; it reaches the LPS `worker_seconds` later;
- the LPS applies each arriving delta at once with the local outer rule (`train_async`'s
  `outer_optimizer`; its age: the LPS's updates since the job started) and answers the
  worker at once with its θ_L of that moment (before a push the delta set off), which
  reaches it `worker_seconds` later and starts its next job;
- when the LPS has applied `local_updates` (K) deltas since it last merged, and none of its
  pushes is in flight, it sends Δ_L = snapshot - θ_L (its change since its last merge);
  `region_seconds[r]` later the GPS applies Δ_L with `global_optimizer` (its age: the GPS's
  updates since the θ_G that LPS last merged) and sends θ_G back; another
  `region_seconds[r]` later the LPS merges θ_L ← (1 - α) θ_L + α θ_G (α = `merge_weight`),
  takes θ_L as its snapshot, and keeps its outer state.

One implementation on both clocks: `Servers` holds the programs and rules (a job, an LPS
update and its push rule `HALoS.push_due`, the GPS update, the merge), and
`halos_replay.Replay` drives them through a record of events: the simulated clock's
(`halos_clock`, the authors' simulator's order at one instant) or a real run's (its
syncers' history, `elastic.arrivals`). The real syncers (`halos_syncer`) run the same rule.

θ_G is the model: evaluated, and returned as the params. One region, K = 1, α = 1, no
latency and a global SGD(1.0) make θ_G follow θ_L exactly (to rounding): asynchronous DiLoCo
with the local rule as its server's, where no two workers arrive at the same instant
(`train_async` restarts workers that arrive together from the θ after all of them).
"""

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_jax.checks import check_int, check_number, checked_optimizer
from diloco_jax.comm import round_bytes
from diloco_jax.delayed_nesterov_outer import delayed_nesterov
from diloco_jax.outer import outer_init, outer_update, widen, worker_delta


def default_global_optimizer() -> optax.GradientTransformation:
    """The authors' global rule: Delayed Nesterov, lr 0.15 x 2, momentum 0.5, every 2 pushes."""
    return delayed_nesterov(0.3, 0.5, buffer_size=2)


@dataclasses.dataclass(frozen=True)
class HALoS:
    """The `server=` part of `train_async` for HALoS (see the module docstring).

    regions: the region of each worker (M ints covering 0..R-1). local_updates: K >= 1 local
    updates between an LPS's pushes. merge_weight: α in [0, 1], the GPS's share when an LPS
    merges (the authors' runs use 0.25). global_optimizer: the GPS's outer rule (default
    `default_global_optimizer()`). worker_seconds: one-way worker <-> LPS latency >= 0.
    region_seconds: one-way LPS <-> GPS latency >= 0, one number or one per region."""

    regions: tuple[int, ...]
    local_updates: int = 32
    merge_weight: float = 0.25
    global_optimizer: Any = None
    worker_seconds: float = 0.0
    region_seconds: Any = 0.0

    # Each worker's jobs run on its slice of a user's mesh (`train_async(mesh=...)`).
    takes_mesh: ClassVar[bool] = True

    def __post_init__(self):
        regions = self.regions
        if (
            not isinstance(regions, tuple)
            or not regions
            or not all(isinstance(r, int) and not isinstance(r, bool) for r in regions)
            or sorted(set(regions)) != list(range(max(regions) + 1))
        ):
            raise ValueError(
                f"HALoS.regions must be a tuple of ints, one per worker, covering 0..R-1, got "
                f"{regions!r}"
            )
        check_int("HALoS.local_updates", self.local_updates, 1)
        check_number("HALoS.merge_weight", self.merge_weight, lambda a: 0 <= a <= 1, "in [0, 1]")
        if self.global_optimizer is not None:
            checked_optimizer("HALoS.global_optimizer", self.global_optimizer, None)
        _check_latency("HALoS.worker_seconds", self.worker_seconds)
        hops = self.region_seconds
        if isinstance(hops, tuple):
            if len(hops) != self.num_regions:
                raise ValueError(
                    f"HALoS.region_seconds must be one number or {self.num_regions} (one per "
                    f"region), got {len(hops)}"
                )
            for hop in hops:
                _check_latency("HALoS.region_seconds", hop)
        else:
            _check_latency("HALoS.region_seconds", hops)

    @property
    def num_regions(self) -> int:
        return max(self.regions) + 1

    def hop_seconds(self, region: int) -> float:
        hops = self.region_seconds
        return float(hops[region] if isinstance(hops, tuple) else hops)

    def push_due(self, updates: int, merged: int, in_flight: bool) -> bool:
        """Whether an LPS sends Δ_L now: after `updates` of its updates, `merged` of them
        before its last merge, with no push of it in flight."""
        return not in_flight and updates == merged + self.local_updates

    @property
    def smallest_region(self) -> int:
        """The workers of the smallest region."""
        return min(self.regions.count(r) for r in range(self.num_regions))

    @property
    def simulates_latency(self) -> bool:
        """Whether it sets a hop's latency (the simulated clock's; on processes the hops are
        the network's)."""
        hops = self.region_seconds
        return bool(self.worker_seconds) or any(hops if isinstance(hops, tuple) else (hops,))

    def checked(self, num_workers: int, inner_steps: int = 1, params: Any = None) -> None:
        """ValueError naming the field that doesn't fit the run (M: one region each)."""
        if len(self.regions) != num_workers:
            raise ValueError(
                f"HALoS.regions must hold num_workers = {num_workers} regions, got "
                f"{len(self.regions)}"
            )

    def checkpoint_fields(self) -> dict:
        """What a checkpoint's fingerprint records of this part (train_async resumes only the
        same run); the global rule is the caller's to keep (a function has no stable text)."""
        return {"regions": list(self.regions), "local_updates": self.local_updates,
                "merge_weight": self.merge_weight, "worker_seconds": self.worker_seconds,
                "region_seconds": self.region_seconds if not isinstance(self.region_seconds, tuple)
                else list(self.region_seconds)}  # fmt: skip

    def arrivals(self, step_seconds, steps, count: int) -> tuple[tuple[float, int], ...]:
        """The first `count` (time, worker) arrivals the LPSs apply, in order, for jobs of
        `steps` (one count per worker): they depend on the step times and the worker hop
        only (a worker restarts `worker_seconds` after its arrival, whatever the servers
        do), so they are known before training, e.g. to size a run."""
        hop = float(self.worker_seconds)
        ends = [
            (hop + k * (n * s + 2 * hop) + n * s + hop, m)
            for m, (s, n) in enumerate(zip(step_seconds, steps, strict=True))
            for k in range(count)
        ]
        return tuple(sorted(ends)[:count])

    def recorded(self, arrivals: Any, num_workers: int, inner_steps: int, num_updates: int) -> Any:
        """A real run's `halos_replay.Record` (`elastic.arrivals` of its global syncer's
        folder), checked against this spec and the run: what `train_async(server=self,
        arrivals=...)` replays in place of the simulated clock (num_updates: its LPS
        updates, all of them). ValueError naming the event that can't be this run's."""
        from diloco_jax import halos_replay

        self.checked(num_workers)
        return halos_replay.checked(arrivals, self.regions, inner_steps, num_updates)

    def train(self, run: Any) -> Any:
        return _train(self, run)


def _check_latency(name: str, value: Any) -> None:
    check_number(name, value, lambda x: x >= 0, ">= 0")


def _train(spec: HALoS, run: Any) -> Any:
    """`train_async` with this server (see the module docstring): the servers
    (`halos_replay.Replay`) run the events of the simulated clock (`halos_clock`) or of a
    real run's record, in the loop of `diloco_jax.loop`, checkpointed with
    `run.checkpoints`."""
    from diloco_jax import async_train
    from diloco_jax.halos_clock import simulate
    from diloco_jax.halos_replay import Replay
    from diloco_jax.loop import Loop

    spec.checked(run.num_workers)
    servers = Servers.of(spec, run)
    if run.recorded is None:
        steps = (
            async_train.dynamic_local_steps(run.step_seconds, run.inner_steps)
            if run.dynamic_steps
            else (run.inner_steps,) * run.num_workers
        )
        clocked = simulate(spec, run.step_seconds, steps, run.num_updates)
        record = clocked.record
    else:  # a real run's record in place of the clock
        clocked, record = None, run.recorded
    job = Replay(servers, record)
    loop = Loop(run.num_updates, run.checkpoints, run.callback, unit="updates",
                total_name="num_updates")  # fmt: skip
    state, history = loop.run(job, job.initial())
    servers_now = state.servers
    if clocked is not None:
        elapsed, utilization = clocked.elapsed_seconds, clocked.utilization
    else:
        elapsed, utilization = (servers_now.time if history else 0.0), 0.0
    outer = {"global": servers_now.gps.state, "local": tuple(s.state for s in servers_now.lps)}
    stacked = run.where.stack(servers_now.inner_states)
    result_state = async_train.AsyncState(servers_now.gps.theta, outer, stacked, run.num_updates)
    theta, result_state = run.where.results((servers_now.gps.theta, result_state))
    return async_train.AsyncResult(
        params=theta,
        state=result_state,
        history=history,
        elapsed_seconds=elapsed,
        utilization=utilization,
    )


@dataclasses.dataclass
class _State:
    """The servers between two LPS updates: the GPS and each LPS, each worker's inner state,
    the clock of the newest arrival, and the counts an update's history line reads."""

    gps: Any
    lps: list
    inner_states: list
    time: float = 0.0
    total_steps: int = 0
    sent: list = dataclasses.field(default_factory=list)
    region_sent: list = dataclasses.field(default_factory=list)
    last_steps: int = 0


@dataclasses.dataclass
class Servers:
    """HALoS's servers as programs and rules: a worker's job, an LPS update and its push
    rule, the GPS update, the merge, an update's history line and evaluation. The loop's job
    that drives them is `halos_replay.Replay`, on either clock."""

    spec: HALoS
    run: Any
    where: Any
    run_job: Any
    apply_local: Any
    apply_global: Any
    merge: Any
    job_data: Any
    evaluate_fn: Any
    per_model: int
    per_device: int | None  # on a mesh: one device's shard of a delta, in bytes

    @classmethod
    def of(cls, spec: HALoS, run: Any) -> "Servers":
        from diloco_jax import async_train
        from diloco_jax.async_placement import OnMesh

        global_rule = spec.global_optimizer or default_global_optimizer()
        where = run.where
        # On a mesh a job runs on its worker's slice, traced with that slice's axes.
        job_mesh = where.meshes[0].abstract_mesh if isinstance(where, OnMesh) else None
        run_job, apply_local = async_train._programs(
            run.loss_fn,
            run.inner_optimizer,
            run.outer_optimizer,
            run.has_aux,
            run.rng_seed,
            job_mesh,
        )
        job_data = async_train._job_data(run.data, run.num_workers, run.inner_steps, (), where)
        # A worker's delta, as train_async's one server counts it (and each device's shard).
        shards = where.shards(run.params)  # None on one device
        return cls(
            spec=spec,
            run=run,
            where=where,
            run_job=run_job,
            apply_local=apply_local,
            apply_global=jax.jit(lambda p, st, d, age: outer_update(global_rule, p, st, d, age)),
            merge=jax.jit(merge),
            job_data=job_data,
            evaluate_fn=jax.jit(run.eval_fn) if run.eval_fn is not None else None,
            per_model=round_bytes(run.params),
            per_device=None if shards is None else round_bytes(shards),
        )

    def initial(self) -> _State:
        run, where = self.run, self.where
        rule = self.spec.global_optimizer or default_global_optimizer()
        theta = where.shared(jax.tree.map(lambda x: jnp.array(x, copy=True), run.params))
        lps = [
            _Server(theta, where.shared(outer_init(run.outer_optimizer, theta)))
            for _ in range(self.spec.num_regions)
        ]
        return _State(
            _Server(theta, where.shared(outer_init(rule, theta))), lps,
            where.inner_states(run.inner_optimizer.init, theta, run.num_workers),
            sent=[0] * run.num_workers, region_sent=[0] * self.spec.num_regions,
        )  # fmt: skip

    def update_local(self, state: _State, m: int, delta: Any, staleness: int, steps: int) -> None:
        """Worker m's delta of `steps` inner steps applied at its LPS with its age."""
        local = state.lps[self.spec.regions[m]]
        local.theta, local.state = self.apply_local(
            local.theta, local.state, self.where.arrived(delta), jnp.int32(staleness)
        )
        local.version += 1
        state.total_steps += steps
        state.last_steps = steps
        state.sent[m] += self.per_model

    def push_if_due(self, state: _State, r: int, send: Any) -> None:
        """LPS r's Δ_L to `send` if a push is due (`HALoS.push_due`)."""
        local = state.lps[r]
        if self.spec.push_due(local.version, local.merged, local.in_flight):
            local.in_flight = True
            state.region_sent[r] += self.per_model
            send(worker_delta(local.snapshot, local.theta))

    def entry(
        self, state: _State, update: int, time: float, m: int, steps: int, staleness: int
    ) -> dict:
        """The history entry of LPS update `update` (worker m's)."""
        sent = round(sum(state.sent) / len(state.sent))
        entry = {"update": update, "time": time, "worker": m, "region": self.spec.regions[m],
                 "steps": steps, "total_steps": state.total_steps, "staleness": staleness,
                 "global_updates": state.gps.version, "bytes_communicated": sent,
                 "wire_bytes": sent, "worker_bytes": list(state.sent),
                 "region_bytes": list(state.region_sent)}  # fmt: skip
        if self.per_device is not None:  # on a mesh: each of its devices sends its shard
            entry["wire_bytes_per_device"] = round((update + 1) * self.per_device / len(state.sent))
        return entry

    def merge_into(self, local: "_Server", theta_g: Any) -> None:
        """θ_G merged into an LPS, its new snapshot."""
        local.theta = self.merge(local.theta, theta_g, self.spec.merge_weight)
        local.snapshot, local.merged, local.in_flight = local.theta, local.version, False

    def evaluate(self, state: _State, done: int) -> Any:
        # As train_async: every eval_every inner steps per worker, and after the last update.
        from diloco_jax.async_train import eval_due

        if self.evaluate_fn is None:
            return None
        every = self.run.num_workers * self.run.eval_every
        now = state.total_steps
        due = eval_due(now - state.last_steps, now, every) or done == self.run.num_updates
        return self.evaluate_fn(state.gps.theta) if due else None

    def record(self, i: int, item: int, metrics: Any, evals: Any) -> dict:
        from diloco_jax.async_train import joined

        entry, means = metrics
        loss, aux = jax.device_get(means)
        return joined({**entry, "loss": float(loss)}, aux, evals)

    def savable(self, state: _State) -> dict:
        """The servers as a dict of arrays (the replay adds its own)."""
        return {
            "gps": _saved_server(state.gps),
            "lps": [_saved_server(s) for s in state.lps],
            "inner": list(state.inner_states),
            "clock": np.asarray([state.time], np.float64),
            "counts": np.asarray([state.total_steps, state.last_steps], np.int64),
            "sent": np.asarray(state.sent, np.int64),
            "region_sent": np.asarray(state.region_sent, np.int64),
        }

    def restored(self, saved: dict, done: int) -> _State:
        total_steps, last_steps = (int(x) for x in saved["counts"])
        return _State(
            gps=_restored_server(saved["gps"]),
            lps=[_restored_server(s) for s in saved["lps"]],
            inner_states=list(saved["inner"]),
            time=float(saved["clock"][0]),
            total_steps=total_steps,
            sent=[int(x) for x in saved["sent"]],
            region_sent=[int(x) for x in saved["region_sent"]],
            last_steps=last_steps,
        )


def _saved_server(server: "_Server") -> dict:
    return {"theta": server.theta, "state": server.state, "snapshot": server.snapshot,
            "counts": np.asarray([server.version, server.merged, server.in_flight],
                                 np.int64)}  # fmt: skip


def _restored_server(saved: dict) -> "_Server":
    version, merged, in_flight = (int(x) for x in saved["counts"])
    return _Server(
        theta=saved["theta"],
        state=saved["state"],
        version=version,
        snapshot=saved["snapshot"],
        merged=merged,
        in_flight=bool(in_flight),
    )


@dataclasses.dataclass
class _Server:
    """A parameter server: θ and its outer state, its updates so far (`version`); an LPS also
    keeps its snapshot at its last merge (θ until then), the version then (`merged`), and
    whether a push is in flight. (A push's age at the GPS is the record's.)"""

    theta: Any
    state: Any
    version: int = 0
    snapshot: Any = None
    merged: int = 0
    in_flight: bool = False

    def __post_init__(self):
        if self.snapshot is None:
            self.snapshot = self.theta


def merge(local: Any, global_: Any, alpha: Any) -> Any:
    """(1 - α) θ_L + α θ_G, in the delta dtype, cast back to each param's dtype."""
    return jax.tree.map(
        lambda lo, gl: ((1 - alpha) * widen(lo) + alpha * widen(gl)).astype(jnp.result_type(lo)),
        local,
        global_,
    )

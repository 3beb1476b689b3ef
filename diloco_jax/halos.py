"""HALoS (Kim et al., ICML 2025, arXiv 2506.04531): a local parameter server (LPS) per region
under a global one (GPS), as the `server=` part of `train_async`.

On `train_async`'s simulated clock, following the update order of the authors' simulator
(github.com/utnslab/halos, commit 4b5bf73):

- worker m (in region r) runs a job of h_m inner steps (H, or DyLU's counts) from the θ_L its
  LPS sent it, then sends θ_start - θ_m; it reaches the LPS `worker_seconds` later;
- the LPS applies each arriving delta at once with the local outer rule (`train_async`'s
  `outer_optimizer`; its age: the LPS's updates since the job started) and answers the
  worker at once with its θ_L of that moment (before a push the delta set off), which
  reaches it `worker_seconds` later and starts its next job;
- when the LPS has applied `local_updates` (K) deltas since it last merged, and none of its
  pushes is in flight, it sends Δ_L = snapshot - θ_L (its change since its last merge);
  `region_seconds[r]` later the GPS applies Δ_L with `global_optimizer` and sends θ_G back;
  another `region_seconds[r]` later the LPS merges θ_L ← (1 - α) θ_L + α θ_G (α =
  `merge_weight`), takes θ_L as its snapshot, and keeps its outer state;
- at one instant, messages between the servers are handled before the workers' arrivals,
  and arrivals in worker order (the authors break ties by worker index), each answered
  before the next; a message between the servers with no latency (a hop of 0 s) is
  handled as soon as it is sent, after the answer to the worker whose delta set it off, so a
  hop of 0 is the limit of ever shorter hops.

θ_G is the model: evaluated, and returned as the params. One region, K = 1, α = 1, no
latency and a global SGD(1.0) make θ_G follow θ_L exactly (to rounding): asynchronous DiLoCo
with the local rule as its server's, where no two workers arrive at the same instant
(`train_async` restarts workers that arrive together from the θ after all of them).
"""

import dataclasses
import heapq
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_jax.checks import check_int, check_number, checked_optimizer
from diloco_jax.delayed_nesterov import delayed_nesterov
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

    def checked(self, num_workers: int, inner_steps: int = 1, params: Any = None) -> None:
        """ValueError naming the field that doesn't fit the run (M: one region each)."""
        if len(self.regions) != num_workers:
            raise ValueError(
                f"HALoS.regions must hold num_workers = {num_workers} regions, got "
                f"{len(self.regions)}"
            )

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

    def train(self, run: Any) -> Any:
        return _train(self, run)


def _check_latency(name: str, value: Any) -> None:
    check_number(name, value, lambda x: x >= 0, ">= 0")


# Kinds of events, in the order they are handled at one instant.
_SERVERS, _ARRIVAL = 0, 1


def _train(spec: HALoS, run: Any) -> Any:
    from diloco_jax import async_train
    from diloco_jax.async_placement import OneDevice

    m_count = run.num_workers
    spec.checked(m_count)
    seconds = run.step_seconds
    steps = (
        async_train.dynamic_local_steps(seconds, run.inner_steps)
        if run.dynamic_steps
        else (run.inner_steps,) * m_count
    )
    global_rule = spec.global_optimizer or default_global_optimizer()
    where = OneDevice(run.device)
    run_job, apply_local = async_train._programs(
        run.loss_fn, run.inner_optimizer, run.outer_optimizer, run.has_aux, run.rng_seed
    )
    apply_global = jax.jit(lambda p, s, d, age: outer_update(global_rule, p, s, d, age))
    merge = jax.jit(_merge)
    job_data = async_train._job_data(run.data, m_count, run.inner_steps, (), where)
    evaluate = jax.jit(run.eval_fn) if run.eval_fn is not None else None

    theta = where.shared(jax.tree.map(lambda x: jnp.array(x, copy=True), run.params))
    num_regions = spec.num_regions
    gps = _Server(theta, where.shared(outer_init(global_rule, theta)))
    lps = [
        _Server(theta, where.shared(outer_init(run.outer_optimizer, theta)))
        for _ in range(num_regions)
    ]
    inner_states = where.inner_states(run.inner_optimizer.init, theta, m_count)
    jobs = [0] * m_count
    events: list = []
    seq = iter(range(1 << 62))

    def post(time, kind, who, payload):  # ties: by kind, then worker or region index
        heapq.heappush(events, (time, kind, who, next(seq), payload))

    def start(m: int, at: float) -> None:
        """Worker m receives θ_L at `at` and runs its next job; its delta arrives later."""
        r = spec.regions[m]
        e = async_train.AsyncEvent(0, m, jobs[m], steps[m], at, 0.0, lps[r].version, 0)
        delta, inner_states[m], means = run_job(
            lps[r].theta, inner_states[m], job_data(e), jnp.int32(e.job), jnp.int32(m),
            num_steps=e.steps,
        )  # fmt: skip
        finish = at + steps[m] * seconds[m]
        spans.append((at, finish))
        post(finish + spec.worker_seconds, _ARRIVAL, m, (m, e, delta, means))
        jobs[m] += 1

    spans: list = []
    for m in range(m_count):
        start(m, spec.worker_seconds)
    per_model = sum(
        int(np.prod(np.shape(x))) * np.dtype(jnp.result_type(x)).itemsize
        for x in jax.tree.leaves(run.params)
    )
    sent, region_sent = [0] * m_count, [0] * num_regions
    history, total_steps, time = [], 0, 0.0

    def send(time, region, message) -> None:
        """A message between the servers sent now; with no latency it is handled at once."""
        hop = spec.hop_seconds(region)
        if hop > 0:
            post(time + hop, _SERVERS, region, message)
        else:
            serve(time, message)

    def serve(time, payload) -> None:
        """A message between the servers reaches its end."""
        what, r, value = payload
        if what == "push":  # Δ_L reaches the GPS
            gps.theta, gps.state = apply_global(
                gps.theta, gps.state, value, jnp.int32(gps.version - lps[r].seen)
            )
            gps.version += 1
            send(time, r, ("reply", r, gps.theta))
        else:  # θ_G reaches LPS r
            local = lps[r]
            local.theta = merge(local.theta, value, spec.merge_weight)
            local.snapshot, local.merged, local.in_flight = local.theta, local.version, False
            local.seen = gps.version

    while len(history) < run.num_updates:
        time, kind, _, _, payload = heapq.heappop(events)
        if kind == _SERVERS:
            serve(time, payload)
            continue
        m, e, delta, means = payload
        r = spec.regions[m]
        local = lps[r]
        staleness = local.version - e.start_update
        local.theta, local.state = apply_local(
            local.theta, local.state, delta, jnp.int32(staleness)
        )
        local.version += 1
        push = None
        if not local.in_flight and local.version == local.merged + spec.local_updates:
            local.in_flight = True
            region_sent[r] += per_model
            push = ("push", r, worker_delta(local.snapshot, local.theta))
        last = len(history) + 1 == run.num_updates
        if not last:  # the answer: its next job starts from this θ_L
            start(m, time + spec.worker_seconds)
        if push is not None:
            send(time, r, push)
        sent[m] += per_model
        total_steps += e.steps
        loss, aux = jax.device_get(means)
        entry = {
            "update": len(history),
            "time": time,
            "worker": m,
            "region": r,
            "steps": e.steps,
            "total_steps": total_steps,
            "staleness": staleness,
            "global_updates": gps.version,
            "loss": float(loss),
            "bytes_communicated": round(sum(sent) / m_count),
            "wire_bytes": round(sum(sent) / m_count),
            "worker_bytes": list(sent),
            "region_bytes": list(region_sent),
        }
        for name, value in aux.items():
            if name in entry:
                raise ValueError(f"loss_fn's aux name {name!r} collides with the history key")
            entry[name] = float(value)
        every = m_count * run.eval_every  # as train_async: every eval_every steps per worker
        crossed = total_steps // every > (total_steps - e.steps) // every
        if evaluate is not None and (crossed or last):
            entry.update({k: float(v) for k, v in jax.device_get(evaluate(gps.theta)).items()})
        history.append(entry)
        if run.callback is not None:
            run.callback(entry)
    elapsed = time if history else 0.0
    busy = sum(max(0.0, min(finish, elapsed) - begin) for begin, finish in spans)
    utilization = busy / (m_count * elapsed) if elapsed else 0.0
    outer = {"global": gps.state, "local": tuple(s.state for s in lps)}
    state = async_train.AsyncState(gps.theta, outer, where.stack(inner_states), run.num_updates)
    return async_train.AsyncResult(gps.theta, state, history, elapsed, utilization)


@dataclasses.dataclass
class _Server:
    """A parameter server: θ and its outer state, its updates so far (`version`); an LPS also
    keeps its snapshot at its last merge, the version then (`merged`), whether a push is in
    flight, and the GPS updates it had seen at its last merge (`seen`)."""

    theta: Any
    state: Any
    version: int = 0
    snapshot: Any = None
    merged: int = 0
    in_flight: bool = False
    seen: int = 0

    def __post_init__(self):
        self.snapshot = self.theta


def _merge(local: Any, global_: Any, alpha: Any) -> Any:
    """(1 - α) θ_L + α θ_G, in the delta dtype, cast back to each param's dtype."""
    return jax.tree.map(
        lambda lo, gl: ((1 - alpha) * widen(lo) + alpha * widen(gl)).astype(jnp.result_type(lo)),
        local,
        global_,
    )

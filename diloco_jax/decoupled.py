"""Decoupled DiLoCo (Douillard et al. 2026, arXiv 2604.21428): learners that never wait, and a
syncer that merges a quorum of them, as the `server=` part of `train_async`.

On `train_async`'s simulated clock (learner m takes `step_seconds[m]` per inner step and never
stops):

- the params split into P fragments (leaf i -> fragment i % P); learner m pushes fragment p
  after its own inner steps k H + (p + 1) H / P (k = 0, 1, ...), for the syncer's sync k of
  that fragment, with c_steps (its inner steps since it last received fragment p) and
  c_tokens = c_steps x its tokens per step;
- the syncer merges sync (p, k) at T = the K-th push's time plus a grace window (fixed, or
  adaptive: gamma x max(0, tau x s_q - (K-th push time - first push time)), s_q the step time
  of the learner whose push made the quorum); pushes made by T are merged, later ones are
  dropped and counted as late;
- the merge: Delta_m = Theta_p - theta_m,p against the syncer's own fragment, weighted by
  w_m = c_tokens^2 / c_steps (normalised), averaged (or RDA: the weighted mean of the norms
  times the direction of the weighted mean of unit deltas, per leaf, with plain averaging for
  the leaves named in `average_leaves`); fragment p's own outer state takes one step;
- every learner overwrites fragment p with the new Theta_p at its first step boundary at or
  after T (after its push at that boundary, if any) and resets its counters of p.

A learner's steps are computed when a merged push needs them, so steps whose pushes all came
late at the end of a run are never computed (its inner state in the result stops there).
K = M, no grace and equal speeds and tokens is synchronous DiLoCo (one fragment) or
Streaming DiLoCo with tau = 0 and alpha = 0 (P fragments). The syncer's broadcasts are not
counted as bytes; every push is (late ones too: they were sent).

On the user's mesh (`train_async(mesh=..., param_sharding=...)`), learner m's params, inner
state and steps sit on its slice m of the worker axis, sharded by the params' specs; θ, each
fragment's outer state and the merged fragments at the specs over the whole mesh, as
`train_async`'s one server places them (`diloco_jax.async_placement`). A push is put where
θ is (its send), a merged fragment on each learner's devices when it applies it.
"""

import dataclasses
import functools
import hashlib
import json
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax import checkpoint
from diloco_jax import sampler as sampler_lib
from diloco_jax.async_placement import OnMesh
from diloco_jax.checks import check_int, check_number
from diloco_jax.inner import inner_loop, worker_key
from diloco_jax.outer import outer_init, outer_update, worker_delta
from diloco_jax.quorum import Grace, QuorumRule, fixed_grace
from diloco_jax.sampler import Sampler
from diloco_jax.schedule import fragment_of
from diloco_jax.workers import in_mesh_context

MERGES = ("average", "rda")
NEVER = 2**62  # the boundary of a merge a learner never applied


def _at_least_0(x: float) -> bool:
    return x >= 0


@dataclasses.dataclass(frozen=True)
class DecoupledDiLoCo:
    """The `server=` part of `train_async` for Decoupled DiLoCo (see the module docstring).

    quorum: K >= 1 pushes a sync waits for (at most M). grace_seconds: a fixed window >= 0
    after the K-th push. adaptive_grace: gamma in (0, 1), the paper's adaptive window instead
    of a fixed one, budgeted on `overlap_steps` (tau >= 1) steps of the quorum's learner.
    fragments: P >= 1 (H a multiple of P; at most the number of param leaves). merge:
    "average" or "rda". average_leaves: with "rda", key-path substrings of leaves merged by
    plain averaging (the paper keeps embeddings so). tokens_per_step: one positive number per
    learner (default 1 each: weights then follow the steps)."""

    quorum: int = 1
    grace_seconds: float = 0.0
    adaptive_grace: float | None = None
    overlap_steps: int = 0
    fragments: int = 1
    merge: str = "average"
    average_leaves: tuple[str, ...] = ()
    tokens_per_step: tuple[float, ...] | None = None

    takes_mesh: ClassVar[bool] = True

    def __post_init__(self):
        check_int("DecoupledDiLoCo.quorum", self.quorum, 1)
        check_int("DecoupledDiLoCo.fragments", self.fragments, 1)
        check_int("DecoupledDiLoCo.overlap_steps", self.overlap_steps, 0)
        check_number("DecoupledDiLoCo.grace_seconds", self.grace_seconds, _at_least_0, ">= 0")
        gamma = self.adaptive_grace
        if gamma is not None:
            check_number("DecoupledDiLoCo.adaptive_grace", gamma, lambda g: 0 < g < 1, "in (0, 1)")
            if self.grace_seconds:
                raise ValueError("DecoupledDiLoCo takes grace_seconds or adaptive_grace, not both")
            if self.overlap_steps < 1:
                raise ValueError(
                    "DecoupledDiLoCo.adaptive_grace needs overlap_steps >= 1 (the steps of "
                    "compute the window is budgeted on)"
                )
        elif self.overlap_steps:
            raise ValueError("DecoupledDiLoCo.overlap_steps only sets adaptive_grace's budget")
        if self.merge not in MERGES:
            raise ValueError(f"DecoupledDiLoCo.merge must be one of {MERGES}, got {self.merge!r}")
        names = self.average_leaves
        if not isinstance(names, tuple) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(
                f"DecoupledDiLoCo.average_leaves must be a tuple of non-empty strings, got "
                f"{names!r}"
            )
        if names and self.merge != "rda":
            raise ValueError("DecoupledDiLoCo.average_leaves applies to merge='rda' only")
        if self.tokens_per_step is not None:
            tokens = self.tokens_per_step
            if not isinstance(tokens, tuple) or not tokens:
                raise ValueError(
                    "DecoupledDiLoCo.tokens_per_step must be a tuple of numbers, one per "
                    f"learner, got {tokens!r}"
                )
            for t in tokens:
                check_number("DecoupledDiLoCo.tokens_per_step", t, lambda x: x > 0, "> 0")

    def checked(self, num_workers: int, inner_steps: int, params: Any = None) -> None:
        """ValueError naming the field that doesn't fit the run (M, H, the params; None
        leaves the params' leaf count unchecked, e.g. before they exist)."""
        if self.quorum > num_workers:
            raise ValueError(
                f"DecoupledDiLoCo.quorum must be at most num_workers = {num_workers}, got "
                f"{self.quorum}"
            )
        if self.tokens_per_step is not None and len(self.tokens_per_step) != num_workers:
            raise ValueError(
                f"DecoupledDiLoCo.tokens_per_step must hold num_workers = {num_workers} numbers, "
                f"got {len(self.tokens_per_step)}"
            )
        if params is not None:
            fragment_of(params, self.fragments)
        if inner_steps % self.fragments:
            raise ValueError(
                f"inner_steps = {inner_steps} must be a multiple of DecoupledDiLoCo.fragments = "
                f"{self.fragments}"
            )
        if self.overlap_steps >= inner_steps // self.fragments:
            raise ValueError(
                f"DecoupledDiLoCo.overlap_steps must be below H / P = "
                f"{inner_steps // self.fragments}, got {self.overlap_steps}"
            )

    def push_step(self, fragment: int, index: int, inner_steps: int) -> int:
        """The learner step whose end pushes fragment `fragment` for its sync `index`:
        k H + (p + 1) H / P."""
        return index * inner_steps + (fragment + 1) * (inner_steps // self.fragments)

    def sync_of(self, step: int, inner_steps: int) -> tuple[int, int] | None:
        """(fragment, index) of the push a learner makes after its step `step`, or None
        where it makes none (`push_step`'s inverse)."""
        offset = inner_steps // self.fragments
        if step <= 0 or step % offset:
            return None
        slot = step // offset - 1
        return slot % self.fragments, slot // self.fragments

    def schedule(self, step_seconds, inner_steps: int, num_syncs: int) -> tuple["Sync", ...]:
        """The first `num_syncs` syncs as the syncer's rule (`quorum.QuorumRule`) merges them
        on the simulated clock: learner m pushes fragment p's sync k at step k H + (p + 1)
        H / P, at step x step_seconds[m] (pushes at one instant in learner order), and a sync
        due at a time merges after every push made by then."""
        seconds = tuple(float(s) for s in step_seconds)
        if self.quorum > len(seconds):
            raise ValueError(
                f"DecoupledDiLoCo.quorum = {self.quorum} must be at most the learners "
                f"({len(seconds)} step_seconds)"
            )
        pushes = sorted(
            (self.push_step(p, k, inner_steps) * s, m, p, k)
            for p in range(self.fragments)
            for k in range(num_syncs)
            for m, s in enumerate(seconds)
        )
        rule = QuorumRule(self.fragments, self.quorum, self.grace(seconds))
        syncs, i = [], 0
        while len(syncs) < num_syncs:
            due = rule.next_due()
            if due is None or (i < len(pushes) and pushes[i][0] <= due.time):
                at, m, p, k = pushes[i]
                rule.push(p, k, m, at)
                i += 1
                continue
            merged = rule.merge(due, due.time)
            step = self.push_step(due.fragment, due.sync, inner_steps)
            syncs.append(
                Sync(
                    update=len(syncs),
                    fragment=due.fragment,
                    index=due.sync,
                    step=step,
                    time=due.time,
                    merged=merged,
                )
            )
        return tuple(syncs)

    def grace(self, step_seconds: Any = None) -> Grace:
        """The window after a sync's K-th push: `grace_seconds`, or with `adaptive_grace`
        gamma x max(0, tau x s_K - (t_K - t_1)) (s_K = step_seconds[K-th pusher], its seconds
        per step: the simulated clock's tuple, or what the real syncer measures, a
        `step_times.StepTimes`; t_1, t_K: the first and K-th pushes' times)."""
        gamma = self.adaptive_grace
        if gamma is None:
            return fixed_grace(self.grace_seconds)
        if step_seconds is None:
            raise ValueError("DecoupledDiLoCo.adaptive_grace needs each learner's step seconds")
        tau = self.overlap_steps

        def adaptive(first: float, quorum: float, learner: int) -> float:
            return gamma * max(0.0, tau * step_seconds[learner] - (quorum - first))

        return adaptive

    def checkpoint_fields(self) -> dict:
        """What a checkpoint's fingerprint records of this part (train_async resumes only the
        same run)."""
        fields = dataclasses.asdict(self)
        fields["average_leaves"] = list(self.average_leaves)
        if self.tokens_per_step is not None:
            fields["tokens_per_step"] = [float(t) for t in self.tokens_per_step]
        return fields

    def train(self, run: Any) -> Any:
        return _train(self, run)

    def recorded(
        self, arrivals: Any, num_workers: int, inner_steps: int, num_updates: int
    ) -> "RecordedTiming":
        """A real run's merges (`Merge`s, e.g. `elastic.arrivals(syncer_dir)` of a run of
        this part on processes), checked against this spec and the run: what
        `train_async(server=self, arrivals=...)` replays in place of the simulated clock.
        ValueError naming arrivals[i] where one can't be this run's."""
        self.checked(num_workers, inner_steps)
        try:
            merges = tuple(Merge(*m) for m in arrivals)
        except TypeError as error:
            raise ValueError(
                f"arrivals must be a sequence of decoupled.Merge, got {error}"
            ) from None
        if len(merges) < num_updates:
            raise ValueError(f"arrivals holds {len(merges)} merges; num_updates = {num_updates}")
        for i, m in enumerate(merges[:num_updates]):
            why = None
            if m.update != i:
                why = f"update {m.update} at index {i}"
            elif not 0 <= m.fragment < self.fragments:
                why = f"fragment {m.fragment} of {self.fragments}"
            elif m.step != self.push_step(m.fragment, m.index, inner_steps):
                why = f"step {m.step} is not sync {m.index} of fragment {m.fragment}"
            elif not set(m.merged) <= set(range(num_workers)) or len(m.boundaries) != num_workers:
                why = f"learners outside [0, {num_workers})"
            elif any(not 0 <= r[0] < num_workers or r[1] < 0 for r in m.restarts):
                why = f"a restart outside [0, {num_workers}) or before step 0"
            if why is not None:
                raise ValueError(f"arrivals[{i}] can't be replayed: {why}")
        return RecordedTiming(merges[:num_updates])


class Sync(NamedTuple):
    """One merge of the syncer: `update` (its index), `fragment` p, `index` k (fragment p's
    k-th sync), `step` (the learner step a push for it follows: k H + (p + 1) H / P), `time`
    (simulated seconds of the merge) and `merged` (the learners whose pushes it merges)."""

    update: int
    fragment: int
    index: int
    step: int
    time: float
    merged: tuple[int, ...]


def merge_weights(c_tokens: Any, c_steps: Any) -> np.ndarray:
    """w_m = c_tokens^2 / c_steps, normalised to sum 1 (0 where c_steps is 0)."""
    tokens, steps = np.asarray(c_tokens, np.float64), np.asarray(c_steps, np.float64)
    w = np.where(steps > 0, tokens**2 / np.where(steps > 0, steps, 1.0), 0.0)
    return w / w.sum()


def rda(deltas_k: jax.Array, weights_k: jax.Array) -> jax.Array:
    """Radial-directional average of one leaf's deltas [k, ...] with weights [k] summing to 1:
    sum_m w_m |d_m| times the unit direction of sum_m w_m d_m / |d_m| (zero deltas and a zero
    mean direction give zero)."""
    flat = deltas_k.reshape(deltas_k.shape[0], -1)
    norms = jnp.linalg.norm(flat, axis=1)
    units = flat / jnp.where(norms > 0, norms, 1.0)[:, None]
    direction = jnp.tensordot(weights_k, units, axes=1)
    length = jnp.linalg.norm(direction)
    unit = direction / jnp.where(length > 0, length, 1.0)
    return (jnp.dot(weights_k, norms) * unit).reshape(deltas_k.shape[1:]).astype(deltas_k.dtype)


def _average(deltas_k, weights_k):
    return jnp.tensordot(weights_k.astype(deltas_k.dtype), deltas_k, axes=1)


def _merge_and_step(outer_optimizer, rules, theta, outer_state, pushed, weights):
    """Fragment p's outer step: Delta = merge of (theta - pushed_m) by `rules` (one per leaf),
    then the outer update of theta (a list of the fragment's leaves)."""
    deltas = [worker_delta(t, x) for t, x in zip(theta, pushed, strict=True)]
    merged = [
        (rda if rule == "rda" else _average)(d, weights.astype(d.dtype))
        for rule, d in zip(rules, deltas, strict=True)
    ]
    return outer_update(outer_optimizer, theta, outer_state, merged)


def _step(loss_fn, inner_optimizer, has_aux, rng_seed, params, opt_state, data, job, worker, h):
    """Inner step h of round `job` of one learner (the step keyed and drawn as step h of that
    round of `train_diloco`): (params, opt_state, loss, aux)."""
    if isinstance(data, sampler_lib.WorkerSampler):
        batches = functools.partial(_draw, data, job, worker, h)
    else:
        batches = data  # leaves [1, ...]
    key = None if rng_seed is None else worker_key(rng_seed, job, worker)
    params, opt_state, losses, *aux = inner_loop(
        loss_fn, inner_optimizer, params, opt_state, batches, num_steps=1, key=key,
        first_step=h, has_aux=has_aux,
    )  # fmt: skip
    return params, opt_state, losses[0], jax.tree.map(lambda x: x[0], aux[0] if aux else {})


def _draw(data, job, worker, h, s):
    return data.draw(job, worker, h + s)


@functools.lru_cache(maxsize=16)
def _programs(loss_fn, inner_optimizer, outer_optimizer, has_aux, rng_seed, job_mesh):
    """(jitted learner step, traced with `job_mesh`'s axes in context (a learner's slice of
    the user's mesh; None on one device), rules -> jitted merge and outer step of a fragment
    with those per-leaf rules); cached so repeated runs reuse the compilations."""
    step = jax.jit(
        in_mesh_context(
            functools.partial(_step, loss_fn, inner_optimizer, has_aux, rng_seed), job_mesh
        )
    )

    @functools.cache
    def merge(rules):
        return jax.jit(functools.partial(_merge_and_step, outer_optimizer, rules))

    return step, merge


class _Places:
    """Where the run's arrays live (`where`: one device, or the user's mesh): θ-like leaves
    by their index in θ, on the whole mesh (`shared`) or on learner m's slice of it
    (`worker`), and each fragment's outer state."""

    def __init__(self, where: Any, members: list):
        self.where, self.members = where, members
        self.on_mesh = isinstance(where, OnMesh)
        if not self.on_mesh:
            self.device = where.device or jax.devices()[0]

    def sharding(self, index: int, worker: int | None = None) -> jax.sharding.Sharding:
        """Where θ's leaf `index` lives: on the whole mesh, or on `worker`'s slice."""
        if not self.on_mesh:
            return jax.sharding.SingleDeviceSharding(self.device)
        placed = self.where.full if worker is None else self.where.workers[worker]
        return placed.sharding(placed.specs[index], per_worker=False)

    def leaves(self, values: list, indices: list, worker: int | None = None) -> list:
        """`values` (leaves of θ of these `indices`) on the whole mesh, or on `worker`'s."""
        return [
            jax.device_put(v, self.sharding(i, worker))
            for v, i in zip(values, indices, strict=True)
        ]

    def outer(self, state: Any, fragment: int) -> Any:
        """Fragment `fragment`'s outer state at its leaves' specs over the whole mesh."""
        if not self.on_mesh:
            return jax.device_put(state, self.device)
        placed = self.where.full._replace(groups=(tuple(self.members[fragment]),))
        return jax.device_put(state, placed.tree(state, per_worker=False))

    def replicated(self, worker: int | None) -> jax.sharding.Sharding:
        """A small array's place: on the device, or replicated on the (learner's) mesh."""
        if not self.on_mesh:
            return jax.sharding.SingleDeviceSharding(self.device)
        mesh = self.where.full.mesh if worker is None else self.where.meshes[worker]
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


class _Pushed(NamedTuple):
    """A learner's push as a merge takes it: the fragment's leaves where Θ is, its c_steps,
    and the mean loss and aux of those steps."""

    values: list
    c_steps: int
    loss: Any
    aux: Any


class _Broadcast(NamedTuple):
    """A merged fragment on its way to a learner: applied before the learner's inner step
    `boundary` + 1 (its first step boundary at or after the merge), from sync `update`."""

    boundary: int
    fragment: int
    update: int
    values: list


@dataclasses.dataclass
class _Learner:
    """One learner: its params (leaves) after `done` inner steps and its inner state; per
    fragment, its steps since it last received that fragment (`counts`); the losses and aux
    of its newest steps, as many as the largest count (what a push's mean still needs); the
    broadcasts it has yet to apply, in the order they were merged."""

    params: list
    opt_state: Any
    done: int
    counts: list
    losses: list
    auxes: list
    inbox: list
    origin: tuple = (0, 0)  # (version, step): where its trajectory began (a replay's restarts)


@dataclasses.dataclass
class _State:
    """Everything a run holds between two syncs (all a checkpoint saves): θ's leaves, each
    fragment's outer state, the learners, the late pushes so far, and the learners' inner
    steps by the last two syncs' times (`steps_before`, `steps_now`: the evaluation's due)."""

    theta: list
    outer: list
    learners: list
    late_total: int = 0
    steps_before: int = 0
    steps_now: int = 0


@dataclasses.dataclass
class _Job:
    """The loop's `Job` (`diloco_jax.loop`) for Decoupled DiLoCo: one iteration is one sync of
    the schedule, the learners it merges stepped to their pushes first."""

    spec: DecoupledDiLoCo
    run: Any
    syncs: tuple
    treedef: Any
    members: list  # fragment -> its leaf indices
    rules: tuple  # leaf -> "average" or "rda"
    tokens: tuple
    timing: Any  # `SimulatedTiming` or a real run's `RecordedTiming`
    fragment_bytes: list
    shard_bytes: list | None  # on a mesh: one device's shard of each fragment, in bytes
    step_fn: Any
    merge: Any
    data_of: Any
    evaluate_fn: Any
    places: _Places
    snapshot_at: set  # (learner, step) whose inner state a replayed restart takes
    # A replayed run's restarted learners: (learner, step) -> the inner state at that step
    # of the process that died, what its restart took from its checkpoint.
    snapshots: dict = dataclasses.field(default_factory=dict)
    # (update, learner) -> a push made before a restart and merged after it (a replay's)
    stash: dict = dataclasses.field(default_factory=dict)
    # (learner, step): the pushes some merge still takes. A real run can merge a learner's
    # push after one it made later (each sync merges once its quorum is in), by which time
    # the replay has stepped that learner past it: such a push is kept as it steps past
    # (`made`, by (learner, trajectory origin, step)) until its merge takes it.
    awaited: set = dataclasses.field(default_factory=set)
    made: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, spec: DecoupledDiLoCo, run: Any) -> "_Job":
        m_count, h_count = run.num_workers, run.inner_steps
        leaves, treedef = jax.tree.flatten(run.params)
        members, rules = fragments_and_rules(spec, run.params)
        places = _Places(run.where, members)
        # On a mesh a learner's step runs on its slice, traced with that slice's axes.
        job_mesh = run.where.meshes[0].abstract_mesh if places.on_mesh else None
        step_fn, merge = programs(run.loss_fn, run.inner_optimizer, run.outer_optimizer,
                                  run.has_aux, run.rng_seed, job_mesh)  # fmt: skip
        shards = run.where.shards(run.params)  # None on one device
        timing = run.recorded
        if timing is None:
            timing = SimulatedTiming(spec, run.step_seconds, h_count, run.num_updates)
        shard_bytes = None if shards is None else _fragment_bytes(jax.tree.leaves(shards), members)
        return cls(
            spec=spec,
            run=run,
            syncs=timing.syncs,
            treedef=treedef,
            members=members,
            rules=rules,
            tokens=spec.tokens_per_step or (1.0,) * m_count,
            timing=timing,
            fragment_bytes=_fragment_bytes(leaves, members),
            shard_bytes=shard_bytes,
            step_fn=step_fn,
            merge=merge,
            data_of=_data(run.data, m_count, h_count, run.where),
            evaluate_fn=jax.jit(run.eval_fn) if run.eval_fn is not None else None,
            places=places,
            snapshot_at=timing.snapshots(),
            awaited={(m, x.step) for x in timing.syncs for m in x.merged},
        )

    def initial(self) -> _State:
        run, places = self.run, self.places
        every = list(range(len(self.rules)))
        theta = places.leaves([jnp.array(x, copy=True) for x in jax.tree.leaves(run.params)],
                              every)  # fmt: skip
        outer = [
            places.outer(outer_init(run.outer_optimizer, [theta[i] for i in idx]), p)
            for p, idx in enumerate(self.members)
        ]
        inner = run.where.inner_states(
            run.inner_optimizer.init, jax.tree.unflatten(self.treedef, theta), run.num_workers
        )
        learners = [
            _Learner(
                params=places.leaves(theta, every, m),
                opt_state=inner[m],
                done=0,
                counts=[0] * self.spec.fragments,
                losses=[],
                auxes=[],
                inbox=[],
            )
            for m in range(run.num_workers)
        ]
        return _State(theta, outer, learners)

    def items(self, start: int) -> tuple:
        return self.syncs[start:]

    def step(self, state: _State, sync: Sync) -> tuple[_State, Any]:
        """Merges `sync`: each learner in it stepped to its push; the others' slots hold
        Θ_p (a zero delta, weight 0). Every learner gets the new Θ_p in its inbox."""
        p, m_count, timing = sync.fragment, self.run.num_workers, self.timing
        for restart in timing.restarts(sync):
            self._restart(state, sync.update, *restart)
        pushed, c_steps, losses, auxes = [], [], [], []
        for m in range(m_count):
            if m in sync.merged:
                push = self.stash.pop((sync.update, m), None)  # made before m's restart
                if push is None:
                    origin = timing.origin(sync, m)
                    if origin is not None and origin != state.learners[m].origin:
                        raise ValueError(
                            f"arrivals[{sync.update}] merges learner {m}'s push from the "
                            f"trajectory begun at {origin}, which no restart of the record began"
                        )
                    push = self._push(state.learners[m], m, sync.step, p)
                pushed.append(push.values)
                c_steps.append(push.c_steps)
                losses.append(push.loss)
                auxes.append(push.aux)
            else:
                pushed.append([state.theta[i] for i in self.members[p]])
                c_steps.append(0)
        weights = merge_weights([c * t for c, t in zip(c_steps, self.tokens, strict=True)], c_steps)
        stacked = [jnp.stack([x[j] for x in pushed]) for j in range(len(self.members[p]))]
        fragment = [state.theta[i] for i in self.members[p]]
        rules_p = tuple(self.rules[i] for i in self.members[p])  # the fragment's merge per leaf
        new, state.outer[p] = self.merge(rules_p)(
            fragment, state.outer[p], stacked, jnp.asarray(weights)
        )
        new, state.outer[p] = (
            self.places.leaves(new, self.members[p]),
            self.places.outer(state.outer[p], p),
        )
        for i, v in zip(self.members[p], new, strict=True):
            state.theta[i] = v
        for m, learner in enumerate(state.learners):  # p overwritten at its next boundary
            learner.inbox.append(_Broadcast(timing.boundary(sync, m), p, sync.update, list(new)))
        late = m_count - len(sync.merged)
        state.late_total += late
        state.steps_before = state.steps_now
        state.steps_now = timing.total_steps(sync)
        pushes = [timing.pushes(sync, m) for m in range(m_count)]  # [M][P], by T
        sent = [int(np.dot(self.fragment_bytes, n)) for n in pushes]
        entry = {
            "update": sync.update, "time": sync.time, "fragment": p, "sync": sync.index,
            "merged": list(sync.merged), "weights": [float(w) for w in weights], "late": late,
            "late_total": state.late_total, "total_steps": state.steps_now,
            "bytes_communicated": round(sum(sent) / m_count),
            "wire_bytes": round(sum(sent) / m_count), "worker_bytes": sent,
        }  # fmt: skip
        if self.shard_bytes is not None:  # each device sends its shard of a push
            per_device = [int(np.dot(self.shard_bytes, n)) for n in pushes]
            entry["wire_bytes_per_device"] = round(sum(per_device) / m_count)
        return state, (entry, losses, auxes)

    def _restart(
        self, state: _State, version: int, m: int, step: int, from_checkpoint: bool
    ) -> None:
        """Learner m's new process (or its Θ taken whole): from Θ as it is, at `step`, with
        the inner state of the trajectory before at that step (its checkpoint) or the
        optimizer's init. The pushes that trajectory made and a later merge takes are
        computed first (`stash`)."""
        learner = state.learners[m]
        # The same origin is the same trajectory (a first start): nothing of it set aside.
        before = () if learner.origin == (version, step) else learner.origin
        for update, push_step in self.timing.pushes_of(m, before, version):
            self.stash[(update, m)] = self._push(learner, m, push_step, self.syncs[update].fragment)
        if not from_checkpoint:
            theta = jax.tree.unflatten(self.treedef, state.theta)
            opt_state = self.run.where.inner_state(self.run.inner_optimizer.init, theta, m)
        elif learner.done <= step:
            opt_state = self._advance(learner, m, step).opt_state
        else:
            opt_state = self.snapshots[(m, step)]
        every = range(len(self.rules))
        theta = self.places.leaves(state.theta, every, m)
        counts = [0] * self.spec.fragments
        state.learners[m] = _Learner(
            params=theta,
            opt_state=opt_state,
            done=step,
            counts=counts,
            losses=[],
            auxes=[],
            inbox=[],
            origin=(version, step),
        )

    def _push(self, learner: _Learner, m: int, step: int, fragment: int) -> "_Pushed":
        """Learner m's push of `fragment` after its step `step` (stepped there first, or the
        one kept as it stepped past), put where Θ is (its send)."""
        self.awaited.discard((m, step))
        if learner.done > step:
            made = self.made.pop((m, learner.origin, step), None)
            if made is None:  # stepped past before a resume: its state then is not saved
                raise ValueError(
                    f"learner {m}'s push after step {step} is merged after one it made later, "
                    "and the run resumed in between: replay it without checkpoint_dir"
                )
            return made
        return self._made(self._advance(learner, m, step), fragment)

    def _made(self, learner: _Learner, fragment: int) -> "_Pushed":
        """The push of `fragment` the learner makes where it is."""
        c, idx = learner.counts[fragment], self.members[fragment]
        return _Pushed(
            self.places.leaves([learner.params[i] for i in idx], idx), c,
            jnp.mean(jnp.stack(learner.losses[-c:])),
            jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs)), *learner.auxes[-c:]),
        )  # fmt: skip

    def _advance(self, learner: _Learner, m: int, target: int) -> _Learner:
        """Learner m completes step `target`: every broadcast due at an earlier boundary is
        applied first (those due at `target` itself wait: the push there comes first)."""
        h_count = self.run.inner_steps
        while learner.done < target:
            if (m, learner.done) in self.awaited and learner.done > learner.origin[1]:
                # A push here some merge takes: kept before this boundary's broadcasts.
                fragment = self.spec.sync_of(learner.done, h_count)[0]
                self.made[(m, learner.origin, learner.done)] = self._made(learner, fragment)
            for b in [b for b in learner.inbox if b.boundary <= learner.done]:
                indices = self.members[b.fragment]
                for i, v in zip(indices, self.places.leaves(b.values, indices, m), strict=True):
                    learner.params[i] = v
                learner.counts[b.fragment] = 0
            learner.inbox = [b for b in learner.inbox if b.boundary > learner.done]
            job, h = divmod(learner.done, h_count)
            params, learner.opt_state, loss, aux = self.step_fn(
                jax.tree.unflatten(self.treedef, learner.params), learner.opt_state,
                self.data_of(job, m, h), jnp.int32(job), jnp.int32(m), jnp.int32(h),
            )  # fmt: skip
            learner.params = jax.tree.leaves(params)
            learner.losses.append(loss)
            learner.auxes.append(aux)
            learner.done += 1
            learner.counts = [c + 1 for c in learner.counts]
            if (m, learner.done) in self.snapshot_at:  # a later restart resumes from here
                self.snapshots[(m, learner.done)] = learner.opt_state
        # A push's mean reads its fragment's count of newest losses: older ones are not read.
        kept = max(learner.counts)
        learner.losses, learner.auxes = learner.losses[-kept:], learner.auxes[-kept:]
        return learner

    def evaluate(self, state: _State, done: int) -> Any:
        # As train_async: every eval_every inner steps per learner, and after the last sync.
        from diloco_jax.async_train import eval_due

        if self.evaluate_fn is None:
            return None
        every = self.run.num_workers * self.run.eval_every
        due = eval_due(state.steps_before, state.steps_now, every)
        if not (due or done == self.run.num_updates):
            return None
        return self.evaluate_fn(jax.tree.unflatten(self.treedef, state.theta))

    def record(self, i: int, item: Sync, metrics: Any, evals: Any) -> dict:
        from diloco_jax.async_train import joined

        entry, losses, auxes = metrics
        # Each learner's on its own devices: their mean taken on one, as on one device.
        losses, auxes = jax.device_get(losses), jax.device_get(auxes)
        at = list(entry).index("total_steps") + 1  # the loss after the step count
        items = list(entry.items())
        entry = dict([*items[:at], ("loss", float(jnp.mean(jnp.stack(losses)))), *items[at:]])
        aux = {name: np.mean([float(a[name]) for a in auxes]) for name in auxes[0]} if auxes else {}
        return joined(entry, aux, evals)

    def savable(self, state: _State) -> dict:
        """The state as nested dicts of arrays. Its layout varies with the learners' pending
        broadcasts and kept losses, so a resume restores it as it was saved
        (`restore_target`); every dict holds at least one array."""
        learners = {}
        for m, x in enumerate(state.learners):
            saved = {
                "params": _numbered(x.params),
                "opt": _numbered(jax.tree.leaves(x.opt_state)),
                "numbers": np.asarray([x.done, len(x.losses), *x.counts], np.int64),
                "losses": jnp.stack(x.losses) if x.losses else np.zeros(1, np.float32),
            }
            for name in x.auxes[0] if x.auxes else {}:
                saved[f"aux-{name}"] = jnp.stack([a[name] for a in x.auxes])
            for j, b in enumerate(x.inbox):
                saved[f"inbox-{j:06d}"] = {
                    "where": np.asarray([b.boundary, b.fragment, b.update], np.int64),
                    # by the leaves' indices in θ: where each is restored to says so
                    "values": dict(zip(_keys(self.members[b.fragment]), b.values, strict=True)),
                }
            learners[f"{m:06d}"] = saved
        return {
            "theta": _numbered(state.theta),
            "outer": {f"{p:06d}": _numbered(jax.tree.leaves(o)) for p, o in enumerate(state.outer)},
            "learners": learners,
            "counters": np.asarray(
                [state.late_total, state.steps_before, state.steps_now], np.int64
            ),
        }

    def restore_target(self, state: _State) -> Any:
        """The restore target of a checkpoint in the layout it was saved in: on one device,
        or each array where the run keeps it (`_on_mesh_target`)."""
        if not self.places.on_mesh:
            return functools.partial(checkpoint.as_saved, sharding=self.places.replicated(None))
        return functools.partial(self._on_mesh_target, state)

    def _on_mesh_target(self, initial: _State, saved_tree: dict) -> dict:
        """`checkpoint.as_saved`'s target with each array's sharding: θ's leaves and merged
        fragments at the specs over the whole mesh, the outer states as the run places them,
        learner m's params and inner state on its slice, counters replicated (`initial`:
        the run's first state, whose fixed parts give their shardings)."""
        places, as_saved = self.places, checkpoint.as_saved

        def leaf(key: str, worker: int | None = None) -> Any:
            return places.sharding(int(key), worker)

        def like(saved: dict, arrays: Any) -> dict:
            """`saved`'s numbered arrays where `arrays` (in the same order) are."""
            shardings = [x.sharding for x in jax.tree.leaves(arrays)]
            return {k: as_saved(saved[k], s) for k, s in zip(sorted(saved), shardings,
                                                              strict=True)}  # fmt: skip

        target = {
            "theta": {k: as_saved(v, leaf(k)) for k, v in saved_tree["theta"].items()},
            "outer": {p: like(v, initial.outer[int(p)]) for p, v in saved_tree["outer"].items()},
            "counters": as_saved(saved_tree["counters"], places.replicated(None)),
            "learners": {},
        }
        for key, saved in saved_tree["learners"].items():
            m = int(key)
            small = places.replicated(m)
            learner = {
                "params": {k: as_saved(v, leaf(k, m)) for k, v in saved["params"].items()},
                "opt": like(saved["opt"], initial.learners[m].opt_state),
            }
            for name, value in saved.items():
                if name.startswith("inbox-"):
                    learner[name] = {
                        "where": as_saved(value["where"], small),
                        "values": {k: as_saved(v, leaf(k)) for k, v in value["values"].items()},
                    }
                elif name not in learner:  # numbers, losses, aux-*
                    learner[name] = as_saved(value, small)
            target["learners"][key] = learner
        return target

    def restored(self, saved: dict, done: int) -> _State:
        like = self.initial()
        learners = []
        for m, x in enumerate(like.learners):
            s = saved["learners"][f"{m:06d}"]
            numbers = [int(n) for n in s["numbers"]]
            kept = numbers[1]
            names = [k[len("aux-") :] for k in sorted(s) if k.startswith("aux-")]
            inbox = [
                _Broadcast(*(int(n) for n in s[k]["where"]), _listed(s[k]["values"]))
                for k in sorted(s) if k.startswith("inbox-")
            ]  # fmt: skip
            learners.append(
                _Learner(
                    params=_listed(s["params"]),
                    opt_state=jax.tree.unflatten(
                        jax.tree.structure(x.opt_state), _listed(s["opt"])
                    ),
                    done=numbers[0],
                    counts=numbers[2:],
                    losses=[s["losses"][j] for j in range(kept)],
                    auxes=[{n: s[f"aux-{n}"][j] for n in names} for j in range(kept)],
                    inbox=inbox,
                )
            )
        outer = [
            jax.tree.unflatten(jax.tree.structure(o), _listed(saved["outer"][f"{p:06d}"]))
            for p, o in enumerate(like.outer)
        ]
        late_total, steps_before, steps_now = (int(n) for n in saved["counters"])
        return _State(
            theta=_listed(saved["theta"]),
            outer=outer,
            learners=learners,
            late_total=late_total,
            steps_before=steps_before,
            steps_now=steps_now,
        )


def fragments_and_rules(spec: DecoupledDiLoCo, params: Any) -> tuple[list, tuple]:
    """(each fragment's leaf indices in θ, each leaf's merge: "rda" or "average")."""
    owner = fragment_of(params, spec.fragments)
    members = [[i for i, f in enumerate(owner) if f == p] for p in range(spec.fragments)]
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(
        params)[0]]  # fmt: skip
    rules = tuple(
        "rda" if spec.merge == "rda" and not any(n in path for n in spec.average_leaves)
        else "average"
        for path in paths
    )  # fmt: skip
    return members, rules


def programs(loss_fn, inner_optimizer, outer_optimizer, has_aux, rng_seed, job_mesh=None):
    """(the jitted learner step, rules -> the jitted merge and outer step of a fragment with
    those per-leaf rules): the same programs on the simulated clock and on real processes."""
    args = (loss_fn, inner_optimizer, outer_optimizer, has_aux, rng_seed, job_mesh)
    try:
        return _programs(*args)
    except TypeError:  # unhashable loss_fn or optimizer: compile without the cache
        return _programs.__wrapped__(*args)


def _numbered(leaves: list) -> dict:
    """A list of arrays as a dict by zero-padded index (a checkpoint's layout keeps its order)."""
    return dict(zip(_keys(range(len(leaves))), leaves, strict=True))


def _keys(indices: Any) -> list[str]:
    return [f"{i:06d}" for i in indices]


def _fragment_bytes(leaves: list, members: list) -> list[int]:
    """Each fragment's bytes: its leaves' (arrays or shapes) sizes times their itemsizes."""
    return [
        sum(int(np.prod(np.shape(leaves[i]))) * np.dtype(jnp.result_type(leaves[i])).itemsize
            for i in idx)
        for idx in members
    ]  # fmt: skip


def _listed(numbered: dict) -> list:
    return [numbered[k] for k in sorted(numbered)]


def _train(spec: DecoupledDiLoCo, run: Any) -> Any:
    """`train_async` with this server (see the module docstring): the loop of
    `diloco_jax.loop` over the syncs, checkpointed with `run.checkpoints`."""
    from diloco_jax.async_train import AsyncResult, AsyncState
    from diloco_jax.loop import Loop

    spec.checked(run.num_workers, run.inner_steps, run.params)
    if run.dynamic_steps:
        raise ValueError(
            "dynamic_steps is for jobs of H steps; DecoupledDiLoCo's learners never stop"
        )
    job = _Job.of(spec, run)
    if job.timing.restarted and run.checkpoints is not None:
        raise ValueError(
            "checkpoint_dir can't be given replaying a Decoupled DiLoCo run with a learner "
            "restarted past its start (the state its restart takes is not saved)"
        )
    loop = Loop(run.num_updates, run.checkpoints, run.callback, unit="updates",
                total_name="num_updates")  # fmt: skip
    state, history = loop.run(job, job.initial())
    params = jax.tree.unflatten(job.treedef, state.theta)
    inner = run.where.stack([x.opt_state for x in state.learners])
    params, result_state = run.where.results(
        (params, AsyncState(params, tuple(state.outer), inner, run.num_updates))
    )
    elapsed = job.syncs[-1].time if job.syncs else 0.0
    return AsyncResult(
        params=params,
        state=result_state,
        history=history,
        elapsed_seconds=elapsed,
        utilization=1.0 if job.syncs else 0.0,
    )


class Merge(NamedTuple):
    """One merge of a real Decoupled DiLoCo run (`elastic.arrivals`): its `update` index,
    `fragment`, `index` (the fragment's sync count), `step` (the learner step its pushes
    follow), `time` (seconds since the run's first merge), `merged` (the learners whose
    pushes it merged), `boundaries` (per learner, the step boundary at which it applied the
    merged fragment; -1: it never did, having ended or died first), `total_steps` (the
    learners' steps by then, as they last reported them), `pushes` (per learner, its
    pushes of each fragment sent by then) and `restarts`: the learner processes that started
    after the merge before it, each as (learner, the step it resumed at, whether its inner
    state came from its checkpoint of that step: else the optimizer's init), each from Θ of
    then with its counts at 0; `origins`: per learner, the (version, step) of the restart
    whose trajectory made its merged push (None: not merged; () for a record without them),
    so a push made before a restart and merged after it is the one computed."""

    update: int
    fragment: int
    index: int
    step: int
    time: float
    merged: tuple
    boundaries: tuple
    total_steps: int
    pushes: tuple
    restarts: tuple = ()  # (learner, step, from_checkpoint): processes (re)started before it
    origins: tuple = ()  # per learner, where the trajectory of its merged push began


def replay_rounds(merges: Any, inner_steps: int) -> int:
    """How many rounds of data (leaves [M, H, ...] each) replaying `merges` reads: every
    learner steps to the newest push a merge takes, or a restart's step."""
    steps = [m.step for m in merges] + [r[1] for m in merges for r in m.restarts]
    return max(steps, default=0) // inner_steps + 1


class RecordedTiming:
    """A real run's timing (`DecoupledDiLoCo.recorded`): its merges in place of the
    schedule's, each learner's recorded boundaries and counts."""

    def __init__(self, merges: tuple):
        self.merges = merges
        self.syncs = tuple(
            Sync(
                update=m.update,
                fragment=m.fragment,
                index=m.index,
                step=m.step,
                time=m.time,
                merged=tuple(m.merged),
            )
            for m in merges
        )
        text = json.dumps([list(m) for m in merges], sort_keys=True, default=list)
        self.digest = hashlib.sha256(text.encode()).hexdigest()[:16]

    def boundary(self, sync: Sync, learner: int) -> int:
        b = self.merges[sync.update].boundaries[learner]
        return b if b >= 0 else NEVER

    def total_steps(self, sync: Sync) -> int:
        return self.merges[sync.update].total_steps

    def pushes(self, sync: Sync, learner: int) -> list[int]:
        return list(self.merges[sync.update].pushes[learner])

    def restarts(self, sync: Sync) -> tuple:
        return tuple(self.merges[sync.update].restarts)

    def origin(self, sync: Sync, learner: int) -> tuple | None:
        origins = self.merges[sync.update].origins
        return tuple(origins[learner]) if origins and origins[learner] is not None else None

    def pushes_of(self, learner: int, origin: tuple, after: int) -> list[tuple[int, int]]:
        """(update, step) of the learner's pushes from the trajectory begun at `origin`
        merged from update `after` on, in update order."""
        return [
            (x.update, x.step) for x in self.merges[after:]
            if x.origins and x.origins[learner] is not None
            and tuple(x.origins[learner]) == origin
        ]  # fmt: skip

    def snapshots(self) -> set[tuple[int, int]]:
        """(learner, step): the inner states a restart takes from a learner's checkpoint."""
        return {(m, s) for x in self.merges for m, s, saved in x.restarts if saved}

    @property
    def restarted(self) -> bool:
        """Whether a learner restarted past the run's start (state a replay keeps aside)."""
        return any(x.update > 0 or s > 0 or saved for x in self.merges
                   for _, s, saved in x.restarts)  # fmt: skip


class SimulatedTiming:
    """When things happen on `train_async`'s simulated clock: the schedule's syncs, the
    boundary at which each learner applies a merge, the steps and pushes made by then."""

    def __init__(self, spec: DecoupledDiLoCo, step_seconds: tuple, inner_steps: int,
                 num_syncs: int):  # fmt: skip
        self.spec, self.seconds, self.inner_steps = spec, step_seconds, inner_steps
        self.syncs = spec.schedule(step_seconds, inner_steps, num_syncs)

    def boundary(self, sync: Sync, learner: int) -> int:
        """The learner's first step boundary at or after the merge."""
        s = self.seconds[learner]
        boundary = steps_by(sync.time, s)
        return boundary + 1 if boundary * s < sync.time else boundary

    def total_steps(self, sync: Sync) -> int:
        return sum(steps_by(sync.time, s) for s in self.seconds)

    def restarts(self, sync: Sync) -> tuple:
        return ()  # the simulated clock's learners never die

    def origin(self, sync: Sync, learner: int) -> None:
        return None

    def pushes_of(self, learner: int, origin: tuple, after: int) -> list:
        return []

    def snapshots(self) -> set[tuple[int, int]]:
        return set()

    restarted = False

    def pushes(self, sync: Sync, learner: int) -> list[int]:
        """The learner's pushes of each fragment by the merge's time."""
        fragments = self.spec.fragments
        return [
            _pushes_by(sync.time, self.seconds[learner], q, fragments, self.inner_steps)
            for q in range(fragments)
        ]


def steps_by(time: float, seconds: float) -> int:
    """Inner steps a learner of `seconds` per step has completed at `time` (step j ends at
    j x seconds, computed as the schedule computes it)."""
    j = math.floor(time / seconds)
    while (j + 1) * seconds <= time:
        j += 1
    while j > 0 and j * seconds > time:
        j -= 1
    return j


def _pushes_by(time: float, seconds: float, fragment: int, fragments: int, inner_steps: int):
    """Pushes of `fragment` a learner of `seconds` per step has made by `time`."""
    first = (fragment + 1) * (inner_steps // fragments)
    count = 0
    while (count * inner_steps + first) * seconds <= time:
        count += 1
    return count


def _data(data: Any, num_workers: int, inner_steps: int, where: Any):
    """(round, learner, step) -> that step's data on the learner's devices (`where`): its
    placed `WorkerSampler`, or rounds[round][learner, step] with a leading step dim of 1."""
    if isinstance(data, Sampler):
        sampler_lib.check_workers(data, num_workers)
        placed = [where.sampler(sampler_lib.for_worker(data, m), m) for m in range(num_workers)]
        return lambda job, m, h: placed[m]
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise ValueError(
            "data must be a Sampler or an indexable sequence of rounds (leaves [M, H, ...]), "
            f"got {type(data).__name__}"
        )
    lead = (num_workers, inner_steps)

    @functools.lru_cache(maxsize=4)
    def round_of(job):
        if job >= len(data):
            raise ValueError(f"data has {len(data)} rounds; a learner reached round {job + 1}")
        batch = data[job]
        for leaf in jax.tree.leaves(batch):
            if tuple(np.shape(leaf))[:2] != lead:
                raise ValueError(
                    f"data round {job}: every leaf must have leading dims [num_workers, "
                    f"inner_steps] = {lead}, got shape {np.shape(leaf)}"
                )
        return jax.tree.map(np.asarray, batch)

    return lambda job, m, h: where.batch(jax.tree.map(lambda x: x[m, h : h + 1], round_of(job)), m)

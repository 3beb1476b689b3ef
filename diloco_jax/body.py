"""The round body: one DiLoCo round on one device's k workers, composed of the roles its
method's parts call for (`diloco_jax.plan` builds them; `diloco_jax.carry` names what they
pass on).

The body is the same for every method: each segment of inner steps between the schedule's
boundaries, then at each sync that falls there

1. the workers' deltas (`Plan.delta`: against θ, or under eager updates against their own),
2. their weights (`Plan.weights`: 1 each, or the faults part's rule),
3. the sync itself (`Plan.sync`: exchange and outer update now, a delayed or eager update,
   or the ZeRO split), which also merges the result back into the workers,
4. the weights' bookkeeping (a left-out worker's restore),

and after the last sync the model state's merge. Which role fills each point is decided
when the plan is built; the body has no branch on a method option.

The round's own standard roles live here: deltas against θ (`DeltaFromTheta`) and the
immediate sync (`SyncNow`).
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from diloco_jax.carry import Carry, Context, Role, Segment, SyncRole, Weighed, Workers
from diloco_jax.outer import mean_norm, outer_update, worker_delta
from diloco_jax.schedule import Sync, leaf_indices, part


class Plan(NamedTuple):
    """The roles one round runs (see the module docstring). `roles` holds every role once, in
    the order their `begin` and `end` run; the named ones are among them."""

    segments: tuple[Segment, ...]
    starts: Role  # .start(c, ctx, theta) -> (start params, their vmap axis: 0 or None)
    steps: Role  # .run(c, ctx, start params, axis, start, stop) -> Carry
    delta: Role  # .delta(c, ctx, sync, snapshot_k) -> (delta_k, Carry)
    weights: Role  # .weigh / .after_sync / .metrics (`diloco_jax.faults`)
    sync: Role  # .apply(c, ctx, sync, delta_k, weighed) -> Carry; .grad_norm(c)
    model: Role  # .merge(c, ctx) -> Carry, after the last sync
    roles: tuple[Role, ...]
    fragmented: bool  # Streaming DiLoCo's: the outer state is a tuple of one per fragment


class Shared(NamedTuple):
    """The round's inputs that are the same on every worker: θ (a tree, None under eager
    updates), the outer states (a tuple, one per sync), the shared data, the round counter,
    and each role's shared state half, by name."""

    theta: Any
    outer: Any
    data: Any
    round: Any
    parts: dict


class Local(NamedTuple):
    """The round's per-worker inputs, leaves [M, ...]: the workers' inner and model states,
    the outer states' per-worker halves (`SyncRole.outer_in`), data, indices, the weights
    part's round inputs and each role's per-worker state half, by name."""

    opt: Any
    model: Any
    outer: Any
    data: Any
    ids: Any
    inputs: Any
    parts: dict


class SharedOut(NamedTuple):
    """What the round returns that is the same on every worker."""

    theta: Any
    outer: Any
    grad_norm: Any
    metrics: dict
    parts: dict


class LocalOut(NamedTuple):
    """What the round returns per worker, leaves [M, ...]: losses and aux [M, H]."""

    opt: Any
    model: Any
    outer: Any
    losses: Any
    aux: Any
    metrics: dict
    parts: dict


def round_body(shared: Shared, local: Local, collectives, *, plan: Plan, treedef, num_workers):
    """One round on this device's k workers (`Backend.map_workers`' body)."""
    num_local = jax.tree.leaves((local.opt, local.data))[0].shape[0]
    workers = Workers(None, local.opt, local.model)
    ctx = Context(
        round=shared.round,
        collectives=collectives,
        treedef=treedef,
        num_workers=num_workers,
        num_local=num_local,
        data=shared.data,
        data_k=local.data,
        ids_k=local.ids,
        inputs_k=local.inputs,
        outer_k=local.outer,
        start=workers,
        shared=shared.parts,
        local=local.parts,
    )
    theta = plan.sync.theta_in(shared.theta, treedef)
    c = Carry(
        workers=workers,
        theta=theta,
        outer=plan.sync.outer_carried(shared.outer),
        snapshots={},
        losses=(),
        auxes=(),
        own={},
    )
    for role in plan.roles:
        c = role.begin(c, ctx)
    for segment in plan.segments:
        start, axis = plan.starts.start(c, ctx, shared.theta)
        c = plan.steps.run(c, ctx, start, axis, segment.start, segment.stop)
        snapshots = dict(c.snapshots)
        for sync in segment.snapshots:
            snapshots[sync.index] = jax.tree.leaves(c.workers.params)
        c = c._replace(snapshots=snapshots)
        for sync in segment.syncs:
            c = _sync(plan, c, ctx, sync)
    c = plan.model.merge(c, ctx)
    return _outputs(plan, c, ctx)


def _sync(plan: Plan, c: Carry, ctx: Context, sync: Sync) -> Carry:
    """One sync: deltas, weights, the sync's role, the weights' bookkeeping."""
    snapshots = dict(c.snapshots)
    snapshot_k = part(sync, snapshots.pop(sync.index), ctx.treedef)
    c = c._replace(snapshots=snapshots)
    delta_k, c = plan.delta.delta(c, ctx, sync, snapshot_k)
    weighed, c = plan.weights.weigh(c, ctx, sync, delta_k)
    c = plan.sync.apply(c, ctx, sync, delta_k, weighed)
    return plan.weights.after_sync(c, ctx, weighed)


def _outputs(plan: Plan, c: Carry, ctx: Context) -> tuple[SharedOut, LocalOut]:
    halves = {role.name: role.end(c, ctx) for role in plan.roles}
    shared_parts = {name: h[0] for name, h in halves.items() if h[0] is not None}
    local_parts = {name: h[1] for name, h in halves.items() if h[1] is not None}
    losses_kxH = _along_steps(c.losses)
    aux_kxH = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *c.auxes)
    shared_metrics, local_metrics = plan.weights.metrics(c, ctx)
    theta = plan.sync.theta_out(c, ctx.treedef)
    same = SharedOut(
        theta=theta,
        outer=c.outer,
        grad_norm=plan.sync.grad_norm(c),
        metrics=shared_metrics,
        parts=shared_parts,
    )
    mine = LocalOut(
        opt=c.workers.opt,
        model=c.workers.model,
        outer=plan.sync.local_outer(c),
        losses=losses_kxH,
        aux=aux_kxH,
        metrics=local_metrics,
        parts=local_parts,
    )
    return same, mine


def _along_steps(losses: tuple) -> jax.Array:
    """The segments' losses [k, S] as one [k, H] (a single segment as it is)."""
    return losses[0] if len(losses) == 1 else jnp.concatenate(losses, axis=1)


class DeltaFromTheta(Role):
    """Δ_m = θ - θ_m of the sync's leaves, θ as the memory role has it for the delta."""

    name = "delta"

    def __init__(self, memory: Role):
        self.memory = memory

    def delta(self, c: Carry, ctx: Context, sync: Sync, snapshot_k: Any) -> tuple[Any, Carry]:
        old = part(sync, c.theta, ctx.treedef)
        base = self.memory.delta_base(old, snapshot_k, ctx.collectives)
        return jax.vmap(worker_delta, in_axes=(None, 0))(base, snapshot_k), c


class SyncNow(SyncRole):
    """The standard sync: the exchange averages the deltas (the compression part's
    `exchange.ExchangeRole`), the outer optimizer applies the mean to θ's synced leaves
    (through the weights part, which leaves them as they are when no worker is included),
    and the schedule's merge role sets the workers' params. Keeps each sync's mean for the
    round's "outer_grad_norm"."""

    name = "sync"

    def __init__(
        self, outer_optimizer, exchange: Role, memory: Role, weights: Role, merge: Role, age=None
    ):
        # `age`: the rounds the applied mean waited (a delay's d; None: none).
        self.apply_outer = functools.partial(outer_update, outer_optimizer, age=age)
        self.exchange, self.memory, self.weights, self.merge = exchange, memory, weights, merge

    def begin(self, c: Carry, ctx: Context) -> Carry:
        return c.with_own(self.name, ())

    def apply(self, c: Carry, ctx: Context, sync: Sync, delta_k: Any, weighed: Weighed) -> Carry:
        mean, weight_sum, c = self.exchange.exchange(c, ctx, sync, delta_k, weighed)
        c = c.with_own(self.name, (*c.own[self.name], mean))
        old = part(sync, c.theta, ctx.treedef)
        old, outer, c = self.memory.for_update(c, sync, old, c.outer[sync.index], mean)
        new, new_outer, c = self.weights.unless_empty(
            c, ctx, self.apply_outer, old, outer, mean, weight_sum
        )
        c = c.with_outer(sync.index, new_outer)
        c = c.with_theta(leaf_indices(sync, len(c.theta)), jax.tree.leaves(new))
        return self.merge.merge(c, ctx, sync, weighed, mean)

    def grad_norm(self, c: Carry) -> jax.Array:
        return mean_norm(c.own[self.name])

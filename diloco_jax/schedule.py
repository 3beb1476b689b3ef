"""When a round syncs what: the schedule part of `diloco_round`.

A round of H inner steps is a schedule of syncs. Standard DiLoCo is one sync of every leaf
after step H. Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) splits the params
into P fragments (S = H / P steps apart, fragment p = 0..P-1):
- right after inner step (p + 1) S - tau, every worker snapshots the fragment's values θ_m,p;
- right after inner step (p + 1) S, the fragment syncs: Δ_p = θ_p - snapshot is averaged over
  the workers and fed to the fragment's own outer optimizer state (initialised on its leaves,
  advancing only at its syncs), giving θ_p'; every worker then sets the fragment to
  θ_p' + alpha (θ_m,p - θ_p') with θ_m,p its values at the sync.
Fragments not being synced keep training; there is no reset at the round boundary, so every
worker's params persist in the state. P = 1, tau = 0, alpha = 0 is standard DiLoCo. This is
the schedule of torchft's DiLoCo with fragment_sync_delay and fragment_update_alpha.
"""

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from diloco_jax.carry import Carry, Context, Part, Role, Segment, SyncRole
from diloco_jax.outer import worker_delta
from diloco_jax.workers import stack_workers


@dataclasses.dataclass(frozen=True)
class Streaming(Part):
    """The schedule part of a `DiLoCo` spec: Streaming DiLoCo's P fragments, each delta taken
    `overlap_steps` (tau, 0 <= tau < H / P) before its sync and merged with `merge_alpha`
    (alpha in [0, 1]). `fragments` is an int P >= 1 (leaf i -> fragment i % P) or a pytree of
    ints with the params' structure covering 0..P-1 (kept frozen: the spec stays hashable;
    `assignment` gives the pytree back). What needs the params or H (P at most the number of
    leaves, H a multiple of P, tau < H / P) is checked by `make_schedule`."""

    fragments: Any
    overlap_steps: int = 0
    merge_alpha: float = 0.0

    def __post_init__(self):
        fragments = self.fragments
        if isinstance(fragments, bool) or fragments is None:
            raise ValueError(
                f"Streaming.fragments must be an int >= 1 or a pytree of ints, got {fragments!r}"
            )
        if isinstance(fragments, int):
            if fragments < 1:
                raise ValueError(f"Streaming.fragments must be an int >= 1, got {fragments}")
        elif not isinstance(fragments, _FrozenTree):
            leaves, treedef = jax.tree.flatten(fragments)
            if not leaves or not all(
                isinstance(f, int) and not isinstance(f, bool) for f in leaves
            ):
                raise ValueError(f"Streaming.fragments pytree must hold ints, got {fragments!r}")
            if sorted(set(leaves)) != list(range(max(leaves) + 1)) or min(leaves) < 0:
                raise ValueError(
                    f"Streaming.fragments indices must cover 0..P-1, got {sorted(set(leaves))}"
                )
            object.__setattr__(self, "fragments", _FrozenTree(tuple(leaves), treedef))
        tau = self.overlap_steps
        if isinstance(tau, bool) or not isinstance(tau, int) or tau < 0:
            raise ValueError(f"Streaming.overlap_steps must be an int >= 0, got {tau!r}")
        alpha = self.merge_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float):
            raise ValueError(f"Streaming.merge_alpha must be a number in [0, 1], got {alpha!r}")
        if math.isnan(alpha) or not 0 <= alpha <= 1:
            raise ValueError(f"Streaming.merge_alpha must be in [0, 1], got {alpha!r}")
        object.__setattr__(self, "merge_alpha", float(alpha))

    def initial(self, params: Any, outer_state: Any, num_workers: int, method: Any) -> dict:
        """Every worker's own params (`WorkerParams`): θ to start with."""
        return {WORKER_PARAMS: WorkerParams(stack_workers(params, num_workers))}

    def fingerprint(self) -> dict:
        return {"fragments": repr((self.assignment, self.overlap_steps, self.merge_alpha))}

    def plan(self, build: Any, roles: dict) -> None:
        """Workers continue from their own params, each sync merging into them."""
        roles["merge"] = MergeIntoOwn(build.schedule.merge_alpha, roles["memory"])
        roles["starts"] = OwnParams()

    @property
    def assignment(self) -> Any:
        """`fragments` as `fragment_of` takes it: the int P, or the pytree of indices."""
        f = self.fragments
        return jax.tree.unflatten(f.treedef, f.leaves) if isinstance(f, _FrozenTree) else f


class _FrozenTree(NamedTuple):
    """A pytree of ints held as its leaves and structure (hashable, with a stable repr)."""

    leaves: tuple[int, ...]
    treedef: Any

    def __repr__(self) -> str:
        return repr(jax.tree.unflatten(self.treedef, self.leaves))


class Sync(NamedTuple):
    """One sync of a round.

    index: p, the fragment (its outer state and its row of the drop draws); 0 when unfragmented.
    leaves: indices into `jax.tree.leaves(params)` of what syncs, or None for every leaf taken
      as the params tree itself (standard DiLoCo: the outer optimizer sees the caller's tree).
    snapshot: inner steps done when the workers snapshot what they will send (sync - tau).
    at: inner steps done when the sync happens.
    """

    index: int
    leaves: tuple[int, ...] | None
    snapshot: int
    at: int


class Schedule(NamedTuple):
    """A round's syncs (in order) and how synced values merge into each worker's params.

    fragmented: whether the run uses Streaming DiLoCo's fragments (every worker's params then
      persist across rounds in `WorkerParams`, and the outer state is a tuple of
      one state per fragment).
    merge_alpha: alpha in [0, 1]; 0 sets a synced fragment to the new global values.
    """

    syncs: tuple[Sync, ...]
    fragmented: bool
    merge_alpha: float

    def boundaries(self, inner_steps: int) -> tuple[int, ...]:
        """The step counts at which the inner loop pauses (0, every snapshot and sync, H)."""
        points = {0, inner_steps}
        for sync in self.syncs:
            points |= {sync.snapshot, sync.at}
        return tuple(sorted(points))


def fragment_of(params: Any, fragments: Any) -> tuple[int, ...]:
    """Each leaf's fragment index, in `jax.tree.leaves(params)` order.

    `fragments` is an int P >= 1 (leaf i goes to fragment i % P, the strided assignment the
    paper recommends; P at most the number of leaves), or a pytree of ints with the params'
    structure whose values cover 0..P-1. Raises ValueError naming `fragments`.
    """
    leaves = jax.tree.leaves(params)
    if isinstance(fragments, int) and not isinstance(fragments, bool):
        if not 1 <= fragments <= len(leaves):
            raise ValueError(
                "Streaming.fragments must be between 1 and the number of param leaves "
                f"{len(leaves)}, got {fragments}"
            )
        return tuple(i % fragments for i in range(len(leaves)))
    try:
        indices = jax.tree.leaves(jax.tree.map(lambda _, f: f, params, fragments))
    except (ValueError, TypeError):
        raise ValueError(
            "fragments must be an int >= 1 or a pytree of ints with the params' structure"
        ) from None
    if not all(isinstance(f, int) and not isinstance(f, bool) for f in indices):
        raise ValueError(f"fragments pytree must hold ints, got {indices}")
    if sorted(set(indices)) != list(range(max(indices) + 1)) or min(indices) < 0:
        raise ValueError(f"fragments indices must cover 0..P-1, got {sorted(set(indices))}")
    return tuple(indices)


def check_schedule(num_fragments: int, inner_steps: int, overlap_steps: int) -> None:
    """Raises ValueError naming the field for a Streaming part that can't run with H inner
    steps (its own fields are checked when it is built)."""
    if inner_steps % num_fragments:
        raise ValueError(
            f"inner_steps={inner_steps} must be a multiple of the number of fragments "
            f"{num_fragments} (Streaming.fragments)"
        )
    per_fragment = inner_steps // num_fragments
    if not overlap_steps < per_fragment:
        raise ValueError(
            f"Streaming.overlap_steps must be in [0, inner_steps / fragments = {per_fragment}), "
            f"got {overlap_steps}"
        )


def make_schedule(
    params: Any, inner_steps: int, streaming: "Streaming | None" = None, frozen: tuple = ()
) -> Schedule:
    """The round's schedule: one sync of every leaf after H steps when `streaming` is None,
    else Streaming DiLoCo's (see the module docstring). `frozen` leaves (indices into the
    params' leaves, see `diloco_jax.trainable`) are in no sync. Raises ValueError naming the
    field of `streaming` that can't run with these params and H."""
    num_leaves = len(jax.tree.leaves(params))
    if streaming is None:
        synced = None if not frozen else tuple(i for i in range(num_leaves) if i not in frozen)
        return Schedule((Sync(0, synced, inner_steps, inner_steps),), False, 0.0)
    frags = fragment_of(params, streaming.assignment)
    num_fragments = max(frags) + 1
    check_schedule(num_fragments, inner_steps, streaming.overlap_steps)
    per_fragment = inner_steps // num_fragments
    syncs = []
    for p in range(num_fragments):
        leaves = tuple(i for i, f in enumerate(frags) if f == p and i not in frozen)
        if not leaves:
            raise ValueError(f"trainable freezes every leaf of fragment {p} (Streaming.fragments)")
        syncs.append(
            Sync(
                p, leaves, (p + 1) * per_fragment - streaming.overlap_steps, (p + 1) * per_fragment
            )
        )
    return Schedule(tuple(syncs), True, streaming.merge_alpha)


def synced_groups(params: Any, streaming: "Streaming | None", frozen: tuple = ()) -> list[list]:
    """The leaves of `params` each sync of a round exchanges, in sync order (one group of
    every leaf without fragments); `frozen` leaves are in none."""
    leaves = jax.tree.leaves(params)
    return [[leaves[i] for i in group] for group in synced_indices(params, streaming, frozen)]


def synced_indices(params: Any, streaming: "Streaming | None", frozen: tuple = ()) -> list:
    """`synced_groups` as leaf indices (into `jax.tree.leaves(params)`)."""
    n = len(jax.tree.leaves(params))
    if streaming is None:
        return [tuple(i for i in range(n) if i not in frozen)]
    frags = fragment_of(params, streaming.assignment)
    return [
        tuple(i for i, f in enumerate(frags) if f == p and i not in frozen)
        for p in range(max(frags) + 1)
    ]


def part(schedule_sync: Sync, leaves: list, treedef: Any) -> Any:
    """What `schedule_sync` exchanges of a list of per-leaf values: the params tree itself
    for an unfragmented sync, else the list of its leaves."""
    if schedule_sync.leaves is None:
        return jax.tree.unflatten(treedef, leaves)
    return [leaves[i] for i in schedule_sync.leaves]


def leaf_indices(schedule_sync: Sync, num_leaves: int) -> tuple[int, ...]:
    """The leaf indices `schedule_sync` covers."""
    return tuple(range(num_leaves)) if schedule_sync.leaves is None else schedule_sync.leaves


class WorkerParams(NamedTuple):
    """The schedule's state (`DiLoCoState.parts["workers"]`) when workers carry their own
    params from sync to sync (Streaming DiLoCo, drops): each worker's params, leaves
    [M, ...] in the params' dtypes."""

    params: Any

    PER_WORKER = ("params",)


def segments(schedule: Schedule, inner_steps: int) -> tuple:
    """The round's segments of inner steps (`body.Segment`), from the schedule's boundaries:
    each with the syncs that snapshot and that happen at its end."""
    bounds = schedule.boundaries(inner_steps)
    return tuple(
        Segment(
            start,
            stop,
            tuple(s for s in schedule.syncs if s.snapshot == stop),
            tuple(s for s in schedule.syncs if s.at == stop),
        )
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True)
    )


class FromTheta(Role):
    """Every worker starts the round's one segment from θ (standard DiLoCo), fetched by the
    memory role where θ lives (`diloco_jax.offload`)."""

    name = "starts"

    def __init__(self, memory: Role):
        self.memory = memory

    def start(self, c: Carry, ctx: Context, theta: Any) -> tuple[Any, Any]:
        return ctx.collectives.vary(self.memory.fetch(theta)), None


class OwnParams(Role):
    """Every worker starts each segment from its own params (they persist across syncs:
    Streaming DiLoCo, drops, eager updates)."""

    name = "starts"

    def start(self, c: Carry, ctx: Context, theta: Any) -> tuple[Any, Any]:
        return c.workers.params, 0


class OwnThetaSync(SyncRole):
    """The base of a sync under which each worker holds its own θ_m and outer state (eager
    updates, NoLoCo): no global θ nor global outer state, and each worker's delta taken
    against its own θ_m, which the subclass keeps as `c.own[name].theta` (a tuple of leaves
    [k, ...])."""

    def theta_in(self, theta: Any, treedef: Any) -> None:
        return None

    def theta_out(self, c: Carry, treedef: Any) -> None:
        return None

    def outer_carried(self, shared: Any) -> None:
        return None

    def delta(self, c: Carry, ctx: Context, sync: "Sync", snapshot_k: Any) -> tuple[Any, Carry]:
        old_k = part(sync, c.own[self.name].theta, ctx.treedef)
        return jax.vmap(worker_delta)(old_k, snapshot_k), c


class RestartFromTheta(Role):
    """Standard DiLoCo: after the sync every worker restarts the next round from θ, so
    nothing merges back into its params."""

    name = "merge"

    def merge(self, c: Carry, ctx: Any, sync: Sync, weighed: Any, mean: Any) -> Carry:
        return c


class MergeIntoOwn(Role):
    """Workers carry their own params (`WorkerParams`): after a sync its leaves become
    θ' + alpha (θ_m - θ') (θ' for alpha 0), except that a dropped worker keeps its own and a
    worker left out as non-finite restarts every leaf from θ (the weights part's verdict)."""

    name = "workers"  # its state: `WorkerParams`, `DiLoCoState.parts["workers"]`

    def __init__(self, alpha: float, memory: Role):
        self.alpha, self.memory = alpha, memory

    def begin(self, c: Carry, ctx: Any) -> Carry:
        params = ctx.local[self.name].params
        return c._replace(workers=c.workers._replace(params=params))

    def merge(self, c: Carry, ctx: Any, sync: Sync, weighed: Any, mean: Any) -> Carry:
        local_leaves = ctx.treedef.flatten_up_to(c.workers.params)
        merge_from = self.memory.merge_source(c, c.theta, mean)
        params_k = merged(
            local_leaves, merge_from, leaf_indices(sync, len(local_leaves)), self.alpha,
            weighed.finite_k, weighed.dropped_k, ctx.treedef, ctx.collectives.vary,
        )  # fmt: skip
        return c._replace(workers=c.workers._replace(params=params_k))

    def end(self, c: Carry, ctx: Any) -> tuple[Any, Any]:
        return None, WorkerParams(c.workers.params)


WORKER_PARAMS = "workers"  # `MergeIntoOwn`'s state in `DiLoCoState.parts`


def merged(
    local_leaves, global_leaves, indices, alpha, finite_k, dropped_k, treedef, vary,
    per_worker=False,
):  # fmt: skip
    """Each worker's params after a sync of the leaves `indices`: the synced leaves become
    θ' + alpha (θ_m - θ') (θ' for alpha 0), except that a dropped worker keeps its own; a
    non-finite worker (finite_k False) restarts every leaf from the current global values.
    finite_k / dropped_k are None without fault options. `vary` types θ' copies as
    per-worker: inner steps from a value typed shared would sum their gradients over workers.
    `per_worker`: the global leaves are each worker's own θ' ([k, ...], eager updates)."""
    leaves = list(local_leaves)
    for i in indices:
        at_sync = leaves[i]
        new = global_leaves[i] if per_worker else global_leaves[i][None]
        if alpha:
            value = (new + alpha * (at_sync - new)).astype(at_sync.dtype)
        elif per_worker:
            value = new.astype(at_sync.dtype)
        else:
            value = vary(jnp.broadcast_to(new.astype(at_sync.dtype), at_sync.shape))
        if dropped_k is not None:
            value = where_k(dropped_k, at_sync, value)
        leaves[i] = value
    if finite_k is not None:
        leaves = [
            where_k(finite_k, x, g[None].astype(x.dtype))
            for x, g in zip(leaves, global_leaves, strict=True)
        ]
    return jax.tree.unflatten(treedef, leaves)


def where_k(mask_k, on_true_k, on_false):
    """Per worker: `on_true_k` ([k, ...]) where mask_k ([k]) holds, else `on_false`."""
    mask = mask_k.reshape(mask_k.shape + (1,) * (on_true_k.ndim - 1))
    return jnp.where(mask, on_true_k, on_false)

"""ZeRO-1 across workers (`shard_outer_over_workers=True`): the outer optimizer state split
over the worker axis, so each worker's devices hold 1/M of it.

Each param leaf's outer state is split along one dim d (`shard_dim`: the first dim whose
size divides by M times the ways the leaf's own spec already splits it), worker m keeping
slice m of every shard its devices hold. At a sync, instead of one all-reduce of the deltas,
each device reduce-scatters its shard of the delta sum over the workers (its slice of the
mean), updates its slice of θ with its slice of the outer state, and all-gathers the new
slice over the workers: the two halves of a ring all-reduce, so the same bytes on the wire.
The sync runs manual over every mesh axis (a `shard_map` over the worker's own axes nested
in the workers' one), so the collectives carry shards only: XLA's partitioner replicates a
reduce-scatter or all-gather over the automatic axes otherwise.

A leaf with no such dim (a scalar, a bias whose size M doesn't divide) keeps its outer state
replicated over workers and syncs by all-reduce, as without this option. The outer rule then
runs on slices, so it must be per coordinate (SGD, Nesterov, Adam, their bf16-state and
momentum-restart forms): `check_per_coordinate` refuses one that mixes coordinates (a
global-norm clip, an orthogonalisation).

In storage (the state's arrays between rounds) the outer state keeps the params' shapes, at
the leaf's spec with the worker axis added at dim d (after the axes already there, the
order the per-device slices come in), so checkpoints are those of a replicated outer state
and restore onto any layout. Inside the round each split leaf travels as [M, ...] with dim d
cut to its 1/M (`to_workers` / `from_workers`: no data moves).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from diloco_jax.carry import Carry, Role, SyncRole
from diloco_jax.outer import outer_update
from diloco_jax.schedule import leaf_indices, part
from diloco_jax.workers import WORKER_AXIS


class OuterShards(NamedTuple):
    """Where each param leaf's outer state is split (hashable: a static option of the round).

    dims: per param leaf (`jax.tree.leaves` order), the dim split over the workers, or None
      (replicated over workers). specs: each leaf's `PartitionSpec` over the worker's own
      axes. ways: how many ways that spec already splits dim d (1 where it doesn't).
    inner_axes: the mesh's non-worker axes (the sync runs manual over them too).
    num_workers: M.
    """

    dims: tuple[int | None, ...]
    specs: tuple[P, ...]
    ways: tuple[int, ...]
    inner_axes: tuple[str, ...]
    num_workers: int

    def storage_spec(self, index: int) -> P:
        """The spec of param leaf `index`'s outer state between rounds (worker axis added)."""
        return storage_spec(self.specs[index], self.dims[index])


def split_shapes(
    shapes: "list[tuple[int, ...]]", specs: "tuple[P, ...]", sizes: dict[str, int], num_workers: int
) -> OuterShards:
    """The split of each leaf of `shapes` at `specs` (over the axes of `sizes`, the mesh's
    axis sizes, the worker axis among them) for M = `num_workers` >= 2 workers."""
    dims, ways = [], []
    for shape, spec in zip(shapes, specs, strict=True):
        dim = shard_dim(shape, spec, sizes, num_workers)
        dims.append(dim)
        ways.append(1 if dim is None else _ways(spec, dim, sizes))
    inner = tuple(name for name in sizes if name != WORKER_AXIS)
    return OuterShards(
        dims=tuple(dims),
        specs=tuple(specs),
        ways=tuple(ways),
        inner_axes=inner,
        num_workers=num_workers,
    )


def shard_dim(shape: tuple[int, ...], spec: P, sizes: dict[str, int], num_workers: int):
    """The first dim of `shape` whose size divides by M x the ways `spec` splits it, or None."""
    for dim, size in enumerate(shape):
        if size % (num_workers * _ways(spec, dim, sizes)) == 0:
            return dim
    return None


def storage_spec(spec: P, dim: int | None) -> P:
    """`spec` with the worker axis added (last) at `dim`; `spec` itself for None."""
    if dim is None:
        return spec
    entries = list(spec) + [None] * (dim + 1 - len(spec))
    names = _names(entries[dim])
    entries[dim] = (*names, WORKER_AXIS) if names else WORKER_AXIS
    return P(*entries)


def to_workers(x: jax.Array, dim: int, ways: int, num_workers: int) -> jax.Array:
    """A split leaf in storage, [..., n, ...] (n at `dim`), as [M, ..., n / M, ...]: worker
    m's slices of the `ways` shards of dim d, in order."""
    shape, n = x.shape, x.shape[dim]
    y = x.reshape(shape[:dim] + (ways, num_workers, n // (ways * num_workers)) + shape[dim + 1 :])
    y = jnp.moveaxis(y, dim + 1, 0)
    return y.reshape((num_workers,) + shape[:dim] + (n // num_workers,) + shape[dim + 1 :])


def from_workers(y: jax.Array, dim: int, ways: int) -> jax.Array:
    """The inverse of `to_workers`."""
    num_workers, shape = y.shape[0], y.shape[1:]
    n = shape[dim] * num_workers
    cut = (ways, n // (ways * num_workers))
    y = y.reshape((num_workers,) + shape[:dim] + cut + shape[dim + 1 :])
    y = jnp.moveaxis(y, 0, dim + 1)
    return y.reshape(shape[:dim] + (n,) + shape[dim + 1 :])


class SyncShards(NamedTuple):
    """One sync's view of `OuterShards`: its leaves' dims, specs and ways (in the order of the
    sync's leaves), and for each leaf of its outer state the sync leaf it belongs to (None:
    a leaf outside any params-like subtree, e.g. a count: replicated)."""

    dims: tuple[int | None, ...]
    specs: tuple[P, ...]
    ways: tuple[int, ...]
    owners: tuple[int | None, ...]
    state_treedef: Any
    inner_axes: tuple[str, ...]
    num_workers: int

    def state_dims(self) -> list[int | None]:
        return [None if o is None else self.dims[o] for o in self.owners]

    def state_specs(self) -> list[P]:
        return [P() if o is None else self.specs[o] for o in self.owners]

    def split(self, state: Any) -> tuple[list, list]:
        """An outer state in storage as (replicated leaves, split leaves [M, ...]), each a list
        with None where the leaf is in the other."""
        shared, local = [], []
        for x, o in zip(jax.tree.leaves(state), self.owners, strict=True):
            dim = None if o is None else self.dims[o]
            shared.append(x if dim is None else None)
            local.append(
                None if dim is None else to_workers(x, dim, self.ways[o], self.num_workers)
            )
        return shared, local

    def joined(self, shared: list, local: list) -> Any:
        """`split`'s inverse, for the storage form (local leaves [M, ...])."""
        leaves = [
            s if o is None or self.dims[o] is None else from_workers(x, self.dims[o], self.ways[o])
            for s, x, o in zip(shared, local, self.owners, strict=True)
        ]
        return jax.tree.unflatten(self.state_treedef, leaves)


def sync_shards(shards: OuterShards, like: Any, indices: tuple[int, ...], state: Any) -> SyncShards:
    """The `SyncShards` of a sync over the param leaves `indices` (`like`: the sync's
    params-like tree or list, shapes), with outer state `state` (shapes)."""
    like_leaves, like_treedef = jax.tree.flatten(like)
    shapes = [tuple(x.shape) for x in like_leaves]

    def params_like(x):
        leaves, structure = jax.tree.flatten(x, is_leaf=_masked)
        return structure == like_treedef and all(
            _masked(v) or tuple(np.shape(v)) == s for v, s in zip(leaves, shapes, strict=True)
        )

    owners = []
    for sub in jax.tree.leaves(state, is_leaf=lambda x: _masked(x) or params_like(x)):
        if _masked(sub):
            continue
        if params_like(sub):
            leaves = jax.tree.flatten(sub, is_leaf=_masked)[0]
            owners.extend(j for j, v in enumerate(leaves) if not _masked(v))
        else:
            owners.append(None)
    pick = lambda values: tuple(values[i] for i in indices)  # noqa: E731
    return SyncShards(
        dims=pick(shards.dims),
        specs=pick(shards.specs),
        ways=pick(shards.ways),
        owners=tuple(owners),
        state_treedef=jax.tree.structure(state),
        inner_axes=shards.inner_axes,
        num_workers=shards.num_workers,
    )


def sync_step(
    sync: SyncShards,
    outer_optimizer: optax.GradientTransformation,
    old: Any,
    shared: list,
    local_k: list,
    sums: Any,
    weight_total: jax.Array | None,
) -> tuple[Any, list, list, jax.Array]:
    """The outer step of one sync on a device, inside the workers' map (one worker per device).

    old: θ's sync leaves (same on every worker); shared / local_k: the outer state as
    `SyncShards.split` gives it (local leaves [1, ...]); sums: this device's worker's delta
    (weighted: its `where(included, w Δ, 0)`), leaves like `old` in the delta dtype;
    weight_total: the float32 sum of the included workers' weights (None: unweighted, the
    mean divides by M). Returns (new θ leaves like `old`, new shared, new local_k, float32
    squared L2 norm of the mean delta). A weighted sync whose weights sum to 0 leaves θ and
    its outer state unchanged (the caller's select), its mean zeros.
    """
    num_workers = sync.num_workers
    old_leaves, treedef = jax.tree.flatten(old)
    sum_leaves = treedef.flatten_up_to(sums)
    local = [None if x is None else x[0] for x in local_k]

    def step(old_leaves, sum_leaves, shared, local, weight_total):
        worker = lax.axis_index(WORKER_AXIS)
        safe = None if weight_total is None else jnp.where(weight_total > 0, weight_total, 1.0)
        means, slices = [], []
        for x, s, dim in zip(old_leaves, sum_leaves, sync.dims, strict=True):
            if dim is None:
                total = lax.psum(s, WORKER_AXIS)
                slices.append(x)
            else:
                total = lax.psum_scatter(s, WORKER_AXIS, scatter_dimension=dim, tiled=True)
                size = x.shape[dim] // num_workers
                slices.append(lax.dynamic_slice_in_dim(x, worker * size, size, axis=dim))
            if safe is None:
                mean = (total / num_workers).astype(s.dtype)
            else:
                mean = jnp.where(weight_total > 0, total / safe.astype(s.dtype), 0).astype(s.dtype)
            means.append(mean)
        state = jax.tree.unflatten(
            sync.state_treedef,
            [x if y is None else y for x, y in zip(shared, local, strict=True)],
        )
        new, new_state = outer_update(
            outer_optimizer,
            jax.tree.unflatten(treedef, slices),
            state,
            jax.tree.unflatten(treedef, means),
        )
        new_leaves = []
        for x, dim in zip(jax.tree.leaves(new), sync.dims, strict=True):
            if dim is not None:
                x = lax.all_gather(x, WORKER_AXIS, axis=dim, tiled=True, to="invarying")
            new_leaves.append(x)
        state_leaves = jax.tree.leaves(new_state)
        new_shared = [x if y is None else None for x, y in zip(state_leaves, local, strict=True)]
        new_local = [None if y is None else x for x, y in zip(state_leaves, local, strict=True)]
        return new_leaves, new_shared, new_local, means

    if sync.inner_axes:  # manual over the worker's own axes too: collectives of shards only
        dims = sync.state_dims()
        specs = list(sync.specs)
        state_specs = sync.state_specs()
        shared_specs = [s if d is None else None for s, d in zip(state_specs, dims, strict=True)]
        local_specs = [None if d is None else s for s, d in zip(state_specs, dims, strict=True)]
        step = jax.shard_map(
            step,
            in_specs=(specs, specs, shared_specs, local_specs, P()),
            out_specs=(specs, shared_specs, local_specs, specs),
            axis_names=set(sync.inner_axes),
        )
    new_leaves, new_shared, new_local, means = step(
        old_leaves, sum_leaves, shared, local, weight_total
    )
    # The mean's squared norm: split leaves' slices differ per worker, the others are whole.
    split_sq = whole_sq = jnp.float32(0)
    for m, dim in zip(means, sync.dims, strict=True):
        sq = jnp.sum(jnp.square(m.astype(jnp.float32)))
        if dim is None:
            whole_sq = whole_sq + sq
        else:
            split_sq = split_sq + sq
    squared = lax.psum(split_sq, WORKER_AXIS) + whole_sq
    new_local_k = [None if x is None else x[None] for x in new_local]
    return jax.tree.unflatten(treedef, new_leaves), new_shared, new_local_k, squared


def transfers(num_syncs: int) -> list:
    """What splitting adds to a round's collectives, as (op, operand bytes, times): the split
    leaves' reduce-scatter and all-gather carry what their all-reduce did, and each sync
    all-reduces one float32 more, its slices' share of the mean delta's squared norm (the
    "outer_grad_norm" metric)."""
    return [("all-reduce", 4, num_syncs)]


# Primitives that keep a leaf's shape but move or mix its coordinates.
_MIXING = frozenset(
    {"transpose", "rev", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort",
     "gather", "scatter", "scatter-add", "scatter_add", "dynamic_slice", "dynamic_update_slice",
     "fft", "conv_general_dilated", "reduce_window_sum", "argsort", "top_k"}
)  # fmt: skip


def check_per_coordinate(outer_optimizer: optax.GradientTransformation, like: Any) -> None:
    """Raises ValueError (naming shard_outer_over_workers) unless `outer_optimizer`'s update
    of updates shaped like `like` treats every coordinate on its own: each operation of its
    traced program maps leaf-shaped arrays to leaf-shaped arrays coordinate by coordinate
    (scalars, such as counts and schedules, are free)."""
    state = jax.eval_shape(outer_optimizer.init, like)
    jaxpr = jax.make_jaxpr(outer_optimizer.update)(like, state, like)
    found = _mixing(jaxpr.jaxpr)
    if found is not None:
        raise ValueError(
            "shard_outer_over_workers needs an outer optimizer that updates each coordinate on "
            f"its own (it runs on 1/M slices of each leaf), but this one uses {found!r} across "
            "a leaf (e.g. a global-norm clip); drop the option or the transformation"
        )


def _mixing(jaxpr) -> str | None:
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found = _mixing(inner)
                    if found is not None:
                        return found
        if any(hasattr(getattr(v, "jaxpr", v), "eqns") for v in eqn.params.values()):
            continue  # a call: its body was checked
        sizes_in = [int(np.prod(v.aval.shape)) for v in eqn.invars if hasattr(v.aval, "shape")]
        shapes_in = {tuple(v.aval.shape) for v in eqn.invars if hasattr(v.aval, "shape")
                     and int(np.prod(v.aval.shape)) > 1}  # fmt: skip
        shapes_out = {tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")}
        if not shapes_in or max(sizes_in, default=1) <= 1:
            continue  # scalars only (counts, schedules), or a broadcast of one
        if eqn.primitive.name in _MIXING or len(shapes_in) > 1 or shapes_out != shapes_in:
            return eqn.primitive.name
    return None


def _ways(spec: P, dim: int, sizes: dict[str, int]) -> int:
    entry = spec[dim] if dim < len(spec) else None
    return int(np.prod([sizes[n] for n in _names(entry)], dtype=np.int64))


def _names(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def _masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


class SplitOuterSync(SyncRole):
    """The sync with the outer state split over the workers (see the module docstring): each
    device reduce-scatters its worker's contribution, updates its slice of θ with its slice
    of the outer state and all-gathers the result (`sync_step`). A sync that includes no
    worker leaves θ and both halves of its outer state as they were. Keeps each sync's
    squared mean-delta norm for "outer_grad_norm"."""

    name = "zero"

    def __init__(self, shards, outer_optimizer, exchange: Role, memory: Role, weights: Role,
                 merge: Role):  # fmt: skip
        self.shards, self.outer_optimizer = shards, outer_optimizer
        self.exchange, self.memory, self.weights, self.merge = exchange, memory, weights, merge

    def outer_in(self, outer: tuple) -> tuple[tuple, tuple]:
        """Each sync's outer state in storage as (the replicated leaves, every worker's split
        leaves [M, ...])."""
        halves = [s.split(o) for s, o in zip(self.shards, outer, strict=True)]
        return tuple(h[0] for h in halves), tuple(h[1] for h in halves)

    def outer_out(self, shared: tuple, local: tuple) -> tuple:
        return tuple(s.joined(a, b) for s, a, b in zip(self.shards, shared, local, strict=True))

    def local_outer(self, c: Carry) -> tuple:
        return c.own[self.name][0]

    def begin(self, c: Carry, ctx: Any) -> Carry:
        return c.with_own(self.name, (ctx.outer_k, ()))

    def apply(self, c: Carry, ctx: Any, sync: Any, delta_k: Any, weighed: Any) -> Carry:
        local, squares = c.own[self.name]
        sent_k = self.exchange.send(sync, delta_k, weighed)
        sent_k, weight_sum = self.weights.split_sent(sent_k, ctx.collectives)
        sums = jax.tree.map(lambda x: jnp.sum(x, 0), sent_k)
        old = part(sync, c.theta, ctx.treedef)
        old, shared, mine, c = self.memory.for_split_update(
            c, sync, old, c.outer[sync.index], local[sync.index], sums
        )
        new, new_shared, new_mine, squared = sync_step(
            self.shards[sync.index], self.outer_optimizer, old, shared, mine, sums, weight_sum
        )
        new_shared = self.weights.keep_if_empty(weight_sum, shared, new_shared)
        new_mine = self.weights.keep_if_empty(weight_sum, mine, new_mine)
        new = self.weights.keep_if_empty(weight_sum, old, new)
        c = self.weights.skip(c, weight_sum)
        local = (*local[: sync.index], new_mine, *local[sync.index + 1 :])
        c = c.with_own(self.name, (local, (*squares, squared)))
        c = c.with_outer(sync.index, new_shared)
        c = c.with_theta(leaf_indices(sync, len(c.theta)), jax.tree.leaves(new))
        return self.merge.merge(c, ctx, sync, weighed, None)

    def grad_norm(self, c: Carry) -> jax.Array:
        return jnp.sqrt(sum(c.own[self.name][1]))

"""Where every array of a run lives on the user's mesh: the params' shardings inside a worker,
and from them every state field's.

The mesh has one worker axis (M workers) and any other axes ("fsdp", "tensor", ...), which
partition each worker. A param leaf has a `PartitionSpec` over the non-worker axes; θ and the
outer state sit at that spec (replicated over workers), every per-worker field at
`P(workers, *spec)`. A state field's subtree that has the params' structure and shapes (an
optax state's `mu`, a residual, a delta in flight; optax's masked leaves of frozen params
included), or the list of one Streaming fragment's leaves, gets the params' specs leaf by leaf;
any other leaf (counts, weights, statistics) is replicated inside its worker.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_jax import delay, offload
from diloco_jax.outer_sharding import OuterShards, split_shapes
from diloco_jax.schedule import synced_indices
from diloco_jax.trainable import frozen_leaves
from diloco_jax.trees import per_leaf
from diloco_jax.workers import WORKER_AXIS, Backend, shard_shape


def map_fields(state: Any, fn: Callable[[type, str, Any, bool], Any]) -> Any:
    """`state` (a DiLoCoState or SyncState, of arrays or shapes) with each field replaced by
    `fn(owner, name, value, per_worker)`: `owner` the NamedTuple type the field belongs to
    (the state's, or a part state's in `DiLoCoState.parts`), `per_worker` whether its
    leaves hold one entry per worker, as the owner's `PER_WORKER` declares (the schema is
    declared once, on each state type; `round.split_state` reads the same declaration)."""
    per_worker = set(type(state).PER_WORKER)
    out = {}
    for name, value in state._asdict().items():
        if name == "parts":  # each part's own state, declaring its own fields
            out[name] = {key: map_fields(part, fn) for key, part in value.items()}
        else:
            out[name] = fn(type(state), name, value, name in per_worker)
    return type(state)(**out)


def resolve_param_specs(
    params: Any, mesh: Mesh, param_sharding: Any, option: str = "param_sharding"
) -> tuple[P, ...]:
    """One `PartitionSpec` per leaf of `params` (over the mesh's non-worker axes), from
    `param_sharding`: a pytree of specs like `params`, one spec for every leaf, a callable
    (path, leaf) -> spec, or None (each leaf's own `NamedSharding` spec when it names only this
    mesh's non-worker axes, else replicated). Raises ValueError naming the `option` for
    a spec naming a missing axis or the worker axis, an axis used twice, more dims than the
    leaf has, or a dim not divisible by its axes' size."""
    leaves_with_paths, _ = jax.tree_util.tree_flatten_with_path(params)
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    inner_axes = {name for name in mesh.axis_names if name != WORKER_AXIS}
    if param_sharding is None:
        specs = [_own_spec(leaf, inner_axes) for _, leaf in leaves_with_paths]
    elif isinstance(param_sharding, P):
        specs = [param_sharding] * len(leaves_with_paths)
    elif callable(param_sharding):
        specs = [param_sharding(path, leaf) for path, leaf in leaves_with_paths]
    else:
        specs = per_leaf(
            params,
            param_sharding,
            f"{option} must be a pytree of PartitionSpecs with the arrays' structure, one "
            f"PartitionSpec, or a callable (path, leaf) -> PartitionSpec; got {param_sharding!r}",
        )
    out = []
    for (path, leaf), spec in zip(leaves_with_paths, specs, strict=True):
        spec = P() if spec is None else spec
        where = jax.tree_util.keystr(path)
        if not isinstance(spec, P):
            raise ValueError(f"{option}{where} must be a PartitionSpec, got {spec!r}")
        shape = np.shape(leaf)
        if len(spec) > len(shape):
            raise ValueError(
                f"{option}{where} = {spec} has more entries than the leaf's {len(shape)} dims"
            )
        used = []
        for dim, entry in enumerate(spec):
            names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
            for name in names:
                if name == WORKER_AXIS:
                    raise ValueError(
                        f"{option}{where} = {spec} names the worker axis: an array is "
                        "sharded inside a worker, over the mesh's other axes"
                    )
                if name not in inner_axes:
                    raise ValueError(
                        f"{option}{where} = {spec} names {name!r}, not an axis of the mesh "
                        f"{mesh.axis_names}"
                    )
                if name in used:
                    raise ValueError(f"{option}{where} = {spec} uses {name!r} twice")
                used.append(name)
            ways = int(np.prod([sizes[n] for n in names], dtype=np.int64))
            if shape[dim] % ways:
                raise ValueError(
                    f"{option}{where} = {spec}: dim {dim} of size {shape[dim]} is not "
                    f"divisible by {ways} (the size of {names})"
                )
        out.append(spec)
    return tuple(out)


def outer_shards(params: Any, backend: Backend, param_sharding: Any = None) -> OuterShards:
    """The outer state's split over the workers (`outer_sharding`) for `diloco_round(...,
    outer_shards=)`: `params` (arrays or shapes) at `param_sharding` (as in `train_diloco`;
    None: their own specs, else replicated) on `backend` (a shard_map `Backend` from
    `make_backend`, one worker per device group). The state must then be placed with the
    outer state at `OuterShards.storage_spec` (as `train_diloco(...,
    shard_outer_over_workers=True)` does)."""
    if not isinstance(backend, Backend) or backend.zero_refusal is not None:
        raise ValueError(
            f"outer_shards needs a shard_map Backend with one worker per device group, got "
            f"{backend!r}"
        )
    mesh = backend.mesh
    specs = resolve_param_specs(params, mesh, param_sharding)
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(params)]
    return split_shapes(shapes, specs, sizes, backend.num_workers)


class Placement(NamedTuple):
    """The state's shardings on `mesh` (hashable: an option of a cached program): the params'
    structure, leaf shapes and specs, and the leaf indices of each Streaming fragment."""

    mesh: Mesh
    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    specs: tuple[P, ...]
    groups: tuple[tuple[int, ...], ...] = ()
    outer: "OuterShards | None" = None  # the outer state split over the workers (ZeRO-1)
    host: bool = False  # θ and the outer state in pinned host memory (`diloco_jax.offload`)

    def shardings(self, state: Any) -> Any:
        """A pytree of `NamedSharding`s like `state` (a DiLoCoState / SyncState of arrays or
        shapes): each field where its owner's schema puts it (`map_fields`), the fields its
        `HOST` names in host memory when the placement says so."""

        def place(owner, name, value, per_worker):
            host = self.host and name in getattr(owner, "HOST", ())
            return self.tree(value, per_worker, split=name == "outer_opt_state", host=host)

        return map_fields(state, place)

    def tree(self, tree: Any, per_worker: bool, split: bool = False, host: bool = False) -> Any:
        """Shardings for one field (`per_worker`: leading dim M over the worker axis;
        `split`: the outer state, at `OuterShards.storage_spec` when it is split; `host`: in
        pinned host memory)."""
        specs = self.specs
        if split and self.outer is not None:
            specs = tuple(self.outer.storage_spec(i) for i in range(len(specs)))
        templates = [(self.treedef, self.shapes, specs)]
        for group in self.groups:
            treedef = jax.tree.structure([0] * len(group))
            templates.append(
                (treedef, tuple(self.shapes[i] for i in group), tuple(specs[i] for i in group))
            )
        lead = 1 if per_worker else 0

        def match(x):
            for treedef, shapes, specs in templates:
                leaves, structure = jax.tree.flatten(x, is_leaf=_masked)
                if structure != treedef:
                    continue
                got = [None if _masked(v) else tuple(np.shape(v))[lead:] for v in leaves]
                if all(g is None or g == s for g, s in zip(got, shapes, strict=True)):
                    return specs
            return None

        def place(x):
            specs = match(x)
            if specs is None:  # a leaf outside any params-like subtree: replicated
                if _masked(x) or x is None:
                    return x
                return self.sharding(P(), per_worker, host)
            leaves, structure = jax.tree.flatten(x, is_leaf=_masked)
            placed = [
                v if _masked(v) else self.sharding(s, per_worker, host)
                for v, s in zip(leaves, specs, strict=True)
            ]
            return jax.tree.unflatten(structure, placed)

        return jax.tree.map(place, tree, is_leaf=lambda x: match(x) is not None or _masked(x))

    def sharding(self, spec: P, per_worker: bool, host: bool = False) -> NamedSharding:
        return NamedSharding(
            self.mesh, P(WORKER_AXIS, *spec) if per_worker else spec,
            memory_kind=offload.HOST if host else None,
        )  # fmt: skip


def placement(
    params: Any, mesh: Mesh, specs: tuple[P, ...], groups=(), split_outer: bool = False,
    host: bool = False,
) -> Placement:  # fmt: skip
    """The `Placement` of `params` at `specs` on `mesh`; `split_outer`: the outer state split
    over the worker axis (`diloco_jax.outer_sharding`); `host`: θ and the outer state in
    pinned host memory (`diloco_jax.offload`)."""
    leaves, treedef = jax.tree.flatten(params)
    shapes = tuple(tuple(np.shape(x)) for x in leaves)
    outer = None
    if split_outer:
        sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
        outer = split_shapes(shapes, specs, sizes, sizes[WORKER_AXIS])
    return Placement(
        mesh=mesh,
        treedef=treedef,
        shapes=shapes,
        specs=specs,
        groups=tuple(tuple(g) for g in groups),
        outer=outer,
        host=host,
    )


def of_backend(
    backend: Backend, params: Any, param_sharding: Any = None, streaming: Any = None,
    frozen: tuple = (), split_outer: bool = False, host: bool = False,
) -> Placement:  # fmt: skip
    """The `Placement` of a run's state on `backend`'s mesh: the params at `param_sharding`
    (see `resolve_param_specs`; None: the backend's own `make_backend(param_sharding=)`, else
    the params' own shardings), the outer state per Streaming fragment of `streaming`
    (`frozen` leaves in none); `split_outer`, `host` as in `placement`."""
    if param_sharding is None and backend.param_sharding is not None:
        param_sharding = backend.param_sharding.value()
    specs = resolve_param_specs(params, backend.mesh, param_sharding)
    groups = synced_indices(params, streaming, frozen)
    return placement(params, backend.mesh, specs, groups, split_outer, host)


def kept_in_place(step, placed: Placement, state, batch):
    """`step(state, batch)`, its new state constrained to the placement's shardings (so every
    field stays where `Placement` puts it, round after round)."""
    new_state, metrics = step(state, batch)
    return jax.lax.with_sharding_constraint(new_state, placed.shardings(new_state)), metrics


def of_round_state(
    backend: Backend, state: Any, method: Any, trainable: Any = None, param_specs=None,
    split_outer: bool = False,
) -> "Placement | None":  # fmt: skip
    """The `Placement` of a round's `state` (arrays or tracers) on `backend`'s mesh, its
    params at `param_specs` (one spec per leaf) or else the backend's `param_sharding`; None
    when neither says where the params go (a traced leaf carries no sharding to read)."""
    if param_specs is None and backend.param_sharding is None:
        return None
    like = state.params
    if like is None:  # eager updates: θ is the workers' mean
        like = jax.eval_shape(delay.global_params, state)
    frozen = frozen_leaves(like, trainable)
    streaming = None if method is None else method.schedule
    if param_specs is None:
        return of_backend(backend, like, None, streaming, frozen, split_outer=split_outer)
    groups = synced_indices(like, streaming, frozen)
    return placement(like, backend.mesh, tuple(param_specs), groups, split_outer)


def build_in_place(init, placed: Placement, params, model_state=None, worker_state=None):
    """`init(params, model_state=, worker_state=)` (e.g. `init_state`) compiled with its
    inputs and outputs at the placement's shardings (the inputs copied to their shards
    first): no device ever holds more than its shards."""
    compiled, inputs = build_program(init, placed, params, model_state, worker_state)
    return compiled(*inputs)


def build_program(init, placed: Placement, params, model_state=None, worker_state=None):
    """(`build_in_place`'s compiled program, its inputs placed at their shards)."""
    inputs = (params, model_state, worker_state)
    shardings = (placed.tree(params, False), placed.tree(model_state, False),
                 placed.tree(worker_state, False))  # fmt: skip
    inputs = jax.device_put(inputs, shardings)
    build = lambda p, m, w: init(p, model_state=m, worker_state=w)  # noqa: E731
    out = placed.shardings(jax.eval_shape(build, *inputs))
    return jax.jit(build, out_shardings=out).lower(*inputs).compile(), inputs


def shard_shapes(params: Any, placed: Placement) -> Any:
    """One device's shard of each leaf of `params` at the placement's specs (shapes and
    dtypes)."""
    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(
        treedef,
        [
            jax.ShapeDtypeStruct(shard_shape(np.shape(x), s, placed.mesh), x.dtype)
            for x, s in zip(leaves, placed.specs, strict=True)
        ],
    )


def _own_spec(leaf: Any, inner_axes: set[str]) -> P:
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return P()
    named = {
        n for e in sharding.spec if e is not None for n in (e if isinstance(e, tuple) else (e,))
    }
    return sharding.spec if named <= inner_axes else P()


def _masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)

"""In-graph data: a pure sampling function plus the device-resident arrays it reads.

With a `Sampler` as `data`, each inner step's batch is drawn inside the round's scan, so no
[M, H, ...] batch is built on the host or copied per round, and memory does not grow with H.

Where its arrays live: `arrays` (read by every worker) sit on every worker's devices and
`worker_arrays` (leading dim M) only on their worker's; inside a worker, each leaf is
replicated over the worker's devices or split over them by `sharding` / `worker_sharding`.
A split leaf is read by XLA's partitioner: an elementwise gather (`stream[idx]`) becomes a
masked local read plus an all-reduce of the drawn batch, while a `lax.dynamic_slice` of a
split dimension gathers the whole leaf onto every device first.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from diloco_jax.distributed import place_global, to_host
from diloco_jax.placement import resolve_param_specs
from diloco_jax.workers import WORKER_AXIS, Backend


class SpecTree(NamedTuple):
    """A pytree of `PartitionSpec`s held hashably (a `Sampler`'s static field)."""

    treedef: Any
    specs: tuple

    def tree(self) -> Any:
        return jax.tree.unflatten(self.treedef, self.specs)


def _hashable_specs(value: Any, name: str) -> Any:
    """None, a PartitionSpec or a callable (path, leaf) -> spec as given; a pytree of specs
    (a dict like the arrays, say) as a `SpecTree`, so the Sampler stays hashable."""
    if value is None or isinstance(value, P | SpecTree) or callable(value):
        return value
    leaves, treedef = jax.tree.flatten(value, is_leaf=lambda x: isinstance(x, P) or x is None)
    if not all(x is None or isinstance(x, P) for x in leaves):
        raise ValueError(
            f"Sampler {name} must be a PartitionSpec, a pytree of them like the arrays, or a "
            f"callable (path, leaf) -> PartitionSpec; got {value!r}"
        )
    return SpecTree(treedef, tuple(leaves))


def _static(default: Any = None) -> Any:
    return dataclasses.field(default=default, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampler:
    """`sample(arrays, round, worker, step[, mine]) -> batch` for one worker and inner step.

    sample: a pure jittable function; `round`, `worker` and `step` are int32 scalars (for
      `train_sync`, `round` is the step index and `step` is 0). It must derive any randomness
      from its arguments (e.g. `jax.random.fold_in` of a key held in `arrays`), so a run is
      reproducible and can resume at any round. With `worker_arrays`, it gets a fifth
      argument `mine`: this worker's slice of them (each leaf without its leading dim).
    arrays: a pytree of arrays every worker reads (e.g. a token stream and a base key),
      placed on the devices once and passed to every round as an argument, never baked into
      the program.
    worker_arrays: None, or a pytree of arrays with leading dim M (worker m's data at [m],
      e.g. its shard of the corpus): each worker's slice is stored only on that worker's
      devices, so per-device bytes fall with M instead of holding every worker's data.
    sharding, worker_sharding: how a worker's own devices (the mesh's non-worker axes, or
      "data" under `data_parallel`) split `arrays` and each worker's slice of
      `worker_arrays`: None (replicated on them; for `arrays`, a leaf already placed by a
      `NamedSharding` on those axes keeps its spec), one `PartitionSpec` for every leaf, a
      pytree of them like the arrays, or a callable (path, leaf) -> PartitionSpec. Read a
      split leaf with elementwise indexing (module docstring). Checked when the run places
      the arrays: a spec naming a missing axis or a dim its axes don't divide is a
      ValueError naming the field.
    """

    arrays: Any
    sample: Callable[..., Any] = _static()
    worker_arrays: Any = None
    sharding: Any = _static()
    worker_sharding: Any = _static()

    def __post_init__(self):
        if not callable(self.sample):
            raise ValueError(f"Sampler sample must be callable, got {self.sample!r}")
        for name in ("sharding", "worker_sharding"):
            object.__setattr__(self, name, _hashable_specs(getattr(self, name), name))


class WorkerSampler(NamedTuple):
    """One worker's view of a Sampler, as `train_async` places one on each worker's devices:
    the sampler without its `worker_arrays`, and this worker's slice of them (None without)."""

    sampler: Sampler
    mine: Any

    def draw(self, round_: Any, worker: Any, step: Any) -> Any:
        own = () if self.mine is None else (self.mine,)
        return self.sampler.sample(self.sampler.arrays, round_, worker, step, *own)


def for_worker(sampler: Sampler, worker: int) -> WorkerSampler:
    """Worker `worker`'s `WorkerSampler` (its slice of `worker_arrays`, not yet placed)."""
    mine = None
    if sampler.worker_arrays is not None:
        mine = jax.tree.map(lambda x: x[worker], sampler.worker_arrays)
    return WorkerSampler(dataclasses.replace(sampler, worker_arrays=None), mine)


def check_workers(sampler: Sampler, num_workers: int, what: str = "num_workers") -> None:
    """ValueError naming `worker_arrays` unless each of its leaves has leading dim
    `num_workers` (`what` names that count in the message)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(sampler.worker_arrays)[0]:
        shape = tuple(np.shape(leaf))
        if shape[:1] != (num_workers,):
            raise ValueError(
                f"Sampler worker_arrays{jax.tree_util.keystr(path)} must have leading dim "
                f"{what} = {num_workers}, got shape {shape}"
            )


def specs(sampler: Sampler, mesh: Mesh) -> tuple[Any, Any]:
    """(a spec per leaf of `arrays`, a spec per leaf of a worker's slice of `worker_arrays`),
    as pytrees like them, over `mesh`'s non-worker axes, checked against the leaves' shapes."""
    slices = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x)), sampler.worker_arrays
    )
    out = []
    for tree, option, name in (
        (sampler.arrays, sampler.sharding, "Sampler sharding"),
        (slices, sampler.worker_sharding, "Sampler worker_sharding"),
    ):
        if isinstance(option, SpecTree):
            option = option.tree()
        leaf_specs = resolve_param_specs(tree, mesh, option, name)
        out.append(jax.tree.unflatten(jax.tree.structure(tree), leaf_specs))
    return out[0], out[1]


def shardings(sampler: Sampler, mesh: Mesh) -> Sampler:
    """A Sampler of `NamedSharding`s on `mesh` (a worker axis `WORKER_AXIS` and the axes inside
    a worker): `arrays` replicated over workers at their specs, `worker_arrays` split along
    workers, each worker's slice at its spec."""
    shared, mine = specs(sampler, mesh)
    return dataclasses.replace(
        sampler,
        arrays=jax.tree.map(lambda s: NamedSharding(mesh, s), shared),
        worker_arrays=jax.tree.map(lambda s: NamedSharding(mesh, P(WORKER_AXIS, *s)), mine),
    )


def place_sampler(sampler: Sampler, backend: Backend, process_local_data: bool = False) -> Sampler:
    """The Sampler on `backend`'s devices, as `train_diloco` / `train_sync` place it once per
    run (for a hand-driven `diloco_round`): `arrays` on every worker's devices and each
    worker's slice of `worker_arrays` on its own, at their specs inside a worker (`sharding`,
    `worker_sharding`; checked first, a ValueError naming the field). In a multi-process run
    each leaf is built from this process's host copy; with `process_local_data`,
    `worker_arrays` hold only this process's workers (leading dim: their count; where a
    worker spans processes and `worker_sharding` splits it, this process's part of its
    slice), assembled with `jax.make_array_from_process_local_data`."""
    if process_local_data:
        check_workers(sampler, backend.local_workers(), "this process's workers")
    else:
        check_workers(sampler, backend.num_workers)
    targets = shardings(sampler, backend.mesh)
    if backend.on_one_device:  # the checks above hold; everything is on the one device
        one = SingleDeviceSharding(backend.devices[0])
        targets = jax.tree.map(lambda _: one, targets)
    put = lambda s, x: place_global(lambda t: jax.device_put(t, s), x)  # noqa: E731
    put_mine = put
    if process_local_data and backend.spans_processes:
        put_mine = lambda s, x: jax.make_array_from_process_local_data(s, to_host(x))  # noqa: E731
    return dataclasses.replace(
        sampler,
        arrays=jax.tree.map(put, targets.arrays, sampler.arrays),
        worker_arrays=jax.tree.map(put_mine, targets.worker_arrays, sampler.worker_arrays),
    )


def split_data(data: Any, num_workers: int, counter: jax.Array) -> tuple[Any, Any]:
    """Splits a round's data into (shared, per-worker) inputs of `Backend.map_mean`.

    A `Sampler` shares its arrays and the round counter, and hands each worker its int32 id
    (with its slice of `worker_arrays`, when it has them); host batches (leaves [M, ...]) are
    all per-worker.
    """
    if isinstance(data, Sampler):
        ids = jnp.arange(num_workers, dtype=jnp.int32)
        mine = ids if data.worker_arrays is None else (ids, data.worker_arrays)
        return (data.arrays, counter), mine
    return None, data


def worker_batches(data: Any, shared: Any, mine: Any, step: int | None = None) -> Any:
    """This worker's batches from `split_data`'s parts: its host slice, or for a `Sampler`
    a function step -> batch (or, with `step` given, that one step's batch)."""
    if not isinstance(data, Sampler):
        return mine
    arrays, counter = shared
    worker, own = (mine, ()) if data.worker_arrays is None else (mine[0], (mine[1],))
    if step is not None:
        return data.sample(arrays, counter, worker, jnp.int32(step), *own)
    return lambda h: data.sample(arrays, counter, worker, h, *own)


def num_workers_of(data: Any, num_workers: int | None) -> int:
    """M from host batches' leading dim, or for a Sampler the explicit `num_workers` (or its
    `worker_arrays`' leading dim), checked against its `worker_arrays`."""
    if isinstance(data, Sampler):
        if num_workers is None:
            leaves = jax.tree.leaves(data.worker_arrays)
            if not leaves:
                raise ValueError("num_workers is required when data is a Sampler")
            num_workers = int(np.shape(leaves[0])[0])
        check_workers(data, num_workers)
        return num_workers
    return jax.tree.leaves(data)[0].shape[0]

"""Worker backends: run M workers on devices and reduce values across them.

Every backend exposes the same primitive, `map_workers(body)`: `body(shared, local,
collectives)` runs once per device on its k workers' slices of a [M, ...]-stacked pytree
(stacked [k, ...]), and reaches the other devices only through `collectives.reduce(reduce,
local)` (any number of times: the DiLoCo round syncs once per fragment). `map_reduce(fn,
reduce)` is the one-reduction case: `fn(shared, mine) -> (to_reduce, kept)` runs once per
worker, with `shared` the same for all workers and `mine` that worker's slice; the result is
(`reduce` of the workers' `to_reduce`, `kept` stacked [M, ...]).

`reduce(local)` runs once per device on `local`, the `to_reduce` of the k workers that device
holds, stacked [k, ...] (worker order = global worker order). It reaches the other devices with
collectives over the axis named `WORKER_AXIS`, which spans the D devices (D * k = M), and must
return a value that is the same on every device (e.g. from `psum`, or from `all_gather_workers`,
which hands every device all M workers' values). `map_mean(fn)` is the exact-mean case:
`reduce = exact_mean` (a local sum over k, then one all-reduce over the devices). `fn` itself
must not use collectives over `WORKER_AXIS`: it names the devices, not the workers.

- "vmap": all workers on one device under `jax.vmap` (k = M); `reduce` sees a device axis of
  size 1, so its collectives compile to nothing.
- "sequential": all workers on one device as under "vmap", but each worker's inner steps run
  one worker after another (`lax.map`), at one worker's shapes.
- "shard_map": workers over a 1-D device mesh axis; with M > devices (M a multiple of the
  device count) each device runs M / D workers under a local vmap.
- "pmap": the same layout through `jax.pmap`.
- "auto": "shard_map" when more than one device is available and M > 1 can be placed
  (M <= devices, or M a multiple of devices); otherwise one device: "sequential" on a CPU,
  "vmap" on an accelerator or for one worker (`one_device_backend`).
"""

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

WORKER_AXIS = "workers"
DATA_AXIS = "data"
BACKENDS = ("auto", "vmap", "sequential", "shard_map", "pmap")


@dataclasses.dataclass(frozen=True)
class Backend:
    """A resolved backend: M workers and the devices they run on (hashable, jit-static). One
    class per way of running them (`VmapBackend`, `ShardMapBackend`, `PmapBackend`); their
    properties answer what the round and the trainers ask of a backend, and `name` is the
    name `make_backend` takes.

    With `data_parallel` = N > 1 (shard_map only) each worker spans N devices: the mesh is
    [devices / N, N] over (WORKER_AXIS, DATA_AXIS), batches are split over DATA_AXIS, and
    XLA averages each inner step's gradients over a worker's N devices (the data axis stays
    an automatic axis inside the shard_map, which is manual over workers only).
    """

    num_workers: int
    devices: tuple[jax.Device, ...]
    data_parallel: int = 1
    # A user's mesh (`make_backend(mesh=...)`): its axes in order, (name, size), the worker
    # axis named WORKER_AXIS, and `devices` in the mesh's order; () otherwise.
    mesh_axes: tuple[tuple[str, int], ...] = ()
    batch_spec: P | None = None  # one worker's one-step batch on the other axes
    # The user's own mesh, its worker axis's name and `make_backend(param_sharding=)` in a
    # hashable form (`ParamSharding`). The round runs on `mesh` (the worker axis named
    # WORKER_AXIS, every axis Auto); a run's results go back to `user_mesh`
    # (`on_user_mesh`).
    user_mesh: Mesh | None = None
    worker_axis: str = WORKER_AXIS
    param_sharding: Any = None

    name: ClassVar[str] = ""

    @property
    def one_per_device(self) -> bool:
        """Whether each device (group of `data_parallel` devices) holds exactly one worker, in
        its own program instance: its steps then run without a batch dimension of one."""
        return self.workers_per_device == 1

    @property
    def on_one_device(self) -> bool:
        """Whether every worker runs on the one device `devices[0]`."""
        return False

    @property
    def host_memory_refusal(self) -> str | None:
        """Why θ and the outer state can't live in host memory on this backend, or None."""
        return None

    @property
    def zero_refusal(self) -> str | None:
        """Why the outer state can't be split over the workers (ZeRO-1) here, or None."""
        if self.one_per_device:
            return None
        return "workers other than one per device group of a shard_map backend"

    def for_processes(self) -> "Backend":
        """This backend in a multi-process run (`jax.process_count()` > 1), or ValueError
        saying what it needs there."""
        spanned = {d.process_index for d in self.devices}
        if spanned != set(range(jax.process_count())):
            raise ValueError(
                f"num_workers={self.num_workers} uses devices of processes {sorted(spanned)} "
                f"only; every one of the {jax.process_count()} processes needs at least one: "
                f"use at least {len(jax.devices())} workers (a multiple of it)"
            )
        return self

    def map_workers(self, body: Callable[..., tuple[Any, Any]], nested: bool = False) -> Callable:
        """Lifts a per-device `body(shared, local, collectives) -> (same_everywhere, local_out)`.

        `local` holds this device's k workers' slices of a [M, ...]-stacked pytree, stacked
        [k, ...] (k = M on "vmap"); `shared` is the same on every device. `body` reaches the
        other devices only through `collectives` (a `Collectives`): `collectives.reduce(fn,
        local)` runs a reducer (see the module docstring) and `collectives.vary(x)` types a
        shared value as per-worker before workers start scans from it. Its first output must
        be the same on every device. Returns `run(shared, mine_M) -> (same_everywhere,
        local_out_M)` with leaves [M, ...]. `nested` (vmap only) runs the whole body under a
        size-1 named device axis instead of binding it around the reducers alone: the same
        values, a slower program with other rounding, kept for the rounds that ran so before.
        """
        raise NotImplementedError

    def worker_map(self, fn: Callable, in_axes: tuple) -> Callable:
        """`jax.vmap(fn, in_axes)` over a device's k workers (in_axes: 0 or None per
        argument); with one worker a device, `fn` runs without the batch dimension (XLA's CPU
        dots lose half their speed to a unit batch dimension)."""
        if self.one_per_device:
            return _unbatched(fn, in_axes)
        return jax.vmap(fn, in_axes=in_axes)

    def _new_sharding(self, spec: P) -> jax.sharding.Sharding:
        return NamedSharding(self.mesh, spec)

    @property
    def spans_processes(self) -> bool:
        """Whether the workers' arrays span every process of a multi-process run (over the
        global devices), rather than each process running all of them on its own device."""
        return not self.on_one_device

    @property
    def workers_per_device(self) -> int:
        """Workers per device (per group of `data_parallel` devices)."""
        return self.num_workers * self.data_parallel // len(self.devices)

    @property
    def mesh(self) -> Mesh:
        if self.mesh_axes:
            names, sizes = zip(*self.mesh_axes, strict=True)
            grid = np.array(self.devices).reshape(sizes)
            return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))
        if self.data_parallel == 1:
            return Mesh(np.array(self.devices), (WORKER_AXIS,), axis_types=(AxisType.Auto,))
        grid = np.array(self.devices).reshape(-1, self.data_parallel)
        return Mesh(grid, (WORKER_AXIS, DATA_AXIS), axis_types=(AxisType.Auto,) * 2)

    def on_user_mesh(self, tree: Any) -> Any:
        """`tree` with every array on `mesh` moved onto the user's mesh (`user_mesh`: its
        worker axis's name and axis types), the worker axis renamed in its spec; the same
        buffers (no copy, any process count). The identity without a user's mesh, or where
        it is `mesh` itself."""
        if self.user_mesh is None or self.user_mesh == self.mesh:
            return tree
        internal = self.mesh

        def move(x):
            sharding = getattr(x, "sharding", None)
            if not isinstance(sharding, NamedSharding) or sharding.mesh != internal:
                return x
            spec = P(*(_renamed(entry, self.worker_axis) for entry in sharding.spec))
            target = NamedSharding(self.user_mesh, spec, memory_kind=sharding.memory_kind)
            shards = [s.data for s in x.addressable_shards]
            return jax.make_array_from_single_device_arrays(x.shape, target, shards)

        return jax.tree.map(move, tree)

    def map_reduce(
        self, fn: Callable[[Any, Any], tuple[Any, Any]], reduce: Callable[[Any], Any]
    ) -> Callable[[Any, Any], tuple[Any, Any]]:
        """Lifts per-worker `fn(shared, mine) -> (to_reduce, kept)` to all M workers.

        Returns `run(shared, mine_M) -> (reduce(...), kept_M)`: `mine_M` and `kept_M` have
        leaves [M, ...]; `reduce` is called per device on its workers' `to_reduce`, stacked
        [k, ...], inside the mapped context (see the module docstring).
        """

        def body(shared, local, collectives):
            shared = collectives.vary(shared)
            to_reduce, kept = jax.vmap(fn, in_axes=(None, 0))(shared, local)
            return collectives.reduce(reduce, to_reduce), kept

        return self.map_workers(body)

    def map_mean(self, fn: Callable[[Any, Any], tuple[Any, Any]]) -> Callable:
        """`map_reduce` with the exact mean over all M workers, in each leaf's dtype."""
        return self.map_reduce(fn, functools.partial(exact_mean, num_workers=self.num_workers))

    def place_shared(self, tree: Any) -> Any:
        """Puts a pytree on the backend's devices, replicated."""
        return _put(tree, _sharding(self, P()))

    def place_workers(self, tree: Any) -> Any:
        """Puts a [M, ...]-stacked pytree on the backend's devices, split along workers."""
        return _put(tree, _sharding(self, P(WORKER_AXIS)))

    def local_workers(self) -> int:
        """How many of the M workers have a device in this process (all M in one process)."""
        sharding = _sharding(self, P(WORKER_AXIS))
        owned = set()
        for index in sharding.addressable_devices_indices_map((self.num_workers,)).values():
            owned.update(range(self.num_workers)[index[0]])
        return len(owned)

    def assemble_batches(self, tree: Any, lead: int) -> Any:
        """Global batches from this process's part of them (leaves [M_local, ...]: its
        workers, and where a worker spans processes, its part of that worker's batch), at
        the shardings `place_batches` uses (`jax.make_array_from_process_local_data`)."""
        if not self.spans_processes:  # each process runs every worker on its own device
            return self.place_batches(tree, lead)
        shardings = self.batch_shardings(tree, lead, check=False)
        return jax.tree.map(
            lambda s, x: jax.make_array_from_process_local_data(s, np.asarray(x)), shardings, tree
        )

    def place_batches(self, tree: Any, lead: int) -> Any:
        """Puts batches with leaves [M, <lead - 1 more dims>, B, ...] on the devices: split
        along workers, and with `data_parallel` > 1 the batch dim B along DATA_AXIS (on a
        user's mesh: each worker's batch at `batch_spec`)."""
        if not self.mesh_axes and self.data_parallel == 1:
            return self.place_workers(tree)  # one sharding for every leaf: the common path
        return _put(tree, self.batch_shardings(tree, lead))

    def batch_shardings(self, tree: Any, lead: int, check: bool = True) -> Any:
        """The sharding of each batch leaf of `tree` (see `place_batches`); `check`: raise
        ValueError for a batch dim its axes don't divide."""
        if self.mesh_axes:
            sizes, spec = dict(self.mesh_axes), self.batch_spec
        elif self.data_parallel > 1:
            sizes, spec = {DATA_AXIS: self.data_parallel}, P(DATA_AXIS)
        else:
            sizes, spec = {}, P()

        def one(leaf):
            shape = np.shape(leaf)[lead:]
            if len(spec) > len(shape):
                raise ValueError(self._indivisible(spec, np.shape(leaf), lead, None))
            for dim, entry in enumerate(spec):
                names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
                ways = int(np.prod([sizes[n] for n in names], dtype=np.int64))
                if check and shape[dim] % ways:
                    raise ValueError(self._indivisible(spec, np.shape(leaf), lead, (dim, ways)))
            return _sharding(self, P(WORKER_AXIS, *[None] * (lead - 1), *spec))

        return jax.tree.map(one, tree)

    def _indivisible(self, spec: P, shape: tuple, lead: int, dim_ways) -> str:
        """The error for a batch leaf of `shape` that `spec` can't split (`dim_ways`: the dim
        and the ways it doesn't divide; None: too few dims), naming the option that set it."""
        if not self.mesh_axes:
            return (
                f"with data_parallel={self.data_parallel}, every batch leaf needs a batch dim "
                f"(after the leading {lead}) divisible by it, got shape {shape}"
            )
        if dim_ways is None:
            return (
                f"batch_sharding {spec} has more entries than a batch leaf of shape {shape} "
                f"has dims after the leading {lead}"
            )
        dim, ways = dim_ways
        inner = tuple(name for name, _ in self.mesh_axes if name != WORKER_AXIS)
        given = (
            f"the default batch_sharding {spec} (the batch dim over every non-worker mesh "
            "axis; pass batch_sharding= to split it otherwise)"
            if spec == P(inner)
            else f"batch_sharding {spec}"
        )
        return (
            f"{given}: a batch leaf of shape {shape} has dim {dim + lead} of "
            f"size {shape[dim + lead]}, not divisible by {ways}"
        )


def _renamed(entry: Any, worker_axis: str) -> Any:
    """A spec entry with WORKER_AXIS renamed `worker_axis`."""
    if isinstance(entry, tuple):
        return tuple(worker_axis if n == WORKER_AXIS else n for n in entry)
    return worker_axis if entry == WORKER_AXIS else entry


class ParamSharding(NamedTuple):
    """`make_backend(param_sharding=)` in a hashable form: a pytree of specs as its structure
    and its leaves, else the value itself (one `PartitionSpec` or a callable)."""

    treedef: Any
    specs: Any

    @classmethod
    def of(cls, param_sharding: Any) -> "ParamSharding | None":
        if param_sharding is None:
            return None
        if isinstance(param_sharding, P) or callable(param_sharding):
            return cls(None, param_sharding)
        specs, treedef = jax.tree.flatten(
            param_sharding, is_leaf=lambda x: isinstance(x, P) or x is None
        )
        for spec in specs:
            if spec is not None and not isinstance(spec, P):
                raise ValueError(
                    "param_sharding must be a pytree of PartitionSpecs like the params, one "
                    f"PartitionSpec, or a callable (path, leaf) -> PartitionSpec; got a leaf "
                    f"{spec!r}"
                )
        return cls(treedef, tuple(specs))

    def value(self) -> Any:
        """The `param_sharding` given (a pytree rebuilt from its leaves)."""
        if self.treedef is None:
            return self.specs
        return jax.tree.unflatten(self.treedef, self.specs)


@functools.lru_cache(maxsize=256)
def _sharding(backend: Backend, spec: P) -> jax.sharding.Sharding:
    # Cached: building a Mesh and a NamedSharding per batch costs more than the dispatch.
    return backend._new_sharding(spec)


@dataclasses.dataclass(frozen=True)
class VmapBackend(Backend):
    """Every worker on one device, `jax.vmap`ped: `devices` holds that device."""

    name: ClassVar[str] = "vmap"

    @property
    def one_per_device(self) -> bool:
        return False  # the workers share the one program instance, batched

    @property
    def on_one_device(self) -> bool:
        return True

    def for_processes(self) -> Backend:
        # Nothing to split over processes: every process runs all M workers, redundantly and
        # identically, on its own first device (e.g. the CLI's 1-worker warm start).
        return VmapBackend(self.num_workers, tuple(jax.local_devices()[:1]))

    def map_workers(self, body, nested: bool = False) -> Callable:
        return functools.partial(_run_nested if nested else _run_one_device, body)

    def _new_sharding(self, spec: P) -> jax.sharding.Sharding:
        return SingleDeviceSharding(self.devices[0])


@dataclasses.dataclass(frozen=True)
class SequentialBackend(VmapBackend):
    """Every worker on one device, one after another: each worker's inner steps run under
    `lax.map` over the workers instead of `jax.vmap`, so every operation keeps the shapes it
    has for one worker (a convolution with one worker's weights, not a batch of them); the
    rest of the round (deltas, exchange, outer update) is the vmap backend's. The same
    arithmetic per worker as vmap, up to float rounding (XLA may fuse a batched program
    differently)."""

    name: ClassVar[str] = "sequential"

    def worker_map(self, fn: Callable, in_axes: tuple) -> Callable:
        return _one_after_another(fn, in_axes)


@dataclasses.dataclass(frozen=True)
class ShardMapBackend(Backend):
    """Workers over a mesh axis of devices (`jax.shard_map`), M / D a device group; on a
    user's mesh its other axes partition each worker."""

    name: ClassVar[str] = "shard_map"

    def map_workers(self, body, nested: bool = False) -> Callable:
        if self.mesh_axes and self.num_workers == 1:
            # A worker axis of size 1: nothing crosses it, and XLA refuses a collective over
            # a manual axis of size 1 beside auto axes. The one worker runs under plain jit
            # (its axes partitioned by XLA), its reducers' collectives vanishing as on vmap.
            return functools.partial(_run_one_device, in_mesh_context(body, self.mesh))
        partial_manual = self.data_parallel > 1 or bool(self.mesh_axes)
        return _shard_map_workers(body, self.mesh, partial_manual)


@dataclasses.dataclass(frozen=True)
class PmapBackend(Backend):
    """Workers over devices through `jax.pmap` (the shard_map layout)."""

    name: ClassVar[str] = "pmap"

    @property
    def host_memory_refusal(self) -> str | None:
        return "the pmap backend"

    @property
    def zero_refusal(self) -> str | None:
        return "workers other than one per device group of a shard_map backend"

    def for_processes(self) -> Backend:
        raise ValueError(
            f"a run over {jax.process_count()} processes needs backend='shard_map' (workers "
            f"over the global device mesh), got {self.name!r}"
        )

    def map_workers(self, body, nested: bool = False) -> Callable:
        return _pmap_workers(body, self.devices, self.num_workers)


_BACKENDS = {
    cls.name: cls for cls in (VmapBackend, SequentialBackend, ShardMapBackend, PmapBackend)
}


def _put(tree: Any, sharding: Any) -> Any:
    """`jax.device_put(tree, sharding)` (one sharding, or a pytree of them like `tree`),
    skipped when every leaf already is a jax.Array with its sharding (e.g. batches a user
    placed once, fed to every round): the copy-free path."""
    leaves = jax.tree.leaves(tree)
    targets = (
        [sharding] * len(leaves)
        if isinstance(sharding, jax.sharding.Sharding)
        else jax.tree.leaves(sharding)
    )
    # An uncommitted array (e.g. from an eager init_state) is put even where its sharding
    # matches: the round's own outputs are committed, and a program first called with
    # uncommitted inputs compiles a second time at round 2.
    if all(
        isinstance(x, jax.Array) and x.committed and x.sharding == t
        for x, t in zip(leaves, targets, strict=True)
    ):
        return tree
    return jax.device_put(tree, sharding)


def one_device_backend(device: jax.Device, num_workers: int) -> str:
    """What `backend="auto"` runs M workers with on one device: "sequential" on a CPU (XLA's
    CPU kernels ran one worker's shapes at a time faster than a batch of M, for a CNN and for
    the LM transformers: benchmarks/worker_map.py, docs/devices.md), "vmap" for one worker
    and on an accelerator (one batched kernel for all M workers)."""
    return "sequential" if device.platform == "cpu" and num_workers > 1 else "vmap"


def make_backend(
    backend: "str | Backend",
    num_workers: int,
    devices: Sequence[jax.Device] | None = None,
    data_parallel: int = 1,
    *,
    mesh: Mesh | None = None,
    worker_axis: str = WORKER_AXIS,
    param_sharding: Any = None,
    batch_sharding: P | None = None,
) -> Backend:
    """Resolves a backend name for M = `num_workers` on `devices` (default: `jax.devices()`).

    `mesh`: the user's `jax.sharding.Mesh` (backend "auto" or "shard_map"; not with
    `devices` or `data_parallel`): one axis `worker_axis` of size M, every other axis
    partitions each worker; `param_sharding` the params' specs over those axes (a pytree of
    `PartitionSpec`s like the params, one spec, or a callable (path, leaf) -> spec; None:
    replicated inside a worker), read by `init_state(..., backend=)`, `diloco_round` and
    `jit_round`; `batch_sharding` the `PartitionSpec` of one worker's one-step batch over
    those axes (default: its leading dim over all of them). See `diloco_jax.placement` for
    where the state goes. The round runs on `Backend.mesh`, the same devices with the worker
    axis named "workers" and every axis Auto; `Backend.on_user_mesh` moves its arrays onto
    `mesh` (no copy), as the `train_*` functions do with their results.

    `data_parallel` = N >= 1 devices per worker (N > 1 needs "shard_map" or "auto" and a
    device count divisible by N). Raises ValueError naming `backend` for an unknown name,
    `data_parallel` for a bad N, and `num_workers` when M can't be placed: a device backend
    needs M <= number of device groups or M a multiple of it.
    """
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"data_parallel must be an integer >= 1, got {data_parallel!r}")
    if mesh is not None:
        return _mesh_backend(backend, num_workers, devices, data_parallel, mesh, worker_axis,
                             param_sharding, batch_sharding)  # fmt: skip
    for name, value in (("param_sharding", param_sharding), ("batch_sharding", batch_sharding)):
        if value is not None:
            raise ValueError(f"{name} needs a mesh (make_backend(..., mesh=...))")
    if worker_axis != WORKER_AXIS:
        raise ValueError("worker_axis needs a mesh (make_backend(..., mesh=...))")
    if data_parallel > 1:
        return _data_parallel_backend(backend, num_workers, devices, data_parallel)
    if isinstance(backend, Backend):
        if backend.num_workers != num_workers:
            raise ValueError(
                f"backend was built for {backend.num_workers} workers, got num_workers="
                f"{num_workers}"
            )
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    devices = tuple(jax.devices() if devices is None else devices)
    if backend == "auto":
        placeable = num_workers <= len(devices) or num_workers % len(devices) == 0
        if len(devices) > 1 and num_workers > 1 and placeable:
            backend = "shard_map"
        else:
            backend = one_device_backend(devices[0], num_workers)
        if not placeable and len(devices) > 1:
            warnings.warn(
                f"backend='auto': num_workers={num_workers} can't be split evenly over "
                f"{len(devices)} devices, so all {num_workers} workers run on one device "
                f"({backend}); use at most {len(devices)} workers or a multiple of "
                f"{len(devices)} to use every device, or pass backend={backend!r} to choose "
                "one device",
                stacklevel=2,
            )
    if backend in ("vmap", "sequential"):  # every worker on the first device
        return _BACKENDS[backend](num_workers, devices[:1])
    if num_workers <= len(devices):
        return _BACKENDS[backend](num_workers, devices[:num_workers])
    if num_workers % len(devices):
        raise ValueError(
            f"num_workers={num_workers} can't be placed on {len(devices)} devices with "
            f"backend={backend!r}: use at most {len(devices)} workers, a multiple of "
            f"{len(devices)}, or backend='vmap'"
        )
    return _BACKENDS[backend](num_workers, devices)


def _mesh_backend(
    backend, num_workers, devices, data_parallel, mesh, worker_axis, param_sharding,
    batch_sharding,
):  # fmt: skip
    if isinstance(backend, Backend):
        if not backend.mesh_axes:
            raise ValueError("mesh= with a backend built without one: pass backend='auto'")
        if backend.user_mesh != mesh or backend.worker_axis != worker_axis:
            raise ValueError(
                "backend was built on another mesh or worker_axis than the mesh= and "
                "worker_axis= given: pass one of them"
            )
        if param_sharding is not None or batch_sharding is not None:
            raise ValueError(
                "param_sharding and batch_sharding with a built backend: give them to make_backend"
            )
        return make_backend(backend, num_workers)  # checks M
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if backend not in ("auto", "shard_map"):
        raise ValueError(f"a mesh needs backend 'shard_map' or 'auto', got {backend!r}")
    if devices is not None or data_parallel != 1:
        raise ValueError("mesh= replaces devices= and data_parallel=: give only the mesh")
    names = tuple(mesh.axis_names)
    if worker_axis not in names:
        raise ValueError(f"mesh has no worker_axis {worker_axis!r}: its axes are {names}")
    sizes = dict(zip(names, mesh.devices.shape, strict=True))
    if sizes[worker_axis] != num_workers:
        raise ValueError(
            f"num_workers={num_workers} must equal the size {sizes[worker_axis]} of the mesh's "
            f"worker_axis {worker_axis!r}"
        )
    if worker_axis != WORKER_AXIS and WORKER_AXIS in names:
        raise ValueError(
            f"mesh axis {WORKER_AXIS!r} is reserved for the worker axis; rename it or pass "
            f"worker_axis={WORKER_AXIS!r}"
        )
    inner = tuple(n for n in names if n != worker_axis)
    if batch_sharding is None:
        batch_sharding = P(inner) if inner else P()
    if not isinstance(batch_sharding, P):
        raise ValueError(f"batch_sharding must be a PartitionSpec, got {batch_sharding!r}")
    for entry in batch_sharding:
        for name in () if entry is None else (entry if isinstance(entry, tuple) else (entry,)):
            if name not in inner:
                raise ValueError(
                    f"batch_sharding {batch_sharding} names {name!r}, not one of the mesh's "
                    f"non-worker axes {inner}"
                )
    axes = tuple((WORKER_AXIS if n == worker_axis else n, sizes[n]) for n in names)
    per_worker = int(np.prod([sizes[n] for n in inner], dtype=np.int64))
    return ShardMapBackend(
        num_workers=num_workers,
        devices=tuple(mesh.devices.flat),
        data_parallel=per_worker,
        mesh_axes=axes,
        batch_spec=batch_sharding,
        user_mesh=mesh,
        worker_axis=worker_axis,
        param_sharding=ParamSharding.of(param_sharding),
    )


def _data_parallel_backend(backend, num_workers, devices, data_parallel) -> Backend:
    if backend not in ("auto", "shard_map"):
        raise ValueError(
            f"data_parallel={data_parallel} needs backend 'shard_map' or 'auto', got {backend!r}"
        )
    devices = tuple(jax.devices() if devices is None else devices)
    if len(devices) % data_parallel:
        raise ValueError(
            f"data_parallel={data_parallel} must divide the number of devices {len(devices)}"
        )
    resolved = make_backend("shard_map", num_workers, devices[::data_parallel])
    groups = len(resolved.devices)
    return ShardMapBackend(num_workers, devices[: groups * data_parallel], data_parallel)


def exact_mean(local: Any, num_workers: int) -> Any:
    """Reducer: mean over all M workers of leaves [k, ...] (this device's workers).

    Sums the k local values, all-reduces the sums over the devices and divides by M; the
    result is [...] in each leaf's dtype. On the vmap backend this is exactly `lax.pmean`
    over M vmapped workers (the same reduce-sum, then the same division).
    """
    return jax.tree.map(
        lambda x: (lax.psum(jnp.sum(x, 0), WORKER_AXIS) / num_workers).astype(x.dtype), local
    )


def all_gather_workers(local: Any) -> Any:
    """Reducer building block: every worker's value on every device, [k, ...] -> [M, ...].

    All-gathers this device's k workers' leaves over the D devices ([D, k, ...] flattened to
    [M, ...], worker order kept). The per-device collective operand is the local [k, ...]
    buffer, in its own dtype: integer payloads travel as integers. The result is invariant
    across devices, so it (or anything computed from it) can leave a shard_map replicated.
    """
    return jax.tree.map(_gather_leaf, local)


def _gather_leaf(x: jax.Array) -> jax.Array:
    # Under shard_map the operand is typed varying over the workers axis and the result must be
    # typed invariant to leave through out_specs P(); vmap and pmap carry no such types (and
    # an invariant gather is not defined under vmap), so they take the plain all_gather.
    to = "invarying" if WORKER_AXIS in _varying_axes(x) else "varying"
    return lax.all_gather(x, WORKER_AXIS, tiled=True, to=to)


def match_varying(new: Any, like: Any) -> Any:
    """`new` with each leaf typed varying over every manual mesh axis its counterpart in `like`
    varies over (a scan's carry must keep its type: e.g. a step that returns a constant
    counter under shard_map). The identity outside shard_map and where the types agree."""

    def leaf(n, old):
        missing = _varying_axes(old) - _varying_axes(n)
        return lax.pcast(n, tuple(sorted(missing)), to="varying") if missing else n

    return jax.tree.map(leaf, new, like)


def _varying_axes(x: jax.Array) -> frozenset:
    """Manual mesh axes `x` is typed as varying over (jax 0.10: `.mat.varying`; older: `.vma`)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


class Collectives(NamedTuple):
    """What a `map_workers` body may do across devices (see `Backend.map_workers`).

    reduce(fn, local): runs the reducer `fn` on this device's workers' values `local`
      ([k, ...]) with WORKER_AXIS bound over the devices; returns its (device-invariant)
      result.
    vary(x): `x` typed as varying over the workers (shard_map's scans that start from a
      shared value need it); the identity elsewhere.
    """

    reduce: Callable[[Callable[[Any], Any], Any], Any]
    vary: Callable[[Any], Any]


def _bound_reduce(fn: Callable[[Any], Any], local: Any) -> Any:
    return fn(local)


def _identity(x: Any) -> Any:
    return x


def one_device_reduce(fn: Callable[[Any], Any], local: Any) -> Any:
    """Runs the reducer `fn` on all M workers' values `local` ([M, ...]) held on one device,
    WORKER_AXIS bound as a size-1 device axis (the one-device backends' reduce; the elastic
    syncer merges compressed pushes with it)."""
    # All M workers sit on one device under a plain vmap (the same program as hand-written
    # vmap code: a size-1 device axis around them would cost extra copies every inner step);
    # only the reducer sees WORKER_AXIS, bound as a size-1 device axis whose collectives
    # vanish.
    one_device = jax.tree.map(lambda x: x[None], local)
    return jax.vmap(fn, axis_name=WORKER_AXIS, out_axes=None)(one_device)


_ONE_DEVICE = Collectives(one_device_reduce, _identity)
_MAPPED = Collectives(_bound_reduce, _identity)
_SHARD_MAPPED = Collectives(_bound_reduce, lambda x: lax.pcast(x, WORKER_AXIS, to="varying"))


def in_mesh_context(fn: Callable, mesh: Mesh | jax.sharding.AbstractMesh | None) -> Callable:
    """`fn` traced with `mesh`'s axes in context, as a `shard_map` body sees them, for the
    workers that run under plain jit on a mesh (one worker; `train_async`'s jobs): code that
    asks `jax.sharding.get_abstract_mesh()` (a model's activation constraints,
    `faults.all_finite`) then finds the axes XLA partitions. `fn` itself for None."""
    if mesh is None:
        return fn
    abstract = mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh

    @functools.wraps(fn)
    def traced_in_mesh(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(abstract):
            return fn(*args, **kwargs)

    return traced_in_mesh


def _run_one_device(body, shared, mine):
    return body(shared, mine, _ONE_DEVICE)


def _run_nested(body, shared, mine):
    one_device = jax.tree.map(lambda x: x[None], mine)
    same, local = jax.vmap(
        lambda s, m: body(s, m, _MAPPED),
        in_axes=(None, 0),
        out_axes=(None, 0),
        axis_name=WORKER_AXIS,
    )(shared, one_device)
    return same, jax.tree.map(lambda x: x[0], local)


def _shard_map_workers(body, mesh: Mesh, data_parallel: bool = False):
    # With a data axis, only the worker axis is manual: XLA partitions each worker's batch
    # over DATA_AXIS and all-reduces its gradients there every inner step.
    manual = {"axis_names": {WORKER_AXIS}} if data_parallel else {}
    return jax.shard_map(
        lambda shared, mine: body(shared, mine, _SHARD_MAPPED),
        mesh=mesh,
        in_specs=(P(), P(WORKER_AXIS)),
        out_specs=(P(), P(WORKER_AXIS)),
        **manual,
    )


def _pmap_workers(body, devices: tuple[jax.Device, ...], num_workers: int):
    per_device = num_workers // len(devices)
    mapped = jax.pmap(
        lambda shared, mine: body(shared, mine, _MAPPED),
        axis_name=WORKER_AXIS,
        in_axes=(None, 0),
        out_axes=(None, 0),
        devices=devices,
    )

    def run(shared, mine):
        split = lambda x: x.reshape((len(devices), per_device) + x.shape[1:])
        merge = lambda x: x.reshape((num_workers,) + x.shape[2:])
        same, local = mapped(shared, jax.tree.map(split, mine))
        return same, jax.tree.map(merge, local)

    return run


def _one_after_another(fn, in_axes):
    """`jax.vmap(fn, in_axes)` computed by `lax.map` (in_axes: 0 or None per argument, or a
    tuple prefix of it): one worker at a time, each with its own unbatched shapes."""

    def split(a, axis):  # (what is mapped, what every worker shares), None where the other
        if isinstance(axis, tuple):
            pairs = [split(x, ax) for x, ax in zip(a, axis, strict=True)]
            return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
        return (None, a) if axis is None else (a, None)

    def join(mapped, shared, axis):
        if isinstance(axis, tuple):
            return tuple(join(m, s, ax) for m, s, ax in zip(mapped, shared, axis, strict=True))
        return shared if axis is None else mapped

    def run(*args):
        halves = [split(a, axis) for a, axis in zip(args, in_axes, strict=True)]
        shared = [h[1] for h in halves]

        def one(mapped):
            return fn(*(join(m, s, ax) for m, s, ax in zip(mapped, shared, in_axes, strict=True)))

        return lax.map(one, [h[0] for h in halves])

    return run


def _unbatched(fn, in_axes):
    """`jax.vmap(fn, in_axes)` for a batch of one (in_axes: 0 or None per argument), without
    the batch dimension inside `fn`."""

    def squeeze(a, axis):
        if isinstance(axis, tuple):  # a prefix of the argument's tree
            return tuple(squeeze(x, ax) for x, ax in zip(a, axis, strict=True))
        return a if axis is None else jax.tree.map(lambda x: x[0], a)

    def one(*args):
        args = [squeeze(a, axis) for a, axis in zip(args, in_axes, strict=True)]
        return jax.tree.map(lambda x: x[None], fn(*args))

    return one


def shard_shape(shape: tuple[int, ...], spec: P, mesh: Mesh) -> tuple[int, ...]:
    """The shape of one device's shard of a leaf of `shape` at `spec` on `mesh`."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    out = list(shape)
    for dim, entry in enumerate(spec):
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        out[dim] //= int(np.prod([sizes[n] for n in names], dtype=np.int64))
    return tuple(out)


def stack_workers(tree: Any, num_workers: int) -> Any:
    """Repeats every leaf along a new leading worker axis: [...] -> [M, ...] (new buffers).
    One broadcast per leaf: half the eager work of `jnp.repeat` in `init_state`."""
    return jax.tree.map(
        lambda x: jnp.broadcast_to(jnp.asarray(x), (num_workers, *jnp.shape(x))), tree
    )

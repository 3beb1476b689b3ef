"""Worker backends: run a per-worker function over M workers and average a result across them.

Every backend exposes the same primitive, `map_mean(fn)`: `fn(shared, mine) -> (to_average,
kept)` runs once per worker, with `shared` the same for all workers and `mine` that worker's
slice of a [M, ...]-stacked pytree; the result is (mean over workers of `to_average`,
`kept` stacked [M, ...]). The mean is a collective over the axis named `WORKER_AXIS`.

- "vmap": all workers on one device, `jax.vmap(..., axis_name=WORKER_AXIS)`.
- "shard_map": workers over a 1-D device mesh axis; with M > devices (M a multiple of the
  device count) each device runs M / D workers under a local vmap.
- "pmap": the same layout through `jax.pmap`.
- "auto": "shard_map" when more than one device is available and M > 1 can be placed
  (M <= devices, or M a multiple of devices); otherwise "vmap".
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

WORKER_AXIS = "workers"
BACKENDS = ("auto", "vmap", "shard_map", "pmap")


@dataclasses.dataclass(frozen=True)
class Backend:
    """A resolved backend: its name, M, and the devices it runs on (hashable, jit-static)."""

    name: str
    num_workers: int
    devices: tuple[jax.Device, ...]

    @property
    def workers_per_device(self) -> int:
        return self.num_workers // len(self.devices)

    @property
    def mesh(self) -> Mesh:
        return Mesh(np.array(self.devices), (WORKER_AXIS,), axis_types=(AxisType.Auto,))

    def map_mean(self, fn: Callable[[Any, Any], tuple[Any, Any]]) -> Callable:
        """Lifts per-worker `fn(shared, mine) -> (to_average, kept)` to all M workers."""
        if self.name == "vmap":
            return _vmap_mean(fn)
        if self.name == "shard_map":
            return _shard_map_mean(fn, self.mesh, self.num_workers)
        return _pmap_mean(fn, self.devices, self.num_workers)

    def place_shared(self, tree: Any) -> Any:
        """Puts a pytree on the backend's devices, replicated."""
        return jax.device_put(tree, self._sharding(P()))

    def place_workers(self, tree: Any) -> Any:
        """Puts a [M, ...]-stacked pytree on the backend's devices, split along workers."""
        return jax.device_put(tree, self._sharding(P(WORKER_AXIS)))

    def _sharding(self, spec: P):
        if self.name == "vmap":
            return self.devices[0]
        return NamedSharding(self.mesh, spec)


def make_backend(
    backend: "str | Backend", num_workers: int, devices: Sequence[jax.Device] | None = None
) -> Backend:
    """Resolves a backend name for M = `num_workers` on `devices` (default: `jax.devices()`).

    Raises ValueError naming `backend` for an unknown name and `num_workers` when M can't be
    placed: a device backend needs M <= number of devices or M a multiple of it.
    """
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
        backend = "shard_map" if len(devices) > 1 and num_workers > 1 and placeable else "vmap"
    if backend == "vmap":
        return Backend("vmap", num_workers, devices[:1])
    if num_workers <= len(devices):
        return Backend(backend, num_workers, devices[:num_workers])
    if num_workers % len(devices):
        raise ValueError(
            f"num_workers={num_workers} can't be placed on {len(devices)} devices with "
            f"backend={backend!r}: use at most {len(devices)} workers, a multiple of "
            f"{len(devices)}, or backend='vmap'"
        )
    return Backend(backend, num_workers, devices)


def _sum_then_mean(tree: Any, num_workers: int) -> Any:
    """Mean over all workers of a tree whose leaves are [workers on this device, ...]."""
    return jax.tree.map(
        lambda x: (lax.psum(jnp.sum(x, 0), WORKER_AXIS) / num_workers).astype(x.dtype), tree
    )


def _vmap_mean(fn):
    def one(shared, mine):
        to_average, kept = fn(shared, mine)
        return lax.pmean(to_average, WORKER_AXIS), kept

    return jax.vmap(one, in_axes=(None, 0), out_axes=(None, 0), axis_name=WORKER_AXIS)


def _shard_map_mean(fn, mesh: Mesh, num_workers: int):
    def body(shared, mine):
        # Each device's workers start from the replicated value and then diverge: the carry of
        # their scans must be typed as varying over the worker axis from the start.
        shared = lax.pcast(shared, WORKER_AXIS, to="varying")
        to_average, kept = jax.vmap(fn, in_axes=(None, 0))(shared, mine)
        return _sum_then_mean(to_average, num_workers), kept

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(WORKER_AXIS)), out_specs=(P(), P(WORKER_AXIS))
    )


def _pmap_mean(fn, devices: tuple[jax.Device, ...], num_workers: int):
    per_device = num_workers // len(devices)

    def body(shared, mine):
        to_average, kept = jax.vmap(fn, in_axes=(None, 0))(shared, mine)
        return _sum_then_mean(to_average, num_workers), kept

    mapped = jax.pmap(
        body, axis_name=WORKER_AXIS, in_axes=(None, 0), out_axes=(None, 0), devices=devices
    )

    def run(shared, mine):
        split = lambda x: x.reshape((len(devices), per_device) + x.shape[1:])
        merge = lambda x: x.reshape((num_workers,) + x.shape[2:])
        to_average, kept = mapped(shared, jax.tree.map(split, mine))
        return to_average, jax.tree.map(merge, kept)

    return run

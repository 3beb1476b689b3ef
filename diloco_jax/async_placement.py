"""Where an asynchronous run's arrays live: all on one device, or on the user's mesh.

On a mesh (one worker axis of size M, other axes partitioning each worker), a job of worker m
runs on worker m's devices (the mesh's slice at index m of the worker axis), its params and
inner state sharded there by the params' specs. θ and the outer state sit at the specs on the
whole mesh (replicated over workers), as in `train_diloco`: a job's starting θ is read from
its own devices' copy, and an arriving delta is put on every worker's devices (the transfer
that stands for the worker's send). Per-worker fields of a checkpoint are global arrays
[M, ...] at `P(workers, *spec)` assembled from each worker's shards, never gathered.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_jax import placement as placement_lib
from diloco_jax import sampler as sampler_lib
from diloco_jax.workers import WORKER_AXIS, Backend, stack_workers


class OneDevice:
    """Every array of the run on `device` (the default: jobs run one at a time)."""

    def __init__(self, device: jax.Device):
        self.device = device

    def shared(self, tree: Any) -> Any:
        return jax.device_put(tree, self.device)

    def to_worker(self, tree: Any, worker: int) -> Any:
        return tree

    def shards(self, params: Any) -> None:
        return None  # one device: no per-device count beside the worker's

    def results(self, tree: Any) -> Any:
        return tree

    def arrived(self, delta: Any) -> Any:
        return delta  # already where θ is

    def inner_states(self, init: Callable[[Any], Any], theta: Any, num_workers: int) -> list:
        """One `init(θ)` for every worker: the same object, so a never-updated stack is one
        broadcast (`stack`)."""
        return [self.inner_state(init, theta, 0)] * num_workers

    def inner_state(self, init: Callable[[Any], Any], theta: Any, worker: int) -> Any:
        """`init(θ)` for one worker."""
        return jax.device_put(init(theta), self.device)

    def batch(self, tree: Any, worker: int) -> Any:
        return jax.device_put(tree, self.device)

    def sampler(self, view: Any, worker: int) -> Any:
        """A `WorkerSampler` on the device; its Sampler's specs are checked against a mesh
        with no axes inside a worker (any axis they name is a ValueError naming the field)."""
        mesh = Mesh(np.array([self.device]), (WORKER_AXIS,))
        sampler_lib.specs(
            dataclasses.replace(view.sampler, worker_arrays=_stacked_view(view.mine)), mesh
        )
        return jax.device_put(view, self.device)

    def stack(self, trees: Sequence[Any]) -> Any:
        """[tree_0, ..., tree_{M-1}] -> one tree with leaves stacked [M, ...]."""
        if all(t is trees[0] for t in trees):  # never updated: one broadcast, as init_state
            return stack_workers(trees[0], len(trees))
        return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)

    def unstack(self, tree: Any, num_workers: int) -> list[Any]:
        """Leaves [M, ...] -> M trees, worker m's slices."""
        return [jax.tree.map(lambda x, m=m: x[m], tree) for m in range(num_workers)]


class OnMesh:
    """The run's arrays on `backend`'s mesh (`make_backend(mesh=...)`), params at `specs`."""

    def __init__(self, backend: Backend, params: Any, specs: tuple[P, ...]):
        mesh = backend.mesh
        self.full = placement_lib.placement(params, mesh, specs)
        axis = mesh.axis_names.index(WORKER_AXIS)
        inner = tuple(n for n in mesh.axis_names if n != WORKER_AXIS)
        self.meshes = [
            Mesh(np.take(mesh.devices, m, axis=axis), inner, axis_types=_auto(len(inner)))
            for m in range(backend.num_workers)
        ]
        self.workers = [placement_lib.placement(params, sub, specs) for sub in self.meshes]
        self.batch_spec = backend.batch_spec
        self.backend = backend

    def shards(self, params: Any) -> Any:
        """One device's shard of each param leaf (shapes and dtypes): what it sends of a
        delta."""
        return placement_lib.shard_shapes(params, self.full)

    def results(self, tree: Any) -> Any:
        """The run's final arrays on the user's mesh (`Backend.on_user_mesh`)."""
        return self.backend.on_user_mesh(tree)

    def shared(self, tree: Any) -> Any:
        """θ-like trees (θ, the outer state, a delta) at the specs over the whole mesh."""
        return jax.device_put(tree, self.full.tree(tree, per_worker=False))

    def to_worker(self, tree: Any, worker: int) -> Any:
        return jax.device_put(tree, self.workers[worker].tree(tree, per_worker=False))

    def arrived(self, delta: Any) -> Any:
        """A worker's delta (on its devices) put on every worker's, where θ is: its send."""
        return self.shared(delta)

    def inner_states(self, init: Callable[[Any], Any], theta: Any, num_workers: int) -> list:
        """`init(θ)` for each worker, built in place on its devices."""
        return [self.inner_state(init, theta, m) for m in range(num_workers)]

    def inner_state(self, init: Callable[[Any], Any], theta: Any, worker: int) -> Any:
        """`init(θ)` for one worker, built in place on its devices."""
        start = self.to_worker(theta, worker)
        shardings = self.workers[worker].tree(jax.eval_shape(init, start), per_worker=False)
        return jax.jit(init, out_shardings=shardings)(start)

    def batch(self, tree: Any, worker: int) -> Any:
        """One job's batches, leaves [h, B, ...]: each step's batch at `batch_spec`."""
        mesh = self.meshes[worker]
        return jax.device_put(
            tree, jax.tree.map(lambda x: NamedSharding(mesh, P(None, *self.batch_spec)), tree)
        )

    def sampler(self, view: Any, worker: int) -> Any:
        """A `WorkerSampler` on worker `worker`'s devices, each leaf at the spec the Sampler's
        `sharding` / `worker_sharding` give it there."""
        mesh = self.meshes[worker]
        shared, mine = sampler_lib.specs(
            dataclasses.replace(view.sampler, worker_arrays=_stacked_view(view.mine)), mesh
        )
        to = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
        return type(view)(
            dataclasses.replace(
                view.sampler, arrays=jax.device_put(view.sampler.arrays, jax.tree.map(to, shared))
            ),
            jax.device_put(view.mine, jax.tree.map(to, mine)),
        )

    def stack(self, trees: Sequence[Any]) -> Any:
        """Per-worker trees (worker m's on its devices, or θ-like ones on the whole mesh) ->
        global leaves [M, ...] at `P(workers, *spec)`, each device keeping its own shard."""
        shardings = self.full.tree(jax.eval_shape(lambda t: stack_workers(t, 1), trees[0]), True)
        trees = [self.to_worker(t, m) for m, t in enumerate(trees)]
        return jax.tree.map(_stacked, shardings, *trees)

    def unstack(self, tree: Any, num_workers: int) -> list[Any]:
        """Global leaves [M, ...] -> M trees, worker m's slice on its devices."""
        like = jax.eval_shape(lambda t: jax.tree.map(lambda x: x[0], t), tree)
        return [
            jax.tree.map(_slice, tree, placed.tree(like, per_worker=False))
            for placed in self.workers
        ]


def _stacked_view(mine: Any) -> Any:
    """Shapes of a one-worker stack of `mine` (what `sampler.specs` reads slices from)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *np.shape(x)), jnp.result_type(x)), mine)


def _stacked(sharding: NamedSharding, *xs: jax.Array) -> jax.Array:
    shape = (len(xs), *xs[0].shape)
    pieces = [s.data[None] for x in xs for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(shape, sharding, pieces)


def _slice(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """Worker slice of global `x` [M, ...] whose devices `sharding` holds, from their shards."""
    devices = sharding.device_set
    pieces = [s.data[0] for s in x.addressable_shards if s.device in devices]
    return jax.make_array_from_single_device_arrays(x.shape[1:], sharding, pieces)


def _auto(count: int) -> tuple:
    return (jax.sharding.AxisType.Auto,) * count

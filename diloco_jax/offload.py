"""θ and the outer state in host memory (`outer_state_memory="pinned_host"`): they sit in
the devices' pinned host memory between rounds and for the H inner steps, and come to the
device inside the compiled round only where a step reads them.

Inside the round (`diloco_round(..., outer_state_memory="pinned_host")`) θ is copied to the
device three times a sync: at the round's start (the workers' starting params, unless they
carry their own), after the inner steps for the deltas θ - θ_m, and, with the outer state,
after the mean delta for the outer update. An optimization barrier ties each copy to the value
it waits for (the workers' snapshot, the mean), so XLA cannot hoist the copy into the inner
steps and keep the device copy live across them. With the outer state split over the
workers (ZeRO-1) the update's copies (θ's leaves, this device's outer-state shards) come
before the reduce-scatter: the per-worker shards tied to the worker's delta, the shared ones
untied (a barrier with a per-worker value would make them per-worker too; the compiled
1b round's temporaries show no hoisted copy). The new θ and outer state go back to host
memory as the round's outputs (their shardings carry the memory kind). The arithmetic is the
on-device round's, so results are equal bit for bit; the cost is the host-device traffic (3
|θ| + 2 |outer state| per round) against H inner steps.
"""

from typing import Any

import jax
from jax import lax

from diloco_jax.carry import Carry, Role
from diloco_jax.schedule import leaf_indices

MEMORIES = ("device", "pinned_host")
HOST = "pinned_host"


def check_memory(value: Any) -> str:
    """`value` if it is one of MEMORIES; ValueError naming outer_state_memory otherwise."""
    if not isinstance(value, str) or value not in MEMORIES:
        raise ValueError(f"outer_state_memory must be one of {MEMORIES}, got {value!r}")
    return value


def fetch(tree: Any, after: Any = None) -> Any:
    """Device copies of `tree` (arrays in host memory), made after `after` is computed (its
    values untouched) when given."""
    if after is not None:
        tree, _ = lax.optimization_barrier((tree, after))
    return jax.device_put(tree, jax.memory.Space.Device)


def in_device_memory(tree: Any) -> Any:
    """`tree` with every array in host memory copied to device memory (the others as they
    are), called outside jit: what a caller gets back as params. The copy is `fetch`
    compiled: JAX 0.12's eager `device_put` refuses a CPU array that a compiled program left
    in pinned host memory ("Unsupported layout")."""
    leaves, treedef = jax.tree.flatten(tree)
    host = [i for i, x in enumerate(leaves)
            if getattr(getattr(x, "sharding", None), "memory_kind", None) == HOST]  # fmt: skip
    if not host:
        return tree
    copies = _compiled_fetch([leaves[i] for i in host])
    for i, copy in zip(host, copies, strict=True):
        leaves[i] = copy
    return jax.tree.unflatten(treedef, leaves)


_compiled_fetch = jax.jit(fetch)


class DeviceMemory(Role):
    """θ and the outer state live in device memory: every fetch is the value itself."""

    name = "memory"

    def fetch(self, tree: Any) -> Any:
        return tree

    def delta_base(self, old: Any, snapshot_k: Any, collectives: Any) -> Any:
        return old

    def for_update(self, c: Carry, sync: Any, old: Any, outer: Any, mean: Any) -> tuple:
        return old, outer, c

    def for_split_update(self, c: Carry, sync: Any, old, shared, local, sums) -> tuple:
        return old, shared, local, c

    def merge_source(self, c: Carry, theta: tuple, mean: Any) -> list:
        return list(theta)


class HostMemory(Role):
    """θ and the outer state arrive in pinned host memory (`outer_state_memory=
    "pinned_host"`): each point that reads them copies what it reads to the device, after
    the value it waits for (see the module docstring). Keeps the indices of θ's leaves
    already copied for the outer update, so the merge copies only the rest."""

    name = "memory"

    def begin(self, c: Carry, ctx: Any) -> Carry:
        return c.with_own(self.name, frozenset())

    def fetch(self, tree: Any) -> Any:
        return fetch(tree)

    def delta_base(self, old: Any, snapshot_k: Any, collectives: Any) -> Any:
        # θ's leaves from host memory, once the workers' steps are done
        return fetch(collectives.vary(old), after=snapshot_k)

    def for_update(self, c: Carry, sync: Any, old: Any, outer: Any, mean: Any) -> tuple:
        old, outer = fetch((old, outer), after=mean)
        return old, outer, self._on_device(c, sync)

    def for_split_update(self, c: Carry, sync: Any, old, shared, local, sums) -> tuple:
        # θ's leaves and this device's outer-state pieces (θ and the shared pieces are the
        # same on every worker: tied to no per-worker value, they stay so)
        old, shared = fetch((old, shared))
        return old, shared, fetch(local, after=sums), self._on_device(c, sync)

    def merge_source(self, c: Carry, theta: tuple, mean: Any) -> list:
        # A left-out worker restarts from all of θ: the leaves not updated here from host memory.
        on_device = c.own[self.name]
        return [g if i in on_device else fetch(g, after=mean) for i, g in enumerate(theta)]

    def _on_device(self, c: Carry, sync: Any) -> Carry:
        indices = leaf_indices(sync, len(c.theta))
        return c.with_own(self.name, c.own[self.name] | set(indices))

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
    are), outside jit: what a caller gets back as params."""

    def one(x):
        sharding = getattr(x, "sharding", None)
        if getattr(sharding, "memory_kind", None) != HOST:
            return x
        return jax.device_put(x, sharding.with_memory_kind("device"))

    return jax.tree.map(one, tree)

"""In-graph data: a pure sampling function plus the device-resident arrays it reads.

With a `Sampler` as `data`, each inner step's batch is drawn inside the round's scan, so no
[M, H, ...] batch is built on the host or copied per round, and memory does not grow with H.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampler:
    """`sample(arrays, round, worker, step) -> batch` for one worker and one inner step.

    sample: a pure jittable function; `round`, `worker` and `step` are int32 scalars (for
      `train_sync`, `round` is the step index and `step` is 0). It must derive any randomness
      from its arguments (e.g. `jax.random.fold_in` of a key held in `arrays`), so a run is
      reproducible and can resume at any round.
    arrays: a pytree of arrays (e.g. the token stream and a base key), placed on the devices
      once and passed to every round as an argument, never baked into the program.
    """

    arrays: Any
    sample: Callable[[Any, jax.Array, jax.Array, jax.Array], Any] = dataclasses.field(
        metadata=dict(static=True)
    )


def split_data(data: Any, num_workers: int, counter: jax.Array) -> tuple[Any, Any]:
    """Splits a round's data into (shared, per-worker) inputs of `Backend.map_mean`.

    A `Sampler` shares its arrays and the round counter, and hands each worker its int32 id;
    host batches (leaves [M, ...]) are all per-worker.
    """
    if isinstance(data, Sampler):
        return (data.arrays, counter), jnp.arange(num_workers, dtype=jnp.int32)
    return None, data


def worker_batches(data: Any, shared: Any, mine: Any, step: int | None = None) -> Any:
    """This worker's batches from `split_data`'s parts: its host slice, or for a `Sampler`
    a function step -> batch (or, with `step` given, that one step's batch)."""
    if not isinstance(data, Sampler):
        return mine
    arrays, counter = shared
    if step is not None:
        return data.sample(arrays, counter, mine, jnp.int32(step))
    return lambda h: data.sample(arrays, counter, mine, h)


def num_workers_of(data: Any, num_workers: int | None) -> int:
    """M from host batches' leading dim, or the explicit `num_workers` a Sampler needs."""
    if isinstance(data, Sampler):
        if num_workers is None:
            raise ValueError("num_workers is required when data is a Sampler")
        return num_workers
    return jax.tree.leaves(data)[0].shape[0]

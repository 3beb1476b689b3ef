"""The synchronous data-parallel baseline: every step, the workers' gradients are averaged
and one optimizer update is applied (an M x larger global batch)."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from diloco_jax.inner import LossFn, check_loss_options, loss_and_aux, step_means, worker_key
from diloco_jax.sampler import num_workers_of, split_data, worker_batches
from diloco_jax.workers import Backend, make_backend


class SyncState(NamedTuple):
    """params: the replicated params; opt_state: optimizer state; step: int32 steps done."""

    params: Any
    opt_state: Any
    step: jax.Array


def init_sync_state(params: Any, optimizer: optax.GradientTransformation) -> SyncState:
    """Step-0 state, params copied (never aliased)."""
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    return SyncState(params, optimizer.init(params), jnp.zeros((), jnp.int32))


def sync_step(
    loss_fn: LossFn,
    state: SyncState,
    batch: Any,
    *,
    optimizer: optax.GradientTransformation,
    backend: "str | Backend" = "vmap",
    num_workers: int | None = None,
    has_aux: bool = False,
    rng_seed: int | None = None,
) -> tuple[SyncState, dict[str, jax.Array]]:
    """One data-parallel step. Pure; jit it.

    Args:
      batch: batch pytree with leaves [M, ...] (worker m's batch is leaf[m]); or a `Sampler`
        (called with round = the step index and step = 0) with `num_workers`.
      has_aux, rng_seed: as for `diloco_round`; worker m's key at step s is
        `worker_key(rng_seed, s, m)` (`diloco_jax.inner`).
    Returns:
      (new state, metrics): "loss" float32 mean over workers, "worker_loss" float32 [M], and
      each aux metric the same way. The gradients are averaged over workers in the params'
      dtype.
    """
    check_loss_options(has_aux, rng_seed)
    num_workers = num_workers_of(batch, num_workers)
    backend = make_backend(backend, num_workers)
    shared_data, per_worker_data = split_data(batch, num_workers, state.step)
    ids_M = None if rng_seed is None else jnp.arange(num_workers, dtype=jnp.int32)

    def worker(shared, mine):
        (params, shared_data, step), (my_data, my_id) = shared, mine
        my_batch = worker_batches(batch, shared_data, my_data, step=0)
        key = None if rng_seed is None else worker_key(rng_seed, step, my_id)
        (loss, aux), grads = jax.value_and_grad(
            lambda p: loss_and_aux(loss_fn, p, my_batch, key, has_aux), has_aux=True
        )(params)
        return grads, (loss.astype(jnp.float32), aux)

    grads, outputs_M = backend.map_mean(worker)(
        (state.params, shared_data, state.step), (per_worker_data, ids_M)
    )
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    losses_M, aux_M = outputs_M
    metrics = step_means(losses_M[:, None], {k: v[:, None] for k, v in aux_M.items()}, None)
    return SyncState(params, opt_state, state.step + 1), metrics

"""The synchronous data-parallel baseline: every step, the workers' gradients are averaged
and one optimizer update is applied (an M x larger global batch)."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from diloco_jax.inner import LossFn, checked_loss
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
) -> tuple[SyncState, dict[str, jax.Array]]:
    """One data-parallel step. Pure; jit it.

    Args:
      batch: batch pytree with leaves [M, ...] (worker m's batch is leaf[m]); or a `Sampler`
        (called with round = the step index and step = 0) with `num_workers`.
    Returns:
      (new state, metrics): "loss" float32 mean over workers, "worker_loss" float32 [M].
      The gradients are averaged over workers in the params' dtype.
    """
    num_workers = num_workers_of(batch, num_workers)
    backend = make_backend(backend, num_workers)
    shared_data, per_worker_data = split_data(batch, num_workers, state.step)

    def worker(shared, my_data):
        params, shared_data = shared
        my_batch = worker_batches(batch, shared_data, my_data, step=0)
        loss, grads = jax.value_and_grad(checked_loss(loss_fn))(params, my_batch)
        return grads, loss.astype(jnp.float32)

    grads, losses_M = backend.map_mean(worker)((state.params, shared_data), per_worker_data)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": jnp.mean(losses_M), "worker_loss": losses_M}
    return SyncState(params, opt_state, state.step + 1), metrics

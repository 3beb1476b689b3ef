"""The synchronous data-parallel baseline: every step, the workers' gradients are averaged
and one optimizer update is applied (an M x larger global batch)."""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from diloco_jax import model_state as model_states
from diloco_jax.inner import LossFn, check_loss_options, loss_gradients, step_means, worker_key
from diloco_jax.sampler import num_workers_of, split_data, worker_batches
from diloco_jax.workers import Backend, exact_mean, make_backend, stack_workers


class SyncState(NamedTuple):
    """params: the replicated params; opt_state: optimizer state; step: int32 steps done;
    model_state: each worker's model state, leaves [M, ...] (merged every step), or None."""

    params: Any
    opt_state: Any
    step: jax.Array
    model_state: Any = None

    PER_WORKER = ("model_state",)  # the schema (`placement.map_fields`)


def init_sync_state(
    params: Any,
    optimizer: optax.GradientTransformation,
    model_state: Any = None,
    num_workers: int | None = None,
) -> SyncState:
    """Step-0 state, params copied (never aliased); a `model_state` copied to each of the
    `num_workers` workers."""
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    if model_state is not None:
        if num_workers is None:
            raise ValueError("init_sync_state needs num_workers with a model_state")
        model_states.check_model_state(model_state)
        model_state = stack_workers(model_state, num_workers)
    return SyncState(params, optimizer.init(params), jnp.zeros((), jnp.int32), model_state)


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
    model_state_merge: Any = None,
) -> tuple[SyncState, dict[str, jax.Array]]:
    """One data-parallel step. Pure; jit it.

    Args:
      batch: batch pytree with leaves [M, ...] (worker m's batch is leaf[m]); or a `Sampler`
        (called with round = the step index and step = 0) with `num_workers`.
      has_aux, rng_seed: as for `diloco_round`; worker m's key at step s is
        `worker_key(rng_seed, s, m)` (`diloco_jax.inner`).
      model_state_merge: with a model state in `state`, its merge rules (as for
        `diloco_round`), applied after every step; `loss_fn(params, model_state, batch[,
        key]) -> (loss, new_model_state)` (or `(loss, (new_model_state, aux))`).
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
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.model_state)
    rules = model_states.merge_rules(one, model_state_merge)

    def worker(shared, mine):
        (params, shared_data, step), (my_data, my_id, my_model_state) = shared, mine
        my_batch = worker_batches(batch, shared_data, my_data, step=0)
        key = None if rng_seed is None else worker_key(rng_seed, step, my_id)
        grads, new_model_state, loss, aux = loss_gradients(
            loss_fn, params, my_model_state, my_batch, key, has_aux, rules is not None
        )
        return grads, ((loss.astype(jnp.float32), aux), new_model_state)

    mean = functools.partial(exact_mean, num_workers=num_workers)

    def body(shared, local, collectives):
        shared = collectives.vary(shared)
        grads_k, (outputs_k, model_k) = jax.vmap(worker, in_axes=(None, 0))(shared, local)
        if rules is not None:
            model_k = model_states.merge(model_k, rules, collectives, num_workers)
        return collectives.reduce(mean, grads_k), (outputs_k, model_k)

    grads, (outputs_M, model_state) = backend.map_workers(body)(
        (state.params, shared_data, state.step), (per_worker_data, ids_M, state.model_state)
    )
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    losses_M, aux_M = outputs_M
    metrics = step_means(losses_M[:, None], {k: v[:, None] for k, v in aux_M.items()}, None)
    return SyncState(params, opt_state, state.step + 1, model_state), metrics

"""DiLoCo state and one communication round: inner loops on every worker, mean of the deltas,
outer update. One round is one traced function (jit it once; H steps never dispatch alone)."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from diloco_jax.inner import LossFn, inner_loop
from diloco_jax.outer import outer_init, outer_update, worker_delta
from diloco_jax.sampler import num_workers_of, split_data, worker_batches
from diloco_jax.workers import Backend, make_backend


class DiLoCoState(NamedTuple):
    """Everything a DiLoCo run carries between rounds.

    params: global θ, the caller's structure, shapes and dtypes.
    outer_opt_state: outer optimizer state over θ in `delta_dtype` (float32 or wider).
    inner_opt_state: each worker's inner optimizer state, leaves stacked [M, ...].
    round: int32 scalar, rounds completed.
    """

    params: Any
    outer_opt_state: Any
    inner_opt_state: Any
    round: jax.Array


def default_inner_optimizer() -> optax.GradientTransformation:
    """The paper's inner optimizer: AdamW(lr 4e-4, b1 0.9, b2 0.95, weight decay 0.1)."""
    return optax.adamw(4e-4, b1=0.9, b2=0.95, weight_decay=0.1)


def default_outer_optimizer() -> optax.GradientTransformation:
    """The paper's outer optimizer: SGD with Nesterov momentum (lr 0.7, momentum 0.9)."""
    return optax.sgd(0.7, momentum=0.9, nesterov=True)


def stack_workers(tree: Any, num_workers: int) -> Any:
    """Repeats every leaf along a new leading worker axis: [...] -> [M, ...]."""
    return jax.tree.map(lambda x: jnp.repeat(jnp.asarray(x)[None], num_workers, axis=0), tree)


def init_state(
    params: Any,
    num_workers: int,
    inner_optimizer: optax.GradientTransformation,
    outer_optimizer: optax.GradientTransformation,
) -> DiLoCoState:
    """Round-0 state: θ copied (never aliased), M identical inner states, fresh outer state."""
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    return DiLoCoState(
        params=params,
        outer_opt_state=outer_init(outer_optimizer, params),
        inner_opt_state=stack_workers(inner_optimizer.init(params), num_workers),
        round=jnp.zeros((), jnp.int32),
    )


def diloco_round(
    loss_fn: LossFn,
    state: DiLoCoState,
    batches: Any,
    *,
    inner_optimizer: optax.GradientTransformation,
    outer_optimizer: optax.GradientTransformation,
    backend: "str | Backend" = "vmap",
    num_workers: int | None = None,
    inner_steps: int | None = None,
) -> tuple[DiLoCoState, dict[str, jax.Array]]:
    """One DiLoCo communication round (Algorithm 1, one outer iteration). Pure; jit it.

    Args:
      loss_fn: (params, batch) -> float scalar.
      state: from `init_state` or a previous round.
      batches: batch pytree with leaves [M, H, ...] (worker m's step h uses leaf[m, h]); or a
        `Sampler` drawing each step's batch in the graph, with `num_workers` and `inner_steps`.
      inner_optimizer, outer_optimizer: optax transformations (state built with the same ones).
      backend: "vmap" | "shard_map" | "pmap" | "auto", or a `Backend` from `make_backend`.

    Returns:
      (new state, metrics) with metrics "loss" (float32 mean inner loss), "worker_loss"
      (float32 [M], each worker's mean over its H steps, each taken before that step's
      update) and "outer_grad_norm" (global L2 norm of the averaged delta Δ).
    """
    num_workers = num_workers_of(batches, num_workers)
    backend = make_backend(backend, num_workers)
    shared_data, per_worker_data = split_data(batches, num_workers, state.round)

    def worker(shared, mine):
        global_params, shared_data = shared
        inner_opt_state, my_data = mine
        params, inner_opt_state, losses_H = inner_loop(
            loss_fn,
            inner_optimizer,
            global_params,
            inner_opt_state,
            worker_batches(batches, shared_data, my_data),
            num_steps=inner_steps,
        )
        return worker_delta(global_params, params), (inner_opt_state, losses_H)

    delta, (inner_opt_state, losses_MxH) = backend.map_mean(worker)(
        (state.params, shared_data), (state.inner_opt_state, per_worker_data)
    )
    params, outer_opt_state = outer_update(
        outer_optimizer, state.params, state.outer_opt_state, delta
    )
    metrics = {
        "loss": jnp.mean(losses_MxH),
        "worker_loss": jnp.mean(losses_MxH, axis=1),
        "outer_grad_norm": optax.tree.norm(delta).astype(jnp.float32),
    }
    return DiLoCoState(params, outer_opt_state, inner_opt_state, state.round + 1), metrics

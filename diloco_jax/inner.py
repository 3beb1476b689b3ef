"""The inner loop: H optax steps of one worker, as one `lax.scan`."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

LossFn = Callable[[Any, Any], jax.Array]


def checked_loss(loss_fn: LossFn) -> LossFn:
    """Wraps `loss_fn` so a non-scalar or non-float loss fails at trace time, naming it."""

    def loss(params, batch):
        value = loss_fn(params, batch)
        shape, dtype = jnp.shape(value), jnp.result_type(value)
        if shape != () or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"loss_fn must return a float scalar, got shape {shape} and dtype {dtype}"
            )
        return value

    return loss


def inner_step(
    loss_fn: LossFn, optimizer: optax.GradientTransformation, params, opt_state, batch
) -> tuple[Any, Any, jax.Array]:
    """One optax step on `batch`: returns (params, opt_state, loss before the update)."""
    loss, grads = jax.value_and_grad(checked_loss(loss_fn))(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def inner_loop(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    batches_H: Any,
    *,
    num_steps: int | None = None,
) -> tuple[Any, Any, jax.Array]:
    """Runs H inner steps of one worker under `lax.scan`.

    Args:
      loss_fn: (params, batch) -> float scalar.
      optimizer: any optax transformation (DiLoCo's default is AdamW).
      params: the worker's starting params (the global params at the round's start).
      opt_state: the worker's inner optimizer state (persists across rounds).
      batches_H: batch pytree whose leaves are [H, ...] (step h uses leaf[h]); or a function
        step -> batch (int32 scalar step in [0, H)) that draws each batch inside the scan,
        with `num_steps=H`.

    Returns:
      (params after H steps, opt_state after H steps, losses_H float32 [H]) where
      losses_H[h] is the loss at step h taken before that step's update. Dtypes of params and
      opt_state are kept. Pure: nothing is mutated.
    """
    if callable(batches_H):
        if num_steps is None:
            raise ValueError("num_steps is required when batches_H is a function")
        batch_of, xs = batches_H, jnp.arange(num_steps, dtype=jnp.int32)
    else:
        batch_of, xs = (lambda batch: batch), batches_H

    def step(carry, x):
        params, opt_state = carry
        params, opt_state, loss = inner_step(loss_fn, optimizer, params, opt_state, batch_of(x))
        return (params, opt_state), loss.astype(jnp.float32)

    (params, opt_state), losses_H = lax.scan(step, (params, opt_state), xs)
    return params, opt_state, losses_H

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


def masked_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    batch: Any,
    active: jax.Array | None = None,
) -> tuple[Any, Any, jax.Array]:
    """`inner_step` with its loss in float32; where the bool scalar `active` is False the
    params and optimizer state stay as they were and the loss is 0 (a worker past its h_m
    steps). None: always active."""
    new_params, new_state, loss = inner_step(loss_fn, optimizer, params, opt_state, batch)
    loss = loss.astype(jnp.float32)
    if active is None:
        return new_params, new_state, loss
    kept = jax.tree.map(
        lambda a, b: jnp.where(active, a, b), (new_params, new_state), (params, opt_state)
    )
    return *kept, jnp.where(active, loss, 0.0)


def inner_loop(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    batches_H: Any,
    *,
    num_steps: int | None = None,
    active_steps: jax.Array | None = None,
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
      active_steps: optional int32 scalar h_m in [1, H]: only the first h_m steps update
        (a slow worker under vmap still scans H steps; later steps' results are discarded
        with `jnp.where` on the carry, so optimizer counts don't advance and their losses
        are 0).

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
    if active_steps is not None:  # scan the step index along, only when it is needed
        steps = jax.tree.leaves(xs)[0].shape[0]
        xs = (jnp.arange(steps, dtype=jnp.int32), xs)

    def step(carry, x):
        h, x = x if active_steps is not None else (None, x)
        active = None if active_steps is None else h < active_steps
        params, opt_state, loss = masked_step(loss_fn, optimizer, *carry, batch_of(x), active)
        return (params, opt_state), loss

    (params, opt_state), losses_H = lax.scan(step, (params, opt_state), xs)
    return params, opt_state, losses_H

"""The inner loop: H optax steps of one worker, as one `lax.scan`."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

LossFn = Callable[..., Any]
Aux = dict[str, jax.Array]


def loss_and_aux(
    loss_fn: LossFn, params: Any, batch: Any, key: jax.Array | None = None, has_aux: bool = False
) -> tuple[jax.Array, Aux]:
    """Calls `loss_fn(params, batch)` (or `(params, batch, key)` with a key) and checks what
    it returns, at trace time, naming `loss_fn`: a float scalar loss; with `has_aux`, a pair
    (loss, aux) with aux a dict of str -> numeric scalars (returned as float32; {} without
    has_aux)."""
    out = loss_fn(params, batch) if key is None else loss_fn(params, batch, key)
    if has_aux:
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise ValueError(
                "loss_fn with has_aux=True must return (loss, aux), aux a dict of scalars; "
                f"got {type(out).__name__}"
            )
        loss, aux = out
        if not isinstance(aux, dict) or not all(isinstance(k, str) for k in aux):
            raise ValueError(f"loss_fn's aux must be a dict of str -> scalar, got {aux!r}")
        for name, value in aux.items():
            dtype = jnp.result_type(value)
            if jnp.shape(value) != () or not (
                jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
                or jnp.issubdtype(dtype, jnp.bool_)
            ):  # fmt: skip
                raise ValueError(
                    f"loss_fn's aux[{name!r}] must be a numeric scalar, got shape "
                    f"{jnp.shape(value)} and dtype {dtype}"
                )
        aux = {k: jnp.asarray(v).astype(jnp.float32) for k, v in aux.items()}
    elif isinstance(out, tuple | list):
        raise ValueError(
            "loss_fn returned a tuple: to report (loss, aux) metrics pass has_aux=True"
        )
    else:
        loss, aux = out, {}
    shape, dtype = jnp.shape(loss), jnp.result_type(loss)
    if shape != () or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"loss_fn must return a float scalar, got shape {shape} and dtype {dtype}")
    return loss, aux


# The names a round's metrics and a trainer's history already use: aux names must differ.
RESERVED_METRICS = (
    "loss", "worker_loss", "outer_grad_norm", "excluded_workers", "dropped_workers", "skipped",
    "round", "step", "steps", "bytes_communicated", "wire_bytes",
)  # fmt: skip


def check_loss_options(has_aux: Any, rng_seed: Any) -> None:
    """Raises ValueError naming `has_aux` (not a bool) or `rng_seed` (not None or an int >= 0)."""
    if not isinstance(has_aux, bool):
        raise ValueError(f"has_aux must be True or False, got {has_aux!r}")
    if rng_seed is not None and (
        isinstance(rng_seed, bool) or not isinstance(rng_seed, int) or rng_seed < 0
    ):
        raise ValueError(f"rng_seed must be None or an integer >= 0, got {rng_seed!r}")


def step_means(loss_MxH: jax.Array, aux_MxH: Aux, steps_M: jax.Array | None) -> dict:
    """The loss and each aux output [M, H] as means over the steps taken: over every worker's
    steps as metrics[name], per worker as metrics["worker_" + name] ([M]). `steps_M`: the
    steps each worker took (masked steps hold 0), None for all H. Raises ValueError naming
    `loss_fn` for an aux name that collides with a metric or history key."""
    names = ["loss", *aux_MxH]
    for name in aux_MxH:
        for key in (name, "worker_" + name):
            if key in RESERVED_METRICS or (key != name and key in names):
                raise ValueError(f"loss_fn's aux name {name!r} collides with the metric {key!r}")
    metrics = {}
    for name, x_MxH in {"loss": loss_MxH, **aux_MxH}.items():
        if steps_M is None:
            metrics[name], metrics["worker_" + name] = jnp.mean(x_MxH), jnp.mean(x_MxH, axis=1)
        else:  # skipped steps hold 0: divide by the steps taken
            steps_f = steps_M.astype(jnp.float32)
            metrics[name] = jnp.sum(x_MxH) / jnp.sum(steps_f)
            metrics["worker_" + name] = jnp.sum(x_MxH, axis=1) / steps_f
    return metrics


def step_key(base_key: jax.Array, step: jax.Array) -> jax.Array:
    """The key of one inner step: `fold_in(base_key, step)` (see `worker_key`)."""
    return jax.random.fold_in(base_key, step)


def worker_key(seed: int, round_: jax.Array, worker: jax.Array) -> jax.Array:
    """The base key of worker m's inner steps in round r: fold_in(fold_in(PRNGKey(seed), r),
    m); step h's key is `step_key(worker_key(...), h)`. It depends on (seed, round, worker,
    step) only: not on the backend, the mesh, or where a run resumed."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), round_), worker)


def _step(loss_fn, optimizer, params, opt_state, batch, key, has_aux):
    """One optax step: (params, opt_state, loss before the update, aux)."""
    (loss, aux), grads = jax.value_and_grad(
        lambda p: loss_and_aux(loss_fn, p, batch, key, has_aux), has_aux=True
    )(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, aux


def inner_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    params,
    opt_state,
    batch,
    *,
    key: jax.Array | None = None,
    has_aux: bool = False,
) -> tuple:
    """One optax step on `batch`: returns (params, opt_state, loss before the update), and
    the aux dict after them with `has_aux`. With `key`, `loss_fn(params, batch, key)`."""
    params, opt_state, loss, aux = _step(loss_fn, optimizer, params, opt_state, batch, key, has_aux)
    return (params, opt_state, loss, aux) if has_aux else (params, opt_state, loss)


def masked_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    batch: Any,
    active: jax.Array | None = None,
    *,
    key: jax.Array | None = None,
    has_aux: bool = False,
) -> tuple[Any, Any, jax.Array, Aux]:
    """`inner_step` with its loss and aux in float32; where the bool scalar `active` is
    False the params and optimizer state stay as they were and the loss and aux are 0 (a
    worker past its h_m steps). None: always active. Returns (params, opt_state, loss, aux)."""
    new_params, new_state, loss, aux = _step(
        loss_fn, optimizer, params, opt_state, batch, key, has_aux
    )
    loss = loss.astype(jnp.float32)
    if active is None:
        return new_params, new_state, loss, aux
    kept = jax.tree.map(
        lambda a, b: jnp.where(active, a, b), (new_params, new_state), (params, opt_state)
    )
    zeroed = jax.tree.map(lambda x: jnp.where(active, x, 0.0), (loss, aux))
    return *kept, *zeroed


def inner_loop(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    batches_H: Any,
    *,
    num_steps: int | None = None,
    active_steps: jax.Array | None = None,
    key: jax.Array | None = None,
    first_step: int = 0,
    has_aux: bool = False,
) -> tuple:
    """Runs H inner steps of one worker under `lax.scan`.

    Args:
      loss_fn: (params, batch) -> float scalar; (params, batch, key) with `key`; returning
        (loss, aux dict of scalars) with `has_aux`.
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
      key: optional base key (`worker_key`): step h draws `step_key(key, first_step + h)`.
      first_step: the index of this scan's first step within the round (0 unless the round
        pauses, e.g. at a Streaming DiLoCo sync).

    Returns:
      (params after H steps, opt_state after H steps, losses_H float32 [H]) where
      losses_H[h] is the loss at step h taken before that step's update, and with `has_aux`
      the aux dict of float32 [H] after them. Dtypes of params and opt_state are kept. Pure:
      nothing is mutated.
    """
    if callable(batches_H):
        if num_steps is None:
            raise ValueError("num_steps is required when batches_H is a function")
        batch_of, xs = batches_H, jnp.arange(num_steps, dtype=jnp.int32)
    else:
        batch_of, xs = (lambda batch: batch), batches_H
    indexed = active_steps is not None or key is not None
    if indexed:  # scan the step index along, only when it is needed
        steps = jax.tree.leaves(xs)[0].shape[0]
        xs = (jnp.arange(steps, dtype=jnp.int32), xs)

    def step(carry, x):
        h, x = x if indexed else (None, x)
        active = None if active_steps is None else h < active_steps
        h_key = None if key is None else step_key(key, first_step + h)
        params, opt_state, loss, aux = masked_step(
            loss_fn, optimizer, *carry, batch_of(x), active, key=h_key, has_aux=has_aux
        )
        return (params, opt_state), (loss, aux)

    (params, opt_state), (losses_H, aux_H) = lax.scan(step, (params, opt_state), xs)
    return (params, opt_state, losses_H, aux_H) if has_aux else (params, opt_state, losses_H)

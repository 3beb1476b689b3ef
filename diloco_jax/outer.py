"""The outer step: worker deltas, their mean over the worker axis, the outer optax update.

Deltas and outer optimizer state live in `delta_dtype(param dtype)`: at least float32, and the
param's own dtype when it is wider (float64 under x64). Params keep their own dtype.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax


def delta_dtype(dtype) -> np.dtype:
    """The dtype deltas and outer state use for a param of `dtype`: float32 or wider."""
    return np.dtype(jnp.promote_types(dtype, jnp.float32))


def widen(tree: Any) -> Any:
    """Casts every leaf to its `delta_dtype`."""
    return jax.tree.map(lambda x: jnp.asarray(x).astype(delta_dtype(jnp.result_type(x))), tree)


def worker_delta(global_params: Any, worker_params: Any) -> Any:
    """Δ_m = θ - θ_m, leafwise, in `delta_dtype` (the outer 'gradient' of worker m)."""
    return jax.tree.map(lambda g, w: widen(g) - widen(w), global_params, worker_params)


def outer_init(outer_optimizer: optax.GradientTransformation, params: Any) -> Any:
    """The outer optimizer state, initialised on the widened params."""
    return outer_optimizer.init(widen(params))


def outer_update(
    outer_optimizer: optax.GradientTransformation,
    params: Any,
    outer_opt_state: Any,
    delta: Any,
    age: Any = None,
) -> tuple[Any, Any]:
    """θ ← θ + outer_update(Δ), with Δ (the worker-mean delta) taken as the gradient.

    The update is applied in the delta dtype and the result cast back to each param's dtype.
    `age`: the outer updates applied since Δ's params (an int or int32 scalar; None: none, a
    fresh Δ), passed to the optimizer as optax's extra argument `age` (`diloco_jax.cgad_outer`
    reads it; a transformation without extra arguments ignores it). Returns (new params,
    new outer_opt_state).
    """
    wide = widen(params)
    if age is None:
        updates, outer_opt_state = outer_optimizer.update(delta, outer_opt_state, wide)
    else:
        updates, outer_opt_state = optax.with_extra_args_support(outer_optimizer).update(
            delta, outer_opt_state, wide, age=age
        )
    new_params = jax.tree.map(
        lambda p, w, u: (w + u).astype(jnp.result_type(p)), params, wide, updates
    )
    return new_params, outer_opt_state


def mean_norm(means: tuple) -> jax.Array:
    """float32 global L2 norm of a round's mean deltas (one tree per sync)."""
    return optax.tree.norm(means[0] if len(means) == 1 else list(means)).astype(jnp.float32)


def outer_step(
    outer_optimizer: optax.GradientTransformation,
    params: Any,
    outer_opt_state: Any,
    worker_params: Any,
    axis_name: str,
) -> tuple[Any, Any, Any]:
    """The whole outer step for code running inside a mapped worker axis.

    Call it inside `jax.vmap(..., axis_name=axis_name)`, `shard_map` or `pmap`, with `params`
    the global θ (same on every worker) and `worker_params` this worker's θ_m after its inner
    loop. Returns (new θ, new outer_opt_state, Δ) where Δ = pmean over `axis_name` of θ - θ_m.
    """
    delta = lax.pmean(worker_delta(params, worker_params), axis_name)
    new_params, outer_opt_state = outer_update(outer_optimizer, params, outer_opt_state, delta)
    return new_params, outer_opt_state, delta


def clip_outer_norm(max_norm: float, eps: float = 1e-6) -> optax.GradientTransformation:
    """EDiT's pseudo-gradient clip (Cheng et al. 2024), to chain before an outer optimizer:
    Δ <- Δ · min(1, φ / (‖Δ‖ + eps)), ‖Δ‖ the global L2 norm over the leaves, φ = `max_norm`
    > 0. Stateless; each leaf keeps its dtype. Raises ValueError naming `max_norm`."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float):
        raise ValueError(f"max_norm (outer_clip) must be a number > 0, got {max_norm!r}")
    if not 0 < max_norm < float("inf"):
        raise ValueError(f"max_norm (outer_clip) must be a number > 0, got {max_norm!r}")

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None):
        del params
        scale = jnp.minimum(1.0, max_norm / (optax.tree.norm(updates) + eps))
        return jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates), state

    return optax.GradientTransformation(init, update)


def cast_state(
    outer_optimizer: optax.GradientTransformation, dtype: Any
) -> optax.GradientTransformation:
    """`outer_optimizer` with its floating state stored in `dtype` (e.g. bfloat16 momentum:
    half the bytes of float32) and computed in the updates' dtype: each update casts the state
    up, runs `outer_optimizer` (so the update itself uses the unrounded new state) and rounds
    the new state to `dtype`. Lossy below float32 (each round rounds the momentum once);
    integer leaves (counts) are kept. Raises ValueError (naming outer_state_dtype, the
    `DiLoCo` field it serves) unless `dtype` is a floating dtype."""
    dtype = checked_state_dtype(dtype)

    def init(params):
        return _cast_floats(outer_optimizer.init(params), dtype)

    def update(updates, state, params=None):
        leaves = jax.tree.leaves(updates)
        wide = jnp.result_type(*leaves) if leaves else jnp.float32
        updates, state = outer_optimizer.update(updates, _cast_floats(state, wide), params)
        return updates, _cast_floats(state, dtype)

    return optax.GradientTransformation(init, update)


def checked_state_dtype(dtype: Any) -> np.dtype:
    """`dtype` as a NumPy floating dtype; ValueError naming outer_state_dtype otherwise."""
    try:
        out = np.dtype(jnp.dtype(dtype))
    except TypeError:
        out = None
    if out is None or not jnp.issubdtype(out, jnp.floating):
        raise ValueError(
            f"outer_state_dtype must be a floating dtype such as 'bfloat16', got {dtype!r}"
        )
    return out


def _cast_floats(tree: Any, dtype: Any) -> Any:
    def cast(x):
        x = jnp.asarray(x)
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree)

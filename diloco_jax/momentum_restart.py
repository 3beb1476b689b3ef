"""Outer-momentum restarting (Topollai et al. 2026, "Outer-Momentum Restarting in
High-Dimensional Two-Phase Optimization", arXiv 2605.28585), as an optax wrapper around the
outer optimizer.

The paper periodically resets the momentum buffer of DiLoCo's Nesterov outer optimizer to zero,
which discards stale outer momentum while keeping the progress of the inner loops. Here the
reset is every K = `every` outer updates, counting updates from 0:

    update n (n = 0, 1, 2, ...):
        if n > 0 and n % K == 0:  inner_state <- optimizer.init(params)
        step, inner_state <- optimizer.update(g_n, inner_state, params)

So update n starts from the fresh state exactly when n is a positive multiple of K. With K = 2:
updates 0 and 1 share one buffer (update 0 starts from the initial, zero, buffer as always),
update 2 starts from zero momentum, update 3 continues it, update 4 starts from zero again, ...
With K = 1 every update starts from zero momentum; with K above the number of updates this is
the wrapped optimizer, bit for bit.

The whole wrapped state is reset to `optimizer.init(...)`, not only a momentum leaf: for
`optax.sgd(lr, momentum=beta, nesterov=True)` (the paper's outer optimizer, and DiLoCo's
default) that is exactly the trace (momentum) going back to zero; for a stateless prefix such as
`optax.chain(clip, sgd)` it is the same; for Adam it would also reset both moments and the
bias-correction count, and a learning-rate schedule inside the wrapped optimizer restarts too.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax


class RestartMomentumState(NamedTuple):
    """count: int32 scalar, the outer updates applied so far. inner_state: the wrapped
    optimizer's state."""

    count: jax.Array
    inner_state: Any


def restart_momentum(
    optimizer: optax.GradientTransformation, every: int
) -> optax.GradientTransformationExtraArgs:
    """Wraps `optimizer` so that its state is reset to its initial value every `every` updates
    (see the module docstring for the exact rule and which update gets the fresh state).

    Args:
      optimizer: the outer optimizer to wrap (anything with `init` and `update`), e.g.
        `optax.sgd(0.7, momentum=0.9, nesterov=True)`.
      every: K >= 1, an integer: update n starts from `optimizer.init(...)` when n > 0 and
        n % K == 0.

    Returns:
      An optax transformation with state `RestartMomentumState`. `update(updates, state,
      params=None, **extra_args)` rebuilds the fresh state with `optimizer.init(params)`, or
      `optimizer.init(updates)` without params (enough for the zero-initialised states of
      SGD, momentum and Adam; pass params for an optimizer whose init reads their values).
      It is jittable and vmappable: the reset is a per-leaf select, not a Python branch.

    Raises:
      ValueError naming the argument: `every` not an integer >= 1 (bools refused), or
      `optimizer` without callable `init` and `update`.
    """
    if isinstance(every, bool) or not isinstance(every, int | np.integer) or every < 1:
        raise ValueError(f"restart_momentum: every must be an integer >= 1, got {every!r}")
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise ValueError(
            "restart_momentum: optimizer must be an optax GradientTransformation (with init "
            f"and update), got {optimizer!r}"
        )
    every = int(every)
    # Lets extra keyword arguments reach optimizers that take them, and be dropped otherwise.
    inner = optax.with_extra_args_support(optimizer)

    def init(params: Any) -> RestartMomentumState:
        return RestartMomentumState(jnp.zeros((), jnp.int32), inner.init(params))

    def update(updates: Any, state: RestartMomentumState, params: Any = None, **extra_args):
        # count 0 is already the fresh state, so only positive multiples of K restart.
        restart = jnp.logical_and(state.count > 0, state.count % every == 0)
        fresh = inner.init(updates if params is None else params)
        # A select on every leaf (no Python branch on a traced value), so it jits and vmaps;
        # the fresh leaf is cast to the running leaf's dtype so the state's dtypes never change
        # (DiLoCo keeps outer state in float32 or wider).
        inner_state = jax.tree.map(
            lambda new, old: jnp.where(restart, jnp.asarray(new, jnp.result_type(old)), old),
            fresh,
            state.inner_state,
        )
        updates, inner_state = inner.update(updates, inner_state, params, **extra_args)
        return updates, RestartMomentumState(state.count + 1, inner_state)

    return optax.GradientTransformationExtraArgs(init, update)

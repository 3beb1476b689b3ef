"""Delayed Nesterov (DN): the outer optimizer of asynchronous DiLoCo (Liu et al. 2024,
"Asynchronous Local-SGD Training for Language Modeling", arXiv 2401.09135), as an optax
transformation applied once per arriving worker delta.

Plain Nesterov momentum per arrival lets every stale delta push the momentum at once, which
is what makes naive asynchronous DiLoCo worse than synchronous DiLoCo. DN buffers the
arriving deltas and folds them into the momentum only every N-th arrival (their mean, as one
synchronous round of N workers would); in between, each delta is applied on its own at 1/N
of the learning rate, plus a fraction `c` of the last momentum step.

For arrival k = 1, 2, ... with delta g (the outer "gradient"), momentum m, buffer b:

    b <- b + g
    if k % N == 0:  m <- beta m + b / N;  step = (1 - c N + c) beta m + g / N;  b <- 0
    else:           step = c beta m + g / N
    theta <- theta - lr(k - 1) step

With N = 1 and c = 0 this is `optax.sgd(lr, momentum=beta, nesterov=True)`. With c = 0 and
N deltas all taken from the same theta, the N arrivals together are one Nesterov step on
their mean: synchronous DiLoCo with N workers.
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class DelayedNesterovState(NamedTuple):
    """count: int32 scalar, arrivals so far. momentum, buffer: trees like the params (the
    outer "gradient" dtype): m, and the sum of the deltas since the last momentum update."""

    count: jax.Array
    momentum: Any
    buffer: Any


def delayed_nesterov(
    learning_rate: "float | Callable[[jax.Array], jax.Array]",
    momentum: float = 0.9,
    buffer_size: int = 1,
    c: float = 0.0,
) -> optax.GradientTransformation:
    """The Delayed Nesterov outer optimizer (see the module docstring for the rule).

    Args:
      learning_rate: eps > 0, a float or an optax schedule of the arrival count (0-based:
        arrival k uses schedule(k - 1), as optax's own schedules count updates).
      momentum: beta in [0, 1).
      buffer_size: N >= 1, the arrivals between momentum updates (the paper sets it to the
        number of workers).
      c: >= 0, the fraction of the momentum step applied at every arrival in between (the
        N-th arrival applies the rest, 1 - c (N - 1), so each momentum value is applied
        once in total; c = 0 applies it only on the N-th arrival).

    Returns:
      An `optax.GradientTransformation`. `update(g, state, params=None)` takes one arriving
      delta g (a tree of float arrays, as `outer_update` passes it) and returns (-lr x step,
      new state): the parameter update, to be added, as every optax transformation returns.

    Raises:
      ValueError naming the argument: buffer_size not an integer >= 1, momentum outside
      [0, 1), c < 0, or a float learning_rate that is not > 0.
    """
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
        raise ValueError(f"buffer_size must be an integer >= 1, got {buffer_size!r}")
    if not _is_number(momentum) or not 0 <= momentum < 1:
        raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
    if not _is_number(c) or not c >= 0 or not math.isfinite(c):
        raise ValueError(f"c must be a finite number >= 0, got {c!r}")
    if not callable(learning_rate) and not (
        _is_number(learning_rate) and math.isfinite(learning_rate) and learning_rate > 0
    ):
        raise ValueError(
            f"learning_rate must be a finite number > 0 or a schedule, got {learning_rate!r}"
        )
    n, beta = buffer_size, momentum
    # The N-th arrival's share of the momentum step: 1 - c N + c.
    last_share = 1.0 - c * n + c

    def init(params: Any) -> DelayedNesterovState:
        zeros = jax.tree.map(jnp.zeros_like, params)
        return DelayedNesterovState(jnp.zeros((), jnp.int32), zeros, zeros)

    def update(updates: Any, state: DelayedNesterovState, params: Any = None):
        del params
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        count = state.count + 1
        flush = count % n == 0
        buffer = jax.tree.map(jnp.add, state.buffer, updates)
        new_m = jax.tree.map(lambda m, b: beta * m + b / n, state.momentum, buffer)
        momentum = _select(flush, new_m, state.momentum)

        def step(m_new, m_old, g):
            # The N-th arrival (flush) uses the new momentum; the others the current one.
            flushed = (last_share * beta) * m_new + g / n
            between = (c * beta) * m_old + g / n
            # -lr in g's dtype, as optax's own learning-rate scaling casts it.
            return jnp.asarray(-lr, g.dtype) * jnp.where(flush, flushed, between).astype(g.dtype)

        steps = jax.tree.map(step, new_m, state.momentum, updates)
        buffer = _select(flush, jax.tree.map(jnp.zeros_like, buffer), buffer)
        return steps, DelayedNesterovState(count, momentum, buffer)

    return optax.GradientTransformation(init, update)


def _select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)

"""DiLoCo with one worker as an optax optimizer: `diloco_optimizer(inner, outer, every=H)`.

A drop-in `optax.GradientTransformation` for any training loop (a hand-written one, Flax
NNX's `nnx.Optimizer`, `optax.chain`, `optax.MultiSteps`): every step is the inner
optimizer's step; every H-th step then also takes DiLoCo's outer step. With θ the params at
the last outer step (the anchor, kept in the state) and θ_H the params after the H-th inner
step:

    Δ = θ - θ_H                       (the outer "gradient", in float32 or wider)
    θ' = θ + outer.update(Δ)          (e.g. Nesterov SGD: lr 0.7, momentum 0.9)

and that step's update moves the params to θ' (which becomes the next anchor). This is the
outer step of `train_diloco` with M = 1 (a Lookahead-style optimizer; the `muloco` package
ships such wrappers, and modded-nanogpt's speedrun used one at H = 30, outer lr 0.7, momentum
0.5). The inner optimizer's state carries over the outer steps, as a DiLoCo worker's does.
With outer lr 1 and no momentum, θ' = θ_H: the inner optimizer alone.

The state is an optax state (a NamedTuple of arrays): jit, `jax.tree` functions and Orbax
checkpoints handle it like any other.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from diloco_jax.heloco_outer import job_start
from diloco_jax.outer import outer_init, outer_update, worker_delta


class DiLoCoOptimizerState(NamedTuple):
    """count: int32 scalar, the inner steps taken (the outer step follows each H-th).
    inner: the inner optimizer's state. outer: the outer optimizer's state (on the params
    widened to float32). anchor: θ, the params at the last outer step (their dtypes)."""

    count: jax.Array
    inner: Any
    outer: Any
    anchor: Any


def diloco_optimizer(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    every: int,
) -> optax.GradientTransformation:
    """DiLoCo's outer step every `every` steps of `inner`, as one optax transformation (see
    the module docstring).

    Args:
      inner: the inner optimizer (e.g. `optax.adamw(3e-4)`), applied at every step.
      outer: the outer optimizer, applied to Δ = θ - θ_H every `every` steps (the paper's is
        `optax.sgd(0.7, momentum=0.9, nesterov=True)`).
      every: H >= 1, the inner steps per outer step.

    Returns:
      An `optax.GradientTransformation`. `init(params)` -> `DiLoCoOptimizerState`;
      `update(grads, state, params)` -> (updates, new state): `params` is required (the
      outer step needs them), grads and updates are trees like params.

    Raises:
      ValueError naming the argument: `every` not an integer >= 1, `inner` or `outer` not an
      optax transformation; at `update`, params missing.
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an integer >= 1, got {every!r}")
    for name, tx in (("inner", inner), ("outer", outer)):
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise ValueError(f"{name} must be an optax GradientTransformation, got {tx!r}")
    if job_start(outer) is not None:  # it would never start from its θ̄
        raise ValueError(
            "outer starts jobs from a look-ahead θ̄ (HeLoCo), which one worker's loop does "
            "not: use heloco(..., lookahead=False)"
        )

    def init_fn(params: Any) -> DiLoCoOptimizerState:
        return DiLoCoOptimizerState(
            count=jnp.zeros([], jnp.int32),
            inner=inner.init(params),
            outer=outer_init(outer, params),
            anchor=jax.tree.map(lambda x: jnp.array(x, copy=True), params),  # never the caller's
        )

    def update_fn(grads: Any, state: DiLoCoOptimizerState, params: Any = None):
        if params is None:
            raise ValueError("diloco_optimizer's update needs params (the outer step uses them)")
        steps, inner_state = inner.update(grads, state.inner, params)
        count = state.count + 1

        def inner_only(_):
            return steps, state.outer, state.anchor

        def outer_step(_):
            local = optax.apply_updates(params, steps)  # θ_H
            delta = worker_delta(state.anchor, local)
            theta, outer_state = outer_update(outer, state.anchor, state.outer, delta)
            moves = jax.tree.map(lambda t, p, s: (t - p).astype(s.dtype), theta, params, steps)
            # The next anchor is where the caller's params land (params + moves, as
            # optax.apply_updates adds them), so the next Δ starts from exactly there.
            return moves, outer_state, optax.apply_updates(params, moves)

        updates, outer_state, anchor = jax.lax.cond(
            count % every == 0, outer_step, inner_only, None
        )
        return updates, DiLoCoOptimizerState(count, inner_state, outer_state, anchor)

    return optax.GradientTransformation(init_fn, update_fn)


__all__ = ["DiLoCoOptimizerState", "diloco_optimizer"]

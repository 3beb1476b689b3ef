"""CGAD, Cosine-Gated Adam-Decay (Shah and Sun 2026, "Cosine-Gated Adam-Decay: Drop-In
Staleness-Aware Outer Optimization for Decoupled DiLoCo", arXiv 2605.09126), and its form
without the cutoff, Adam-Decay: outer optax transformations for stale pseudo-gradients.

Each pseudo-gradient arrives with an age τ >= 0: the outer updates applied since the
params it was computed from (`train_async`'s staleness of its job; d under `Delayed(d)`,
and under `Eager(d)` the age of the stale mean; 0 otherwise). CGAD scales it by

    σ(τ) = γ(τ) · exp(-decay · τ)

before it enters Adam's first- and second-moment buffers: the exponential models the
information's decay, the cosine gate γ zeroes what is older than the cutoff. At τ = 0 it is
Adam.

What the paper's public abstract gives is σ's form, that γ "smoothly zeroes contributions
past a chosen cutoff", and that CGAD is Adam at τ = 0; its gate's exact formula and its
default hyperparameters were not available here. Assumed: the half-cosine window that
reaches zero at the cutoff,

    γ(τ) = (1 + cos(π τ / cutoff)) / 2   for τ < cutoff,   0 for τ >= cutoff,

(1 at τ = 0, smooth, 0 from the cutoff on), and Adam's own defaults (b1 0.9, b2 0.999, eps
1e-8); `decay` and `cutoff` have no default. `age_gate` is the gate, for a user who knows
the paper's to compare or replace.

The age reaches the transformation as the `age` keyword of its update (optax's extra
arguments); an update without one is at age 0.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from diloco_jax.checks import check_number, check_rate


def age_gate(age: Any, decay: float, cutoff: float | None, dtype: Any = jnp.float32) -> Any:
    """σ(age) = γ(age) exp(-decay age) in `dtype` (`age` >= 0, a number or an array; see the
    module docstring for γ); `cutoff` None is Adam-Decay's γ = 1."""
    age = jnp.asarray(age, dtype)
    gate = jnp.exp(-decay * age)
    if cutoff is not None:
        window = 0.5 * (1.0 + jnp.cos(jnp.pi * age / cutoff))
        gate = gate * jnp.where(age < cutoff, window, 0.0)
    return gate


class ScaleByAgeGateState(NamedTuple):
    """Nothing: the gate reads only the update's `age`."""


def scale_by_age_gate(
    decay: float, cutoff: float | None = None
) -> optax.GradientTransformationExtraArgs:
    """Scales the updates by `age_gate(age, decay, cutoff)`, `age` the update's keyword (0
    when absent). `decay` >= 0 and finite; `cutoff` None or > 0 and finite."""
    check_number("decay", decay, lambda x: x >= 0, ">= 0")
    if cutoff is not None:
        check_number("cutoff", cutoff, lambda x: x > 0, "> 0")

    def init(params):
        del params
        return ScaleByAgeGateState()

    def update(updates, state, params=None, *, age=0, **extra_args):
        del params, extra_args
        # In each update's own dtype (float64 params: a float64 gate).
        gated = jax.tree.map(lambda u: u * age_gate(age, decay, cutoff, u.dtype), updates)
        return gated, state

    return optax.GradientTransformationExtraArgs(init, update)


def cgad(
    learning_rate: float,
    decay: float,
    cutoff: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> optax.GradientTransformationExtraArgs:
    """CGAD: Adam (`optax.adam(learning_rate, b1, b2, eps)`) on pseudo-gradients scaled by
    their age's gate (`scale_by_age_gate(decay, cutoff)`); ValueError naming a bad argument."""
    _check_adam(learning_rate, b1, b2, eps)
    return optax.chain(scale_by_age_gate(decay, cutoff), optax.adam(learning_rate, b1, b2, eps))


def adam_decay(
    learning_rate: float, decay: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> optax.GradientTransformationExtraArgs:
    """Adam-Decay: CGAD without the cutoff (σ(τ) = exp(-decay τ))."""
    _check_adam(learning_rate, b1, b2, eps)
    return optax.chain(scale_by_age_gate(decay, None), optax.adam(learning_rate, b1, b2, eps))


def _check_adam(learning_rate: Any, b1: Any, b2: Any, eps: Any) -> None:
    check_rate("learning_rate", learning_rate)
    for name, value in (("b1", b1), ("b2", b2)):
        check_number(name, value, lambda x: 0 <= x < 1, "in [0, 1)")
    check_number("eps", eps, lambda x: x > 0, "> 0")

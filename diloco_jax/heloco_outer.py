"""HeLoCo (arXiv 2606.00271): asynchronous DiLoCo for heterogeneous workers, as one outer
optax transformation that also says which θ a job starts from.

Two changes to asynchronous DiLoCo's server, both in the outer rule:

- **Look-ahead start.** A worker's job starts from θ̄ = θ - η μ m (the outer model where its
  momentum is taking it), not from θ. Its pseudo-gradient is Δ = θ̄ - θ_m.
- **Tensor-block correction.** Each arriving Δ is compared, leaf by leaf (a tensor is a
  block), with the outer momentum m: c = cos(Δ, m), conf = |Δ| / (|Δ| + κ |m| + ε).
  - c >= c_ok (aligned), or |Δ| or |m| below ε: Δ is kept;
  - c < 0 (opposed): Δ - β c |Δ| m/|m|, β = min(k_s (-c) conf, β_max): its component
    along m shrinks;
  - otherwise (weakly aligned): |Δ| u/|u|, u = (1 - λ) Δ/|Δ| + λ m/|m|,
    λ = min(k_d (1 - c) conf, 1): turned toward m, its norm kept;
  then scaled by ρ (the paper suggests 1/sqrt(K) for K concurrent workers).

The outer step on the corrected Ĝ is the momentum look-ahead rule:

    m <- μ m + (1 - μ) Ĝ
    θ <- θ - η (Ĝ + μ m)

This follows the authors' code (PanocularAI's torchft fork, `torchft/heloco.py`: the
optimizer, `block_correct`, the server's look-ahead snapshot). With μ = 0 and the
correction off it is plain SGD on each arriving delta: asynchronous DiLoCo with an SGD
outer step. `train_async` and the elastic runtime's async syncer start each job from
`lookahead(θ, state)`.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class HeLoCoState(NamedTuple):
    """momentum: m, a tree like the params in the delta dtype (float32 or wider)."""

    momentum: Any


class HeLoCo(NamedTuple):
    """An optax GradientTransformation (init, update) with `lookahead(params, state)`: the
    θ a job starts from (None: θ itself)."""

    init: Any
    update: Any
    lookahead: Any


def block_correct(delta, momentum, rho, c_ok, k_s, k_d, kappa, beta_max, eps):
    """One leaf's corrected pseudo-gradient (see the module docstring), in delta's dtype."""
    norm_d, norm_m = jnp.linalg.norm(delta.ravel()), jnp.linalg.norm(momentum.ravel())
    safe_d, safe_m = jnp.maximum(norm_d, eps), jnp.maximum(norm_m, eps)
    cos = jnp.vdot(delta.ravel(), momentum.ravel()) / (safe_d * safe_m)
    conf = norm_d / (norm_d + kappa * norm_m + eps)
    u_hat, v_hat = delta / safe_d, momentum / safe_m
    beta = jnp.minimum(k_s * (-cos) * conf, beta_max)
    opposed = delta - beta * cos * norm_d * v_hat
    lam = jnp.minimum(k_d * (1.0 - cos) * conf, 1.0)
    mix = (1.0 - lam) * u_hat + lam * v_hat
    norm_mix = jnp.linalg.norm(mix.ravel())
    weak = jnp.where(norm_mix > eps, norm_d * mix / jnp.maximum(norm_mix, eps), delta)
    kept = (norm_d < eps) | (norm_m < eps) | (cos >= c_ok)
    return (rho * jnp.where(kept, delta, jnp.where(cos < 0, opposed, weak))).astype(delta.dtype)


def heloco(
    learning_rate: float,
    momentum: float = 0.9,
    rho: float = 1.0,
    c_ok: float = 0.2,
    k_s: float = 0.5,
    k_d: float = 1.0,
    kappa: float = 3.0,
    beta_max: float = 0.5,
    eps: float = 1e-8,
    correction: bool = True,
    lookahead: bool = True,
) -> HeLoCo:
    """HeLoCo's outer rule (module docstring), for `train_async(outer_optimizer=...)` or an
    async `ElasticTask`'s `dj.DiLoCo(outer=...)`.

    Args:
      learning_rate: η > 0 (a number: the look-ahead needs its value).
      momentum: μ in [0, 1).
      rho: ρ > 0, the weight of every corrected delta.
      c_ok: the cosine at and above which a delta is kept, in [-1, 1].
      k_s, k_d, kappa: >= 0, the shrink and turn strengths and the confidence's momentum
        scale. beta_max: in [0, 1], the cap of the shrink. eps: > 0, the numerical floor.
      correction: False keeps every delta (times ρ). lookahead: False starts jobs from θ.

    Returns:
      A `HeLoCo`: `init(params)` -> `HeLoCoState`; `update(delta, state, params=None)` ->
      (the params' update -η (Ĝ + μ m), new state); `lookahead(params, state)` -> the θ a job
      starts from (params' dtypes; None with lookahead=False).

    Raises:
      ValueError naming the argument outside its range.
    """
    checks = {
        "learning_rate": (learning_rate, lambda x: x > 0, "> 0"),
        "momentum": (momentum, lambda x: 0 <= x < 1, "in [0, 1)"),
        "rho": (rho, lambda x: x > 0, "> 0"),
        "c_ok": (c_ok, lambda x: -1 <= x <= 1, "in [-1, 1]"),
        "k_s": (k_s, lambda x: x >= 0, ">= 0"),
        "k_d": (k_d, lambda x: x >= 0, ">= 0"),
        "kappa": (kappa, lambda x: x >= 0, ">= 0"),
        "beta_max": (beta_max, lambda x: 0 <= x <= 1, "in [0, 1]"),
        "eps": (eps, lambda x: x > 0, "> 0"),
    }
    for name, (value, ok, what) in checks.items():
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or not ok(value):
            raise ValueError(f"heloco's {name} must be a finite number {what}, got {value!r}")
    lr, mu = float(learning_rate), float(momentum)

    def correct(delta, m):
        if not correction:
            return (rho * delta).astype(delta.dtype)
        return block_correct(delta, m, rho, c_ok, k_s, k_d, kappa, beta_max, eps)

    def init_fn(params):
        return HeLoCoState(jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.result_type(x)),
                                        params))  # fmt: skip

    def update_fn(delta, state, params=None):
        del params
        corrected = jax.tree.map(correct, delta, state.momentum)
        new_m = jax.tree.map(lambda m, g: mu * m + (1.0 - mu) * g, state.momentum, corrected)
        updates = jax.tree.map(lambda g, m: -lr * (g + mu * m), corrected, new_m)
        return updates, HeLoCoState(new_m)

    def lookahead_fn(params, state):
        return jax.tree.map(
            lambda p, m: (p - lr * mu * m).astype(jnp.result_type(p)), params, state.momentum
        )

    return HeLoCo(init_fn, update_fn, lookahead_fn if lookahead else None)


def job_start(outer_optimizer: Any):
    """The outer rule's look-ahead, (θ, outer state) -> the θ a job starts from (HeLoCo's), or
    None: jobs start from θ itself."""
    return getattr(outer_optimizer, "lookahead", None)


__all__ = ["HeLoCo", "HeLoCoState", "block_correct", "heloco", "job_start"]

"""Worker faults for `diloco_round`: non-finite deltas, simulated drops, uneven inner steps.

All three reduce to one masked, weighted mean of the deltas. Each worker m sends
`(where(included_m, w_m * Δ_m, 0), where(included_m, w_m, 0))` and the reducer
(`masked_mean`) divides the all-reduced sum of the first by that of the second; a round where
no worker is included has a zero weight sum and is skipped by the caller (θ and the outer
state are selected unchanged). `jnp.where`, not a product, zeroes an excluded delta: 0 * NaN
is NaN. Under a lossy compression each worker instead encodes `where(included_m, Δ_m, 0)`
and sends its payload with its weight; `masked_decode_mean` all-gathers both and takes the
weighted mean of the decoded deltas (a left-out worker's error-feedback residual is kept:
it sent nothing).

- Non-finite deltas (`exclude_nonfinite=True`): a worker whose Δ_m has a NaN or Inf is left
  out of the mean; it restarts the next round from the new global θ and keeps its inner
  optimizer state from before the round (the state it ended the round with may hold NaNs).
- Drops (`drop_probability=p`, `drop_seed`): each round, worker m is dropped with probability
  p, from `drop_mask(drop_seed, round, M, p)` (a key folded from the seed and the round
  counter, so a run is reproducible and resumes from `state.round`). A dropped worker's Δ is
  left out, and it carries on from its own params next round (the paper's ablation).
- Uneven steps (`worker_steps=(h_1, ..., h_M)`, 1 <= h_m <= H): worker m takes its first h_m
  of the H scanned steps; later steps leave its params and optimizer state unchanged.
  `weighting="steps"` weights Δ_m by h_m (sample-weighted mean); "uniform" by 1.
"""

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from diloco_jax.compression import Compression, decode_mean
from diloco_jax.workers import WORKER_AXIS, all_gather_workers

WEIGHTINGS = ("uniform", "steps")


def check_drop_probability(drop_probability: float | None) -> float | None:
    """`drop_probability` as a float in [0, 1], or None (drops off). Raises ValueError naming
    it otherwise."""
    if drop_probability is None:
        return None
    if isinstance(drop_probability, bool) or not isinstance(
        drop_probability, (int, float, np.integer, np.floating)
    ):
        raise ValueError(f"drop_probability must be a float in [0, 1], got {drop_probability!r}")
    p = float(drop_probability)
    if not (0.0 <= p <= 1.0) or math.isnan(p):
        raise ValueError(f"drop_probability must be in [0, 1], got {drop_probability!r}")
    return p


def check_worker_steps(
    worker_steps: Sequence[int] | None, num_workers: int, inner_steps: int
) -> tuple[int, ...] | None:
    """`worker_steps` as a tuple of M Python ints in [1, H], or None. Raises ValueError naming
    `worker_steps` for a wrong length, a non-integer, or a value outside [1, H]."""
    if worker_steps is None:
        return None
    values = np.asarray(worker_steps)
    if values.ndim != 1 or values.shape[0] != num_workers:
        raise ValueError(
            f"worker_steps must have one entry per worker ({num_workers}), got shape {values.shape}"
        )
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"worker_steps must be integers, got dtype {values.dtype}")
    if values.min() < 1 or values.max() > inner_steps:
        raise ValueError(
            f"worker_steps must be in [1, inner_steps={inner_steps}], got {values.tolist()}"
        )
    return tuple(int(h) for h in values)


def check_weighting(weighting: str) -> str:
    """`weighting` if it is one of WEIGHTINGS; else ValueError naming it."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    return weighting


def drop_mask(seed: int, round_: jax.Array, num_workers: int, p: float) -> jax.Array:
    """Which workers are dropped in round `round_`: bool [M], each True with probability `p`.

    The key is `fold_in(PRNGKey(seed), round_)`, so the mask depends only on (seed, round):
    deterministic and resumable. p = 0 never drops and p = 1 always does (a uniform draw in
    [0, 1) is compared with p).
    """
    key = jax.random.fold_in(jax.random.PRNGKey(seed), round_)
    return jax.random.uniform(key, (num_workers,)) < p


def all_finite(tree: Any) -> jax.Array:
    """bool scalar: every element of every leaf of `tree` is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leafwise `where(pred, on_true, on_false)` for a scalar bool `pred` (no NaN leaks)."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def select_workers(mask_M: jax.Array, on_true_M: Any, on_false: Any) -> Any:
    """Per worker: leaf [M, ...] of `on_true_M` where mask_M [M] is True, else `on_false`
    ([...], broadcast to every worker)."""

    def pick(a, b):
        m = mask_M.reshape(mask_M.shape + (1,) * (a.ndim - 1))
        return jnp.where(m, a, jnp.asarray(b)[None].astype(a.dtype))

    return jax.tree.map(pick, on_true_M, on_false)


def masked_contribution(
    delta: Any, included: jax.Array, weight: jax.Array
) -> tuple[Any, jax.Array]:
    """One worker's `(where(included, weight * Δ, 0), where(included, weight, 0))`.

    delta: Δ_m in the delta dtype; included: bool scalar; weight: float32 scalar (1.0 for
    "uniform" weighting, skipped as a product then so the sum is the plain sum of deltas).
    """
    w = jnp.where(included, weight, 0.0).astype(jnp.float32)
    sent = jax.tree.map(lambda d: jnp.where(included, d * weight.astype(d.dtype), 0), delta)
    return sent, w


def unweighted_contribution(delta: Any, included: jax.Array) -> tuple[Any, jax.Array]:
    """`masked_contribution` with weight 1, without multiplying: `(where(included, Δ, 0),
    float32 0/1)`."""
    sent = jax.tree.map(lambda d: jnp.where(included, d, jnp.zeros_like(d)), delta)
    return sent, included.astype(jnp.float32)


def masked_mean(local: tuple[Any, jax.Array]) -> tuple[Any, jax.Array]:
    """Reducer for `Backend.map_reduce`: the weighted mean of the included workers' deltas.

    local: (sent, weights) of this device's k workers, leaves [k, ...] and float32 [k].
    Returns (mean Δ in each leaf's dtype — zeros when the weight sum is 0 —, float32 weight
    sum). Two all-reduces over the devices: the summed deltas and the summed weights.
    """
    sent, weights = local
    total = lax.psum(jnp.sum(weights), WORKER_AXIS)
    safe = jnp.where(total > 0, total, 1.0)

    def mean(x):
        s = lax.psum(jnp.sum(x, 0), WORKER_AXIS)
        return jnp.where(total > 0, s / safe.astype(x.dtype), jnp.zeros_like(s)).astype(x.dtype)

    return jax.tree.map(mean, sent), total


def masked_decode_mean(compression: Compression, like: Any):
    """Reducer for `Backend.map_reduce` under a lossy compression: local = (payloads, weights)
    of this device's k workers ([k, ...] payload arrays, float32 [k]). Returns (weighted mean
    of the decoded deltas in `like`'s dtypes — zeros when the weight sum is 0 —, float32
    weight sum). Two all-gathers over the devices: the payloads and the weights."""

    def reduce(local: tuple[Any, jax.Array]) -> tuple[Any, jax.Array]:
        payloads, weights = local
        weights_M = all_gather_workers(weights)
        mean = decode_mean(all_gather_workers(payloads), compression, like, weights_M)
        return mean, jnp.sum(weights_M)

    return reduce

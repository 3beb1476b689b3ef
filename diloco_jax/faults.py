"""Worker faults: the weight rule of `diloco_round` (non-finite deltas, simulated drops,
uneven inner steps).

At each sync every worker m gets `included_m` and a weight w_m: the exchange
(`diloco_jax.exchange`) then takes the weighted mean over the included workers, and a sync
where no worker is included leaves its leaves and their outer state unchanged.

- Non-finite deltas (`exclude_nonfinite=True`): a worker whose Δ_m (of the synced leaves) has
  a NaN or Inf is left out of the mean; it restarts from the current global θ (every leaf)
  with its inner optimizer state from the start of the round (the state it reached may hold
  NaNs).
- Drops (`drop_probability=p`, `drop_seed`): at each sync, worker m is dropped with
  probability p, from `drop_masks(drop_seed, round, M, p, syncs)` (a key folded from the seed
  and the round counter, so a run is reproducible and resumes from `state.round`). A dropped
  worker's Δ is left out and it carries on from its own params (the paper's ablation).
- Uneven steps (`worker_steps=(h_1, ..., h_M)`, 1 <= h_m <= H): worker m takes its first h_m
  of each round's H scanned steps; later steps leave its params and optimizer state
  unchanged. `weighting="steps"` weights Δ_m by h_m (sample-weighted mean; with fragments
  too, as every fragment's window spans one round of steps); "uniform" by 1.
- EDiT (Cheng et al. 2024, arXiv 2412.07210): `weighting="norm_softmax"` weighs Δ_m by
  exp(-‖Δ_m‖ / T) (the weighted mean normalizes: a softmax of -‖Δ‖ / T over the included
  workers; computed as exp(-(‖Δ_m‖ - min_j ‖Δ_j‖) / T), the same ratios without underflow);
  `anomaly=AnomalySkip(...)` leaves out, like a non-finite one, a worker whose ‖Δ_m‖ is an
  outlier by an EWMA z-score of its own history (see `AnomalySkip`).
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

WEIGHTINGS = ("uniform", "steps", "norm_softmax")


@dataclasses.dataclass(frozen=True)
class AnomalySkip:
    """EDiT's anomaly skip: at each sync, worker m's delta norm x = ‖Δ_m‖ is scored against
    an exponentially weighted mean μ_m and variance v_m of its own earlier norms (that
    sync's), z = (x - μ_m) / sqrt(v_m); after `warmup_rounds` rounds, z > `threshold` leaves
    the worker out like a non-finite one. Norms that are scored as outliers (or non-finite)
    don't update the statistics; the others do: μ <- (1 - a) μ + a x,
    v <- (1 - a) (v + a (x - μ)^2), with a = `alpha` (the first kept norm sets μ = x,
    v = 0). The statistics live in `DiLoCoState.norm_stats`."""

    threshold: float = 3.0
    alpha: float = 0.02
    warmup_rounds: int = 120

    def __post_init__(self):
        for name, lo, hi in (("threshold", 0.0, math.inf), ("alpha", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"AnomalySkip.{name} must be a number, got {value!r}")
            if not lo < value <= hi or math.isinf(value):
                raise ValueError(f"AnomalySkip.{name} must be in ({lo}, {hi}], got {value!r}")
        w = self.warmup_rounds
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"AnomalySkip.warmup_rounds must be an integer >= 0, got {w!r}")


def check_anomaly(anomaly: "AnomalySkip | bool | None") -> "AnomalySkip | None":
    """`anomaly` as an AnomalySkip (True: the defaults) or None (off)."""
    if anomaly is None or anomaly is False:
        return None
    if anomaly is True:
        return AnomalySkip()
    if not isinstance(anomaly, AnomalySkip):
        raise ValueError(f"anomaly must be an AnomalySkip, True or None, got {anomaly!r}")
    return anomaly


def check_temperature(temperature: float) -> float:
    """The softmax temperature T > 0 of weighting="norm_softmax"."""
    is_number = isinstance(temperature, int | float) and not isinstance(temperature, bool)
    if not is_number or not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    return float(temperature)


def softmax_weights(norms_k: jax.Array, smallest: jax.Array, temperature: float) -> jax.Array:
    """exp(-(‖Δ_m‖ - min_j ‖Δ_j‖) / T) for this device's workers (float32 [k]); a
    non-finite norm weighs 0 (its worker is left out anyway)."""
    finite = jnp.isfinite(norms_k)
    safe = jnp.where(finite, norms_k, smallest)
    return jnp.where(finite, jnp.exp(-(safe - smallest) / temperature), 0.0).astype(jnp.float32)


NormStats = tuple[jax.Array, jax.Array, jax.Array]  # EWMA mean, variance, norms seen


def initial_stats(num_workers: int, num_syncs: int) -> tuple[NormStats, ...]:
    """Empty statistics: per sync, float32 mean and variance [M] and int32 count [M]."""
    return tuple(
        (
            jnp.zeros((num_workers,), jnp.float32),
            jnp.zeros((num_workers,), jnp.float32),
            jnp.zeros((num_workers,), jnp.int32),
        )
        for _ in range(num_syncs)
    )


def anomalous(
    norms_k: jax.Array, stats_k: NormStats, round_: jax.Array, rule: AnomalySkip
) -> jax.Array:
    """bool [k]: the workers whose norm's z-score against their statistics exceeds the
    threshold, once `rule.warmup_rounds` rounds have passed."""
    mean_k, var_k, _ = stats_k
    z = (norms_k - mean_k) / jnp.sqrt(jnp.maximum(var_k, 1e-30))
    return (round_ >= rule.warmup_rounds) & jnp.isfinite(norms_k) & (z > rule.threshold)


def updated_stats(
    norms_k: jax.Array, stats_k: NormStats, keep_k: jax.Array, rule: AnomalySkip
) -> NormStats:
    """The EWMA statistics after this sync: updated by the norms where `keep_k` (finite, not
    an outlier; the first kept norm sets them), unchanged elsewhere."""
    mean_k, var_k, seen_k = stats_k
    a = rule.alpha
    diff = norms_k - mean_k
    first = seen_k == 0
    new_mean = jnp.where(first, norms_k, mean_k + a * diff)
    new_var = jnp.where(first, 0.0, (1 - a) * (var_k + a * diff**2))
    return (
        jnp.where(keep_k, new_mean, mean_k),
        jnp.where(keep_k, new_var, var_k),
        seen_k + keep_k.astype(jnp.int32),
    )


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


def drop_masks(
    seed: int, round_: jax.Array, num_workers: int, p: float, num_syncs: int = 1
) -> jax.Array:
    """Which workers are dropped at each sync of round `round_`: bool [num_syncs, M], each
    True with probability `p`.

    The key is `fold_in(PRNGKey(seed), round_)`, so the masks depend only on (seed, round):
    deterministic and resumable; row 0 is the same draw for any number of syncs. p = 0 never
    drops and p = 1 always does (a uniform draw in [0, 1) is compared with p).
    """
    key = jax.random.fold_in(jax.random.PRNGKey(seed), round_)
    return jax.random.uniform(key, (num_syncs, num_workers)) < p


def drop_mask(seed: int, round_: jax.Array, num_workers: int, p: float) -> jax.Array:
    """The drops of a round with one sync: `drop_masks(...)[0]`, bool [M]."""
    return drop_masks(seed, round_, num_workers, p)[0]


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

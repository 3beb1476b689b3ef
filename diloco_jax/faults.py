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
"""

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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

"""Delayed and eager outer updates: the part of `diloco_round` that hides the exchange behind
the next round's inner steps (Kale, Douillard, Donchev 2025, arXiv 2502.12996).

With `outer_delay` d >= 1 a round does not wait for its own exchange. Each worker's delta
Δ_m^t of round t stays in flight (`DiLoCoState.pending_deltas`, with its weight); round t + 1
starts by exchanging it (a collective that depends only on the state, not on that round's
inner steps, so XLA's asynchronous collectives can run it under the inner scan on GPU/TPU),
and its mean Δ̄_t is applied d rounds after it was launched (the means in between wait in
`delayed_means`). The first d rounds apply a zero mean.

- Delayed (naive): every worker holds the same θ; θ_t = OuterOpt(θ_{t-1}, Δ̄_{t-d}).
- Eager: each worker m keeps its own θ_m and its own outer optimizer state, and applies
  Δ̃_m = Δ̄_{t-d} + (Δ_m^t - Δ_m^{t-d}) / M: the stale mean with its own stale share
  replaced by its fresh delta (Δ_m^t = θ_m^{t-1} - θ_m after its inner steps). With M = 1
  it is DiLoCo for any d. There is no global θ (`DiLoCoState.params` is None);
  `global_params` averages the workers' θ_m when one is wanted (evaluation, the result).

With Streaming DiLoCo's fragments (the paper's Table 3) each fragment p follows the same rule
over its own syncs: the deltas of its sync in round t are exchanged at the start of round
t + 1 (every fragment's, one exchange each) and applied at its sync in round t + d, by the
fragment's outer state (eager: each worker's own). Eager workers then keep two copies: their
own global θ_m (`DiLoCoState.worker_params`, what their deltas are taken against and the
outer step moves) and the params they keep training (`local_params`), merged at each sync as
Streaming DiLoCo merges θ'. With one fragment, tau = 0 and alpha = 0 that is the unfragmented
rule.

d = 0 is DiLoCo. Fault options combine with the naive delay (a worker's weight travels with
its delta); eager updates take per-worker step counts but refuse the options that leave a
worker out or weigh it (the eager rule swaps a worker's 1/M share of the stale mean, which
weighted shares or a left-out worker leave undefined).
"""

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from diloco_jax.outer import widen
from diloco_jax.workers import stack_workers

MAX_DELAY = 2


@dataclasses.dataclass(frozen=True)
class Delayed:
    """The delay part of a `DiLoCo` spec: each round's mean is applied `rounds` (d = 1 or 2)
    rounds after it was launched, by every worker alike (the naive delay)."""

    rounds: int = 1

    eager: ClassVar[bool] = False

    def __post_init__(self):
        d, name = self.rounds, type(self).__name__
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"{name}.rounds (outer_delay) must be an integer >= 1, got {d!r}")
        if d == 0:
            raise ValueError(
                f"{name}.rounds (outer_delay) must be >= 1: with no delay there is no stale "
                "mean (delay=None is plain DiLoCo)"
            )
        if d > MAX_DELAY:
            raise ValueError(f"{name}.rounds (outer_delay) must be at most {MAX_DELAY}, got {d}")

    def check_with(self, method: Any) -> None:
        """The naive delay combines with every other part (a weight travels with its delta)."""


@dataclasses.dataclass(frozen=True)
class Eager(Delayed):
    """Eager outer updates: like `Delayed`, but each worker applies the stale mean with its
    own stale share replaced by its fresh delta (see the module docstring)."""

    eager: ClassVar[bool] = True

    def check_with(self, method: Any) -> None:
        """Raises ValueError saying why eager updates can't take weights that leave a worker
        out or weigh it other than 1 (per-worker step counts with uniform weights are fine)."""
        if method.weights.uneven:
            raise ValueError(
                "Eager can't be combined with Weights that leave a worker out or weigh it "
                "(exclude_nonfinite, drop_probability, weighting, anomaly): the eager rule "
                "swaps each worker's own 1/M share of the stale mean for its fresh delta, "
                "which has no defined form once shares are weighted or a worker is left out"
            )


def initial(
    state: Any, num_workers: int, outer_delay: int, eager: bool, num_fragments: int | None
) -> Any:
    """`state` (a round-0 DiLoCoState) with zero deltas of weight 1 in flight, and under
    eager updates each worker's own θ and outer state in place of the global ones.
    `num_fragments` is P under Streaming DiLoCo (weights then per fragment: [M, P] in flight,
    [P] for a mean's weight sum), None without fragments."""
    like = jax.eval_shape(widen, state.params)
    per_sync = () if num_fragments is None else (num_fragments,)
    # Separate buffers for every entry: the state is donated to each round.
    pending = tuple(
        jax.tree.map(lambda x: jnp.zeros((num_workers, *x.shape), x.dtype), like)
        for _ in range(outer_delay if eager else 1)
    )
    means = tuple(
        (
            jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), like),
            jnp.full(per_sync, num_workers, jnp.float32),
        )
        for _ in range(outer_delay - 1)
    )
    state = state._replace(
        pending_deltas=pending,
        pending_weights=jnp.ones((num_workers, *per_sync), jnp.float32),
        delayed_means=means or None,
    )
    if not eager:
        return state
    outer_M, params_M = stack_workers((state.outer_opt_state, state.params), num_workers)
    state = state._replace(params=None, outer_opt_state=outer_M)
    if num_fragments is None:  # every worker restarts each round from its θ_m
        return state._replace(local_params=params_M)
    return state._replace(worker_params=params_M)


def global_params(state: Any) -> Any:
    """The params a run's state stands for: θ, or under eager updates (params None) the mean
    of the workers' θ_m (in float32 or wider, cast back to each leaf's dtype)."""
    if state.params is not None:
        return state.params
    own = state.local_params if state.worker_params is None else state.worker_params
    return jax.tree.map(lambda x: jnp.mean(widen(x), axis=0).astype(x.dtype), own)


def eager_delta(mean: Any, fresh_k: Any, stale_k: Any, num_workers: int) -> Any:
    """Δ̃_m = Δ̄ + (Δ_m^t - Δ_m^{t-d}) / M for this device's workers (leaves [k, ...])."""
    return jax.tree.map(
        lambda m, fresh, stale: m[None] + (fresh - stale) / num_workers, mean, fresh_k, stale_k
    )

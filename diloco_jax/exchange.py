"""How a sync averages the workers' deltas: the exchange part of `diloco_round`.

An exchange is a pair of functions run around the backend's collectives:

- `send(delta, residual, included, weight) -> (to_reduce, residual)` runs per worker on its
  delta Δ_m (delta dtype) and its error-feedback residual (float32 like Δ_m, or None);
  `included` (bool scalar) and `weight` (float32 scalar or None for 1) come from the weight
  rule and are None when the round has no fault options.
- `reduce(local) -> (mean, weight_sum)` runs per device on its k workers' `to_reduce`,
  stacked [k, ...], with collectives over `WORKER_AXIS`; `mean` is the (weighted) mean delta
  in the delta dtype, the same on every device; `weight_sum` is the float32 sum of the
  weights (None for an unweighted exchange). A weighted mean with weight sum 0 is zeros.

Four exchanges, picked by compression and by whether the round weighs workers:
- exact: one all-reduce of the deltas (a local sum over k, then psum), divided by M;
- exact, weighted: each worker sends `where(included, w Δ, 0)` and `where(included, w, 0)`;
  two all-reduces, the first divided by the second (`jnp.where`, not a product, zeroes a left
  out delta: 0 * NaN is NaN);
- lossy: each worker encodes Δ (+ its residual under error feedback) into integer payloads
  (`compression.encode_tree`), the payloads are all-gathered and every device decodes all M
  and averages in float32;
- lossy, weighted: each worker encodes `where(included, Δ, 0)` and sends its payload with its
  weight; both are all-gathered and the decoded deltas' weighted mean is taken. A left-out
  worker keeps its residual (it sent nothing).
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from diloco_jax.compression import Compression, decode_mean, encode_tree
from diloco_jax.workers import WORKER_AXIS, all_gather_workers, exact_mean


class Exchange(NamedTuple):
    """`send` per worker and `reduce` per device (see the module docstring)."""

    send: Callable[[Any, Any, Any, Any], tuple[Any, Any]]
    reduce: Callable[[Any], tuple[Any, jax.Array | None]]


def make_exchange(
    compression: Compression, like: Any, num_workers: int, weighted: bool
) -> Exchange:
    """The exchange for `compression` (validated) of deltas shaped like `like` (arrays or
    ShapeDtypeStructs in the delta dtype), over M = `num_workers`; `weighted` when the round
    has fault options (a weight per worker travels with its delta)."""
    lossy = compression.kind != "none"
    if not lossy and not weighted:
        return Exchange(_send_exact, functools.partial(_exact_reduce, num_workers=num_workers))
    if not lossy:
        return Exchange(_send_weighted, masked_mean)
    if not weighted:
        return Exchange(
            functools.partial(_send_encoded, compression),
            functools.partial(_decoded_reduce, compression, like),
        )
    return Exchange(
        functools.partial(_send_weighted_encoded, compression),
        functools.partial(masked_decode_mean, compression, like),
    )


def _send_exact(delta, residual, included, weight):
    return delta, residual


def _exact_reduce(local, num_workers):
    return exact_mean(local, num_workers), None


def _send_weighted(delta, residual, included, weight):
    if weight is None:
        return unweighted_contribution(delta, included), residual
    return masked_contribution(delta, included, weight), residual


def _send_encoded(compression, delta, residual, included, weight):
    payloads, new_residual = encode_tree(delta, compression, residual)
    return payloads, new_residual if compression.error_feedback else residual


def _decoded_reduce(compression, like, local):
    return decode_mean(all_gather_workers(local), compression, like), None


def _send_weighted_encoded(compression, delta, residual, included, weight):
    # A left-out worker encodes zeros (its weight masks them) and keeps its residual.
    sent, _ = unweighted_contribution(delta, included)
    payloads, new_residual = encode_tree(sent, compression, residual)
    weight = jnp.float32(1) if weight is None else weight
    if compression.error_feedback:
        residual = jax.tree.map(lambda a, b: jnp.where(included, a, b), new_residual, residual)
    return (payloads, jnp.where(included, weight, 0.0)), residual


def masked_contribution(
    delta: Any, included: jax.Array, weight: jax.Array
) -> tuple[Any, jax.Array]:
    """One worker's `(where(included, weight * Δ, 0), where(included, weight, 0))`.

    delta: Δ_m in the delta dtype; included: bool scalar; weight: float32 scalar.
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
    """Reducer: the weighted mean of the included workers' deltas.

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


def masked_decode_mean(
    compression: Compression, like: Any, local: tuple[Any, jax.Array]
) -> tuple[Any, jax.Array]:
    """Reducer under a lossy compression: local = (payloads, weights) of this device's k
    workers ([k, ...] payload arrays, float32 [k]). Returns (weighted mean of the decoded
    deltas in `like`'s dtypes — zeros when the weight sum is 0 —, float32 weight sum). Two
    all-gathers over the devices: the payloads and the weights."""
    payloads, weights = local
    weights_M = all_gather_workers(weights)
    mean = decode_mean(all_gather_workers(payloads), compression, like, weights_M)
    return mean, jnp.sum(weights_M)

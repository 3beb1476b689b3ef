"""What an elastic worker pushes and how the syncer merges a sync's pushes into θ: the
method's compression on the real wire.

- Exact (compression "none"): a worker pushes Δ_m = θ - θ_m; the syncer takes the mean of
  the included deltas in worker order and applies the outer step.
- Compressed (any `Compression` kind): the compiled round's own exchange
  (`exchange.make_exchange`), weighted as a round with a membership is. Each worker runs its
  `send` on Δ_m (+ its error-feedback residual, which it keeps beside its inner state of
  each data position, so a worker left out of a sync, or restarted, takes its residual of
  the position it is back at) and pushes the payload: block rows of codes and scales for the
  dense kinds, each leaf's payload arrays for the sparse ones. The syncer runs the exchange's
  `reduce` over all M slots (a worker not included: zeros, weight 0), on one device as the
  compiled round's one-device backends do, and applies the outer step on that mean. So a
  real run equals `train_diloco` with the same compression and the recorded membership.
  θ still travels to the workers whole (float32 or θ's dtype).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax.compression import init_residual
from diloco_jax.exchange import make_exchange
from diloco_jax.method import DiLoCo
from diloco_jax.outer import delta_dtype, outer_update
from diloco_jax.workers import one_device_reduce


class Merge(NamedTuple):
    """Both sides of one sync's wire (see the module docstring).

    push_like: the tree a push carries, zeros (its leaves' shapes and dtypes).
    residual_like: the float32 error-feedback residual like θ (zeros), or None.
    encode: worker side, (Δ tree, residual or None) -> (the push's leaves, the new residual
      or None).
    apply: syncer side, (θ, outer state, {m: worker m's push tree} of the included workers)
      -> (θ, outer state) after the outer step on their mean.
    """

    push_like: Any
    residual_like: Any
    encode: Callable[[Any, Any], tuple[list, Any]]
    apply: Callable[[Any, Any, dict[int, Any]], tuple[Any, Any]]


def make_merge(method: DiLoCo, params: Any, num_workers: int) -> Merge:
    """The merge of `method` (a checked DiLoCo) for θ shaped like `params` over M workers."""
    delta_like = jax.tree.map(
        lambda x: np.zeros(np.shape(x), delta_dtype(np.result_type(x))), params
    )
    optimizer = method.outer_optimizer
    if method.compression.kind == "none":
        update = jax.jit(lambda theta, state, deltas: _mean_update(optimizer, theta, state, deltas))

        def apply_exact(theta, outer_state, pushed):
            return update(theta, outer_state, [pushed[m] for m in sorted(pushed)])

        return Merge(delta_like, None, lambda delta, residual: (jax.tree.leaves(delta), None),
                     apply_exact)  # fmt: skip
    exchange = make_exchange(method.compression, delta_like, num_workers, weighted=True)
    feedback = method.compression.error_feedback
    residual_like = jax.tree.map(np.asarray, init_residual(delta_like)) if feedback else None

    @jax.jit
    def send(delta, residual):
        to_reduce, residual = exchange.send(delta, residual, jnp.bool_(True), None)
        return to_reduce[:-1], residual  # the weight (1) is the syncer's to set

    push_like = jax.tree.map(
        lambda x: np.zeros(x.shape, x.dtype), jax.eval_shape(send, delta_like, residual_like)[0]
    )

    def encode(delta, residual):
        payload, residual = send(delta, residual)
        return jax.tree.leaves(jax.tree.map(np.asarray, payload)), (
            jax.tree.map(np.asarray, residual) if feedback else None
        )

    @jax.jit
    def reduce_update(theta, outer_state, payloads_M, weights_M):
        mean, _ = one_device_reduce(exchange.reduce, (*payloads_M, weights_M))
        return outer_update(optimizer, theta, outer_state, mean)

    def apply_compressed(theta, outer_state, pushed):
        slots = [pushed.get(m, push_like) for m in range(num_workers)]
        payloads_M = jax.tree.map(lambda *x: np.stack(x), *slots)
        weights_M = np.asarray([m in pushed for m in range(num_workers)], np.float32)
        return reduce_update(theta, outer_state, payloads_M, weights_M)

    return Merge(push_like, residual_like, encode, apply_compressed)


def _mean_update(optimizer, theta, outer_state, deltas):
    """θ, outer state after the outer step on the mean of `deltas` (a list of trees)."""
    mean = jax.tree.map(lambda *d: jnp.sum(jnp.stack(d), 0) / len(d), *deltas)
    return outer_update(optimizer, theta, outer_state, mean)

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

What comes back: under the dense kinds' two-stage exchange, the syncer encodes the mean as
the compiled round's second stage does and a worker that holds θ and the outer state from
before the sync gets only those codes (`Merge.reply_like`): it decodes them and takes the
outer step itself, the syncer's own jitted program, and checks its θ against the syncer's
checksum (a worker whose θ differs, on other hardware say, gets θ whole). A worker that
holds nothing of the last sync (joined, left out, restarted) gets θ and the outer state
whole; under the exact merge and the sparse kinds every worker gets θ whole.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax.compression import init_residual
from diloco_jax.exchange import make_exchange, reduced_rows, rows_mean
from diloco_jax.method import DiLoCo
from diloco_jax.outer import delta_dtype, outer_update
from diloco_jax.workers import WORKER_AXIS, one_device_reduce


class Merged(NamedTuple):
    """A sync's outcome on the syncer: θ and the outer state after the outer step, and the
    reply leaves (`Merge.reply_like`) that turn the θ and outer state before it into these on
    a worker holding them, or None where the method has none (θ then travels whole)."""

    theta: Any
    outer_state: Any
    reply: list | None


class Merge(NamedTuple):
    """Both sides of one sync's wire (see the module docstring).

    push_like: the tree a push carries, zeros (its leaves' shapes and dtypes).
    residual_like: the float32 error-feedback residual like θ (zeros), or None.
    encode: worker side, (Δ tree, residual or None) -> (the push's leaves, the new residual
      or None).
    apply: syncer side, (θ, outer state, {m: worker m's push tree} of the included workers)
      -> `Merged`.
    reply_like: the tree of a sync's reply (the two-stage exchange's encoded mean: codes,
      scales, the weight sum), or None where θ travels whole (exact, sparse kinds).
    receive: worker side, (θ, outer state, reply tree) -> (θ, outer state) after the sync,
      the syncer's own computation; None without a reply.
    """

    push_like: Any
    residual_like: Any
    encode: Callable[[Any, Any], tuple[list, Any]]
    apply: Callable[[Any, Any, dict[int, Any]], Merged]
    reply_like: Any = None
    receive: Callable[[Any, Any, Any], tuple[Any, Any]] | None = None


def make_merge(method: DiLoCo, params: Any, num_workers: int) -> Merge:
    """The merge of `method` (a checked DiLoCo) for θ shaped like `params` over M workers."""
    delta_like = jax.tree.map(
        lambda x: np.zeros(np.shape(x), delta_dtype(np.result_type(x))), params
    )
    if method.compression.kind == "none":
        return _exact_merge(method.outer_optimizer, delta_like)
    if method.compression.resolved_exchange == "gather":
        return _gathered_merge(method, delta_like, num_workers)
    return _two_stage_merge(method, delta_like, num_workers)


def _exact_merge(optimizer: Any, delta_like: Any) -> Merge:
    update = jax.jit(lambda theta, state, deltas: _mean_update(optimizer, theta, state, deltas))

    def apply(theta, outer_state, pushed):
        return Merged(*update(theta, outer_state, [pushed[m] for m in sorted(pushed)]), None)

    return Merge(delta_like, None, lambda delta, residual: (jax.tree.leaves(delta), None), apply)


class _Sent(NamedTuple):
    """A compressed merge's worker side and how the syncer stacks a sync's pushes."""

    exchange: Any
    push_like: Any
    residual_like: Any
    encode: Callable[[Any, Any], tuple[list, Any]]
    stacked: Callable[[dict[int, Any]], tuple]


def _sent(method: DiLoCo, delta_like: Any, num_workers: int) -> _Sent:
    """The exchange's `send` on a worker (weighted as a round with a membership is, its
    weight 1 left for the syncer to set), and the syncer's [M, ...] stack of the pushes
    (a worker not included: zeros, weight 0)."""
    exchange = make_exchange(method.compression, delta_like, num_workers, weighted=True)
    feedback = method.compression.error_feedback
    residual_like = jax.tree.map(np.asarray, init_residual(delta_like)) if feedback else None

    @jax.jit
    def send(delta, residual):
        to_reduce, residual = exchange.send(delta, residual, jnp.bool_(True), None)
        return to_reduce[:-1], residual

    push_like = _zeros(jax.eval_shape(send, delta_like, residual_like)[0])

    def encode(delta, residual):
        payload, residual = send(delta, residual)
        leaves = jax.tree.leaves(jax.tree.map(np.asarray, payload))
        return leaves, jax.tree.map(np.asarray, residual) if feedback else None

    def stacked(pushed):
        slots = [pushed.get(m, push_like) for m in range(num_workers)]
        weights_M = np.asarray([m in pushed for m in range(num_workers)], np.float32)
        return (*jax.tree.map(lambda *x: np.stack(x), *slots), weights_M)

    return _Sent(
        exchange=exchange,
        push_like=push_like,
        residual_like=residual_like,
        encode=encode,
        stacked=stacked,
    )


def _gathered_merge(method: DiLoCo, delta_like: Any, num_workers: int) -> Merge:
    """The sparse kinds (and `exchange="gather"`): θ goes back whole."""
    sent = _sent(method, delta_like, num_workers)
    optimizer = method.outer_optimizer

    @jax.jit
    def reduce_update(theta, outer_state, local_M):
        mean, _ = one_device_reduce(sent.exchange.reduce, local_M)
        return outer_update(optimizer, theta, outer_state, mean)

    def apply(theta, outer_state, pushed):
        return Merged(*reduce_update(theta, outer_state, sent.stacked(pushed)), None)

    return Merge(sent.push_like, sent.residual_like, sent.encode, apply)


def _two_stage_merge(method: DiLoCo, delta_like: Any, num_workers: int) -> Merge:
    """The dense kinds: the syncer encodes the mean as the compiled round's second stage
    does, and a worker holding θ and the outer state before the sync decodes and steps as
    the syncer does (`step`, the same jitted program on both sides)."""
    sent = _sent(method, delta_like, num_workers)
    compression, optimizer = method.compression, method.outer_optimizer

    @jax.jit
    def reduce(local_M):  # one device of all M workers, as the one-device backends run it
        rows = functools.partial(reduced_rows, compression, num_workers, True)
        one_device = jax.tree.map(lambda x: x[None], local_M)
        return jax.tree.map(lambda x: x[0], jax.vmap(rows, axis_name=WORKER_AXIS)(one_device))

    @jax.jit
    def step(theta, outer_state, reply):
        codes, scales, total = reply
        mean = rows_mean(compression, delta_like, codes, scales, total)
        return outer_update(optimizer, theta, outer_state, mean)

    def apply(theta, outer_state, pushed):
        reply = jax.tree.map(np.asarray, reduce(sent.stacked(pushed)))
        return Merged(*step(theta, outer_state, reply), jax.tree.leaves(reply))

    reply_like = _zeros(jax.eval_shape(reduce, sent.stacked({})))
    return Merge(
        push_like=sent.push_like,
        residual_like=sent.residual_like,
        encode=sent.encode,
        apply=apply,
        reply_like=reply_like,
        receive=step,
    )


def _zeros(shapes: Any) -> Any:
    return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes)


def _mean_update(optimizer, theta, outer_state, deltas):
    """θ, outer state after the outer step on the mean of `deltas` (a list of trees)."""
    mean = jax.tree.map(lambda *d: jnp.sum(jnp.stack(d), 0) / len(d), *deltas)
    return outer_update(optimizer, theta, outer_state, mean)

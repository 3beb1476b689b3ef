"""DiLoCo state and one communication round: inner loops on every worker, mean of the deltas,
outer update. One round is one traced function (jit it once; H steps never dispatch alone).

The mean of the deltas is exact (one all-reduce of the deltas) or, with a lossy `compression`,
taken over compressed deltas: every worker encodes its delta into integer codes (+ float32
scales / int32 indices), the payloads are all-gathered and every device decodes all M of them
and averages in float32. So only the payloads cross the wire, and every worker ends the round
with the same θ.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from diloco_jax.compression import (
    Compression,
    decode_mean,
    encode_tree,
    init_residual,
    parse_compression,
)
from diloco_jax.inner import LossFn, inner_loop
from diloco_jax.outer import outer_init, outer_update, widen, worker_delta
from diloco_jax.sampler import num_workers_of, split_data, worker_batches
from diloco_jax.workers import Backend, all_gather_workers, exact_mean, make_backend


class DiLoCoState(NamedTuple):
    """Everything a DiLoCo run carries between rounds.

    params: global θ, the caller's structure, shapes and dtypes.
    outer_opt_state: outer optimizer state over θ in `delta_dtype` (float32 or wider).
    inner_opt_state: each worker's inner optimizer state, leaves stacked [M, ...].
    round: int32 scalar, rounds completed.
    residual: error-feedback residuals, float32 leaves stacked [M, ...] like params (what each
      worker's compression dropped so far, added to its next delta); None unless the run
      compresses with error feedback.
    """

    params: Any
    outer_opt_state: Any
    inner_opt_state: Any
    round: jax.Array
    residual: Any = None


def default_inner_optimizer() -> optax.GradientTransformation:
    """The paper's inner optimizer: AdamW(lr 4e-4, b1 0.9, b2 0.95, weight decay 0.1)."""
    return optax.adamw(4e-4, b1=0.9, b2=0.95, weight_decay=0.1)


def default_outer_optimizer() -> optax.GradientTransformation:
    """The paper's outer optimizer: SGD with Nesterov momentum (lr 0.7, momentum 0.9)."""
    return optax.sgd(0.7, momentum=0.9, nesterov=True)


def stack_workers(tree: Any, num_workers: int) -> Any:
    """Repeats every leaf along a new leading worker axis: [...] -> [M, ...]."""
    return jax.tree.map(lambda x: jnp.repeat(jnp.asarray(x)[None], num_workers, axis=0), tree)


def uses_residual(compression: "str | Compression | None") -> bool:
    """Whether rounds with `compression` carry error-feedback residuals (a lossy kind with
    error_feedback; "none" loses nothing, so it never does). Raises ValueError naming
    `compression` for an invalid spec."""
    c = parse_compression(compression)
    return c.kind != "none" and c.error_feedback


def init_state(
    params: Any,
    num_workers: int,
    inner_optimizer: optax.GradientTransformation,
    outer_optimizer: optax.GradientTransformation,
    compression: "str | Compression | None" = None,
) -> DiLoCoState:
    """Round-0 state: θ copied (never aliased), M identical inner states, fresh outer state,
    and zero float32 residuals [M, ...] when `compression` uses error feedback (else None)."""
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    residual = None
    if uses_residual(compression):
        residual = stack_workers(init_residual(params), num_workers)
    return DiLoCoState(
        params=params,
        outer_opt_state=outer_init(outer_optimizer, params),
        inner_opt_state=stack_workers(inner_optimizer.init(params), num_workers),
        round=jnp.zeros((), jnp.int32),
        residual=residual,
    )


def _send_exact(delta: Any, residual: Any) -> tuple[Any, Any]:
    return delta, residual


def outer_exchange(
    compression: "str | Compression | None", params: Any, num_workers: int
) -> tuple[Callable[[Any, Any], tuple[Any, Any]], Callable[[Any], Any]]:
    """How a round's deltas are averaged: `(send, reduce)` for `Backend.map_reduce`.

    `send(delta, residual) -> (to_reduce, residual)` runs per worker: the exact path sends the
    delta itself; a lossy one sends `encode_tree`'s payloads (integer codes, float32 scales,
    int32 indices) and returns the new residual (error feedback) or the given one unchanged.
    `reduce(local)` runs per device on its workers' `to_reduce` stacked [k, ...] and returns
    the mean delta (delta dtype): `exact_mean` (one all-reduce of the deltas), or an all_gather
    of the payloads then `decode_mean` over all M of them.
    """
    c = parse_compression(compression)
    if c.kind == "none":
        return _send_exact, functools.partial(exact_mean, num_workers=num_workers)
    deltas = jax.eval_shape(widen, params)

    def send(delta: Any, residual: Any) -> tuple[Any, Any]:
        payloads, new_residual = encode_tree(delta, c, residual)
        return payloads, new_residual if c.error_feedback else residual

    def reduce(local: Any) -> Any:
        return decode_mean(all_gather_workers(local), c, deltas)

    return send, reduce


def diloco_round(
    loss_fn: LossFn,
    state: DiLoCoState,
    batches: Any,
    *,
    inner_optimizer: optax.GradientTransformation,
    outer_optimizer: optax.GradientTransformation,
    backend: "str | Backend" = "vmap",
    num_workers: int | None = None,
    inner_steps: int | None = None,
    compression: "str | Compression | None" = None,
) -> tuple[DiLoCoState, dict[str, jax.Array]]:
    """One DiLoCo communication round (Algorithm 1, one outer iteration). Pure; jit it.

    Args:
      loss_fn: (params, batch) -> float scalar.
      state: from `init_state` or a previous round.
      batches: batch pytree with leaves [M, H, ...] (worker m's step h uses leaf[m, h]); or a
        `Sampler` drawing each step's batch in the graph, with `num_workers` and `inner_steps`.
      inner_optimizer, outer_optimizer: optax transformations (state built with the same ones).
      backend: "vmap" | "shard_map" | "pmap" | "auto", or a `Backend` from `make_backend`.
      compression: how the deltas are exchanged (a spec for `parse_compression`, e.g. "int8",
        "int4,ef=1", "topk:0.01"). None / "none": the exact mean, bit-identical to no
        compression. With error feedback, `state` must come from `init_state(...,
        compression=...)`: each worker adds its residual to its delta before encoding and keeps
        what the encoding dropped. Without it, `state.residual` is carried unchanged.

    Returns:
      (new state, metrics) with metrics "loss" (float32 mean inner loss), "worker_loss"
      (float32 [M], each worker's mean over its H steps, each taken before that step's
      update) and "outer_grad_norm" (global L2 norm of the averaged delta Δ).
    """
    num_workers = num_workers_of(batches, num_workers)
    backend = make_backend(backend, num_workers)
    feedback = uses_residual(compression)
    if feedback and state.residual is None:
        raise ValueError(
            f"compression={compression!r} uses error feedback but state.residual is None: "
            "build the state with init_state(..., compression=...)"
        )
    send, reduce = outer_exchange(compression, state.params, num_workers)
    shared_data, per_worker_data = split_data(batches, num_workers, state.round)
    # Residuals travel through the workers only when they are read and rewritten.
    residual_M = state.residual if feedback else None

    def worker(shared, mine):
        global_params, shared_data = shared
        inner_opt_state, residual, my_data = mine
        params, inner_opt_state, losses_H = inner_loop(
            loss_fn,
            inner_optimizer,
            global_params,
            inner_opt_state,
            worker_batches(batches, shared_data, my_data),
            num_steps=inner_steps,
        )
        to_reduce, residual = send(worker_delta(global_params, params), residual)
        return to_reduce, (inner_opt_state, residual, losses_H)

    delta, (inner_opt_state, residual_M, losses_MxH) = backend.map_reduce(worker, reduce)(
        (state.params, shared_data), (state.inner_opt_state, residual_M, per_worker_data)
    )
    params, outer_opt_state = outer_update(
        outer_optimizer, state.params, state.outer_opt_state, delta
    )
    metrics = {
        "loss": jnp.mean(losses_MxH),
        "worker_loss": jnp.mean(losses_MxH, axis=1),
        "outer_grad_norm": optax.tree.norm(delta).astype(jnp.float32),
    }
    residual_M = residual_M if feedback else state.residual
    new_state = DiLoCoState(params, outer_opt_state, inner_opt_state, state.round + 1, residual_M)
    return new_state, metrics

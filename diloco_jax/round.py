"""DiLoCo state and one communication round: inner loops on every worker, mean of the deltas,
outer update. One round is one traced function (jit it once; H steps never dispatch alone).

The mean of the deltas is exact (one all-reduce of the deltas) or, with a lossy `compression`,
taken over compressed deltas: every worker encodes its delta into integer codes (+ float32
scales / int32 indices), the payloads are all-gathered and every device decodes all M of them
and averages in float32. So only the payloads cross the wire, and every worker ends the round
with the same θ.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from diloco_jax import faults
from diloco_jax.compression import (
    Compression,
    decode_mean,
    encode_tree,
    init_residual,
    parse_compression,
)
from diloco_jax.inner import LossFn, inner_loop
from diloco_jax.outer import outer_init, outer_update, widen, worker_delta
from diloco_jax.sampler import Sampler, num_workers_of, split_data, worker_batches
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
    local_params: the params each worker starts its next round from, leaves stacked [M, ...]
      in the params' dtypes: the new global θ, or for a worker that was dropped (and whose
      delta was finite) its own params (see `diloco_jax.faults`). None unless the run
      simulates drops (`init_state(..., drop_probability=...)`).
    """

    params: Any
    outer_opt_state: Any
    inner_opt_state: Any
    round: jax.Array
    residual: Any = None
    local_params: Any = None


def default_inner_optimizer() -> optax.GradientTransformation:
    """The paper's inner optimizer: AdamW(lr 4e-4, b1 0.9, b2 0.95, weight decay 0.1)."""
    return optax.adamw(4e-4, b1=0.9, b2=0.95, weight_decay=0.1)


def default_outer_optimizer() -> optax.GradientTransformation:
    """The paper's outer optimizer: SGD with Nesterov momentum (lr 0.7, momentum 0.9)."""
    return optax.sgd(0.7, momentum=0.9, nesterov=True)


def stack_workers(tree: Any, num_workers: int) -> Any:
    """Repeats every leaf along a new leading worker axis: [...] -> [M, ...] (new buffers).
    One broadcast per leaf: half the eager work of `jnp.repeat` in `init_state`."""
    return jax.tree.map(
        lambda x: jnp.broadcast_to(jnp.asarray(x), (num_workers, *jnp.shape(x))), tree
    )


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
    *,
    drop_probability: float | None = None,
) -> DiLoCoState:
    """Round-0 state: θ copied (never aliased), M identical inner states, fresh outer state,
    zero float32 residuals [M, ...] when `compression` uses error feedback (else None), and
    `local_params` = θ stacked [M, ...] when `drop_probability` is not None (else None)."""
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    residual = None
    if uses_residual(compression):
        residual = stack_workers(init_residual(params), num_workers)
    local_params = None
    if faults.check_drop_probability(drop_probability) is not None:
        local_params = stack_workers(params, num_workers)
    return DiLoCoState(
        params=params,
        outer_opt_state=outer_init(outer_optimizer, params),
        inner_opt_state=stack_workers(inner_optimizer.init(params), num_workers),
        round=jnp.zeros((), jnp.int32),
        residual=residual,
        local_params=local_params,
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
    exclude_nonfinite: bool = False,
    drop_probability: float | None = None,
    drop_seed: int = 0,
    worker_steps: "Sequence[int] | None" = None,
    weighting: str = "uniform",
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
      exclude_nonfinite: leave a worker whose delta has a NaN or Inf out of the mean; it
        restarts next round from the new θ and keeps its inner optimizer state from before
        this round (see `diloco_jax.faults`).
      drop_probability: p in [0, 1] or None (off): each worker's delta is dropped from the
        mean with probability p, drawn from (`drop_seed`, `state.round`); a dropped worker
        carries on from its own params next round. Needs `init_state(...,
        drop_probability=...)` (for `state.local_params`).
      drop_seed: int seed of the drop draws.
      worker_steps: per-worker inner step counts (h_1, ..., h_M), each in [1, H], or None
        (all H). Worker m's steps h >= h_m leave its params and optimizer state unchanged.
      weighting: "uniform" (each included worker weighs 1) or "steps" (weighs h_m).
      With a lossy `compression` the fault options mask the compressed mean: a left-out
      worker's payload is all-gathered with weight 0 and its error-feedback residual is kept.
      All at their defaults, the round is today's program, bit for bit.

    Returns:
      (new state, metrics) with metrics "loss" (float32 mean inner loss), "worker_loss"
      (float32 [M], each worker's mean over its H steps, each taken before that step's
      update) and "outer_grad_norm" (global L2 norm of the averaged delta Δ). With any fault
      option on, "loss" is the mean over every step taken, "worker_loss" over each worker's
      h_m steps, and metrics also hold "excluded_workers" (bool [M], non-finite delta),
      "dropped_workers" (bool [M]) and "skipped" (bool scalar: no worker was included, so θ
      and the outer optimizer state are unchanged, "outer_grad_norm" is 0; `round` still
      advances).
    """
    num_workers = num_workers_of(batches, num_workers)
    backend = make_backend(backend, num_workers)
    p = faults.check_drop_probability(drop_probability)
    weighting = faults.check_weighting(weighting)
    if exclude_nonfinite or p is not None or worker_steps is not None or weighting != "uniform":
        return _faulty_round(
            loss_fn,
            state,
            batches,
            inner_optimizer=inner_optimizer,
            outer_optimizer=outer_optimizer,
            backend=backend,
            num_workers=num_workers,
            inner_steps=inner_steps,
            compression=compression,
            exclude_nonfinite=exclude_nonfinite,
            drop_probability=p,
            drop_seed=drop_seed,
            worker_steps=worker_steps,
            weighting=weighting,
        )
    feedback = _checked_feedback(state, compression)
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
    new_state = DiLoCoState(
        params, outer_opt_state, inner_opt_state, state.round + 1, residual_M, state.local_params
    )
    return new_state, metrics


def _checked_feedback(state: DiLoCoState, compression: "str | Compression | None") -> bool:
    """Whether rounds with `compression` carry residuals; raises if `state` has none then."""
    feedback = uses_residual(compression)
    if feedback and state.residual is None:
        raise ValueError(
            f"compression={compression!r} uses error feedback but state.residual is None: "
            "build the state with init_state(..., compression=...)"
        )
    return feedback


def _inner_steps_of(batches: Any, inner_steps: int | None) -> int:
    """H from host batches' second dim [M, H, ...], or the explicit `inner_steps`."""
    if isinstance(batches, Sampler):
        if inner_steps is None:
            raise ValueError("inner_steps is required when batches is a Sampler")
        return inner_steps
    return jax.tree.leaves(batches)[0].shape[1]


def _faulty_round(
    loss_fn: LossFn,
    state: DiLoCoState,
    batches: Any,
    *,
    inner_optimizer: optax.GradientTransformation,
    outer_optimizer: optax.GradientTransformation,
    backend: Backend,
    num_workers: int,
    inner_steps: int | None,
    compression: "str | Compression | None",
    exclude_nonfinite: bool,
    drop_probability: float | None,
    drop_seed: int,
    worker_steps: "Sequence[int] | None",
    weighting: str,
) -> tuple[DiLoCoState, dict[str, jax.Array]]:
    """`diloco_round` with fault options (validated p and weighting): a masked, weighted mean
    of the deltas (`faults.masked_mean`, or under a lossy compression `masked_decode_mean` of
    the payloads), and a skip when no worker is included."""
    c = parse_compression(compression)
    lossy = c.kind != "none"
    feedback = _checked_feedback(state, c)
    H = _inner_steps_of(batches, inner_steps)
    steps = faults.check_worker_steps(worker_steps, num_workers, H)
    drops = drop_probability is not None
    if drops and state.local_params is None:
        raise ValueError(
            "drop_probability is set but state.local_params is None: build the state with "
            "init_state(..., drop_probability=...)"
        )
    steps_M = jnp.asarray(steps if steps is not None else (H,) * num_workers, jnp.int32)
    if drops:
        dropped_M = faults.drop_mask(drop_seed, state.round, num_workers, drop_probability)
    else:
        dropped_M = jnp.zeros((num_workers,), bool)
    starts_M = state.local_params if drops else None
    residual_M = state.residual if feedback else None
    shared_data, per_worker_data = split_data(batches, num_workers, state.round)

    def worker(shared, mine):
        global_params, shared_data = shared
        old_inner, start, dropped, h, residual, my_data = mine
        start = global_params if start is None else start
        params, inner_opt_state, losses_H = inner_loop(
            loss_fn,
            inner_optimizer,
            start,
            old_inner,
            worker_batches(batches, shared_data, my_data),
            num_steps=inner_steps,
            active_steps=None if steps is None else h,
        )
        delta = worker_delta(global_params, params)
        finite = faults.all_finite(delta) if exclude_nonfinite else jnp.bool_(True)
        included = finite & ~dropped
        if lossy:
            # A left-out worker encodes zeros (its weight masks them) and keeps its residual.
            sent, _ = faults.unweighted_contribution(delta, included)
            payloads, new_residual = encode_tree(sent, c, residual)
            weight = h.astype(jnp.float32) if weighting == "steps" else jnp.float32(1)
            to_reduce = (payloads, jnp.where(included, weight, 0.0))
            if feedback:
                residual = faults.select_tree(included, new_residual, residual)
        elif weighting == "steps":
            to_reduce = faults.masked_contribution(delta, included, h.astype(jnp.float32))
        else:
            to_reduce = faults.unweighted_contribution(delta, included)
        if exclude_nonfinite:
            # A non-finite worker's new inner state may hold NaNs: keep the one it started with.
            inner_opt_state = faults.select_tree(finite, inner_opt_state, old_inner)
        carried = params if drops else None
        return to_reduce, (inner_opt_state, carried, ~finite, residual, losses_H)

    if lossy:
        reduce = faults.masked_decode_mean(c, jax.eval_shape(widen, state.params))
    else:
        reduce = faults.masked_mean
    (delta, total), (inner_opt_state, final_M, excluded_M, residual_M, losses_MxH) = (
        backend.map_reduce(worker, reduce)(
            (state.params, shared_data),
            (state.inner_opt_state, starts_M, dropped_M, steps_M, residual_M, per_worker_data),
        )
    )
    skipped = total <= 0
    new_params, new_outer = outer_update(
        outer_optimizer, state.params, state.outer_opt_state, delta
    )
    params = faults.select_tree(skipped, state.params, new_params)
    outer_opt_state = faults.select_tree(skipped, state.outer_opt_state, new_outer)
    local_params = state.local_params
    if drops:
        # Dropped workers with finite params carry on from them; the rest restart from θ.
        local_params = faults.select_workers(dropped_M & ~excluded_M, final_M, params)
    if steps is None:
        loss, worker_loss = jnp.mean(losses_MxH), jnp.mean(losses_MxH, axis=1)
    else:  # skipped steps hold loss 0: divide by the steps taken
        steps_f = steps_M.astype(jnp.float32)
        loss = jnp.sum(losses_MxH) / jnp.sum(steps_f)
        worker_loss = jnp.sum(losses_MxH, axis=1) / steps_f
    metrics = {
        "loss": loss,
        "worker_loss": worker_loss,
        "outer_grad_norm": optax.tree.norm(delta).astype(jnp.float32),
        "excluded_workers": excluded_M,
        "dropped_workers": dropped_M,
        "skipped": skipped,
    }
    residual_M = residual_M if feedback else state.residual
    new_state = DiLoCoState(
        params, outer_opt_state, inner_opt_state, state.round + 1, residual_M, local_params
    )
    return new_state, metrics

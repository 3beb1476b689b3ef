"""Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512): the params are split into P
fragments that sync on a staggered schedule inside each round, so a round's communication is
spread over P smaller exchanges that can overlap the inner steps.

Schedule of one round of H inner steps (H a multiple of P, S = H / P), fragment p = 0..P-1:
- right after inner step (p + 1) S - tau, snapshot the fragment's local values θ_m,p;
- right after inner step (p + 1) S, average Δ_p = θ_p - snapshot over workers, feed it to the
  fragment's own outer optimizer state (initialised on its sub-tree, advancing only at its
  syncs) giving θ_p' , then set the fragment's local values to θ_p' + alpha (θ_m,p - θ_p')
  with θ_m,p the local values at the sync.
Fragments not being synced keep training; there is no reset at the round boundary, so every
worker's local params persist in the state. P = 1, tau = 0, alpha = 0 is standard DiLoCo.
This is the schedule of torchft's DiLoCo with fragment_sync_delay and fragment_update_alpha.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from diloco_jax.compression import Compression
from diloco_jax.inner import LossFn, inner_loop
from diloco_jax.outer import outer_init, outer_update, widen
from diloco_jax.round import init_state, outer_exchange
from diloco_jax.sampler import Sampler, num_workers_of, split_data, worker_batches
from diloco_jax.workers import Backend, make_backend


class StreamingState(NamedTuple):
    """params: global θ, each fragment's value as of its last sync. outer_opt_state: a tuple
    of P outer states, fragment p's over the list of its leaves (delta dtype).
    inner_opt_state, local_params: per worker, leaves [M, ...]. round: int32 rounds done.
    residual: error-feedback residuals [M, ...] (None without error feedback)."""

    params: Any
    outer_opt_state: tuple
    inner_opt_state: Any
    local_params: Any
    round: jax.Array
    residual: Any = None


def fragment_of(params: Any, fragments: Any) -> tuple[int, ...]:
    """Each leaf's fragment index, in `jax.tree.leaves(params)` order.

    `fragments` is an int P >= 1 (leaf i goes to fragment i % P, the strided assignment the
    paper recommends; P at most the number of leaves), or a pytree of ints with the params'
    structure whose values cover 0..P-1. Raises ValueError naming `fragments`.
    """
    leaves = jax.tree.leaves(params)
    if isinstance(fragments, int) and not isinstance(fragments, bool):
        if not 1 <= fragments <= len(leaves):
            raise ValueError(
                f"fragments must be between 1 and the number of param leaves {len(leaves)}, "
                f"got {fragments}"
            )
        return tuple(i % fragments for i in range(len(leaves)))
    try:
        indices = jax.tree.leaves(jax.tree.map(lambda _, f: f, params, fragments))
    except (ValueError, TypeError):
        raise ValueError(
            "fragments must be an int >= 1 or a pytree of ints with the params' structure"
        ) from None
    if not all(isinstance(f, int) and not isinstance(f, bool) for f in indices):
        raise ValueError(f"fragments pytree must hold ints, got {indices}")
    if sorted(set(indices)) != list(range(max(indices) + 1)) or min(indices) < 0:
        raise ValueError(f"fragments indices must cover 0..P-1, got {sorted(set(indices))}")
    return tuple(indices)


def check_schedule(
    num_fragments: int, inner_steps: int, overlap_steps: int, merge_alpha: float
) -> None:
    """Raises ValueError naming the argument for a schedule that can't run."""
    if inner_steps % num_fragments:
        raise ValueError(
            f"inner_steps={inner_steps} must be a multiple of the number of fragments "
            f"{num_fragments}"
        )
    per_fragment = inner_steps // num_fragments
    if isinstance(overlap_steps, bool) or not isinstance(overlap_steps, int):
        raise ValueError(f"overlap_steps must be an int, got {overlap_steps!r}")
    if not 0 <= overlap_steps < per_fragment:
        raise ValueError(
            f"overlap_steps must be in [0, inner_steps / fragments = {per_fragment}), got "
            f"{overlap_steps}"
        )
    if isinstance(merge_alpha, bool) or not (
        isinstance(merge_alpha, int | float) and 0 <= merge_alpha <= 1
    ):
        raise ValueError(f"merge_alpha must be in [0, 1], got {merge_alpha!r}")


def _fragment_leaves(tree: Any, frags: tuple[int, ...], p: int) -> list:
    return [x for x, f in zip(jax.tree.leaves(tree), frags, strict=True) if f == p]


def init_streaming_state(
    params: Any,
    num_workers: int,
    inner_optimizer: optax.GradientTransformation,
    outer_optimizer: optax.GradientTransformation,
    frags: tuple[int, ...],
    compression: "str | Compression | None" = None,
) -> StreamingState:
    """Round-0 state: every worker's local params start at θ; one outer state per fragment."""
    base = init_state(params, num_workers, inner_optimizer, outer_optimizer, compression)
    outer = tuple(
        outer_init(outer_optimizer, _fragment_leaves(base.params, frags, p))
        for p in range(max(frags) + 1)
    )
    local = jax.tree.map(lambda x: jnp.repeat(x[None], num_workers, axis=0), base.params)
    return StreamingState(
        base.params, outer, base.inner_opt_state, local, base.round, base.residual
    )


def streaming_round(
    loss_fn: LossFn,
    state: StreamingState,
    batches: Any,
    *,
    inner_optimizer: optax.GradientTransformation,
    outer_optimizer: optax.GradientTransformation,
    frags: tuple[int, ...],
    overlap_steps: int = 0,
    merge_alpha: float = 0.0,
    backend: "str | Backend" = "vmap",
    num_workers: int | None = None,
    inner_steps: int | None = None,
    compression: "str | Compression | None" = None,
) -> tuple[StreamingState, dict[str, jax.Array]]:
    """One round of Streaming DiLoCo (see the module docstring). Pure; jit it.

    batches: leaves [M, H, ...] or a `Sampler` (with num_workers and inner_steps).
    Returns (new state, metrics) with the metrics of `diloco_round` ("outer_grad_norm" is the
    norm of all fragments' averaged deltas together).
    """
    num_workers = num_workers_of(batches, num_workers)
    steps = inner_steps if isinstance(batches, Sampler) else jax.tree.leaves(batches)[0].shape[1]
    num_fragments = max(frags) + 1
    check_schedule(num_fragments, steps, overlap_steps, merge_alpha)
    per_fragment = steps // num_fragments
    backend = make_backend(backend, num_workers)
    shared_data, per_worker_data = split_data(batches, num_workers, state.round)
    treedef = jax.tree.structure(state.params)
    exchanges = [
        outer_exchange(compression, _fragment_leaves(state.params, frags, p), num_workers)
        for p in range(num_fragments)
    ]

    def run_steps(shared_data, params, opt_state, my_data, start, stop):
        if isinstance(batches, Sampler):
            batch_fn = worker_batches(batches, shared_data, my_data)
            data = lambda h: batch_fn(h + start)
        else:
            data = jax.tree.map(lambda x: x[start:stop], my_data)
        return inner_loop(loss_fn, inner_optimizer, params, opt_state, data, num_steps=stop - start)

    def body(shared, local):
        global_params, outer_states, shared_data = shared
        params_k, opt_k, residual_k, data_k = local
        global_leaves = jax.tree.leaves(global_params)
        outer_states, losses, deltas = list(outer_states), [], []
        steps_k = jax.vmap(run_steps, in_axes=(None, 0, 0, 0, None, None))
        for p in range(num_fragments):
            mine = [i for i, f in enumerate(frags) if f == p]
            end = (p + 1) * per_fragment
            params_k, opt_k, loss = steps_k(
                shared_data, params_k, opt_k, data_k, p * per_fragment, end - overlap_steps
            )
            losses.append(loss)
            snapshot = [jax.tree.leaves(params_k)[i] for i in mine]
            if overlap_steps:
                params_k, opt_k, loss = steps_k(
                    shared_data, params_k, opt_k, data_k, end - overlap_steps, end
                )
                losses.append(loss)
            send, reduce = exchanges[p]
            old = [global_leaves[i] for i in mine]
            delta_k = [widen(g)[None] - widen(s) for g, s in zip(old, snapshot, strict=True)]
            res = None if residual_k is None else [jax.tree.leaves(residual_k)[i] for i in mine]
            payload_k, res = jax.vmap(send)(delta_k, res)
            delta = reduce(payload_k)
            deltas += delta
            new, outer_states[p] = outer_update(outer_optimizer, old, outer_states[p], delta)
            local_leaves = jax.tree.leaves(params_k)
            for j, i in enumerate(mine):
                global_leaves[i] = new[j]
                at_sync = local_leaves[i]
                merged = new[j][None] + merge_alpha * (at_sync - new[j][None])
                local_leaves[i] = merged.astype(at_sync.dtype)
            params_k = jax.tree.unflatten(treedef, local_leaves)
            if residual_k is not None:
                res_leaves = jax.tree.leaves(residual_k)
                for j, i in enumerate(mine):
                    res_leaves[i] = res[j]
                residual_k = jax.tree.unflatten(jax.tree.structure(residual_k), res_leaves)
        new_global = jax.tree.unflatten(treedef, global_leaves)
        same = (new_global, tuple(outer_states), optax.tree.norm(deltas).astype(jnp.float32))
        return same, (params_k, opt_k, residual_k, jnp.concatenate(losses, axis=1))

    (params, outer_states, grad_norm), (local_params, inner, residual, losses_MxH) = (
        backend.map_devices(body, vary_shared=False)(
            (state.params, state.outer_opt_state, shared_data),
            (state.local_params, state.inner_opt_state, state.residual, per_worker_data),
        )
    )
    metrics = {
        "loss": jnp.mean(losses_MxH),
        "worker_loss": jnp.mean(losses_MxH, axis=1),
        "outer_grad_norm": grad_norm,
    }
    new_state = StreamingState(params, outer_states, inner, local_params, state.round + 1, residual)
    return new_state, metrics

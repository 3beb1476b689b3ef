"""DiLoCo state and one communication round: the one round body every variant runs.

A round is the workers' inner steps interleaved with the syncs of its schedule. Each option
is a part plugged into that body, never a copy of it:

- schedule (`diloco_jax.schedule`): which leaves sync after which inner step, and how the
  synced values merge into each worker's params (standard DiLoCo: every leaf after step H;
  Streaming DiLoCo: P fragments on a staggered schedule with overlap and merge alpha);
- weights (`diloco_jax.faults`): each worker's weight at each sync (1; 0 for a non-finite,
  dropped or anomalous worker; h_m under step weighting; EDiT's softmax of -‖Δ_m‖ / T) and
  what a left-out worker does next;
- exchange (`diloco_jax.exchange`): how the weighted deltas are averaged (an exact all-reduce
  or compressed payloads) around the backend's collectives;
- outer rule (`diloco_jax.outer`): the optax outer update of the synced leaves with their own
  outer state (a sync where no worker is included leaves both unchanged);
- delay (`diloco_jax.delay`): when a sync's mean is applied (at once, 1-2 rounds late, or
  eagerly);
- state sync (`diloco_jax.state_sync`): DES-LOC's averaging of inner optimizer state fields.

One round is one traced function (jit it once; H steps never dispatch alone).
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from diloco_jax import delay, faults, offload
from diloco_jax import model_state as model_states
from diloco_jax import outer_sharding as outer_shards_lib
from diloco_jax import placement as placement_lib
from diloco_jax import state_sync as state_syncs
from diloco_jax.compression import init_residual
from diloco_jax.exchange import make_exchange, shard_groups
from diloco_jax.inner import (
    LossFn,
    Step,
    StepInfo,
    check_loss_options,
    loss_step,
    masked_step,
    run_steps,
    step_key,
    step_means,
    train_step,
    worker_key,
)
from diloco_jax.method import (
    DiLoCo,
    method_from_options,
)
from diloco_jax.model_state import check_model_state
from diloco_jax.outer import delta_dtype, outer_init, outer_update, widen, worker_delta
from diloco_jax.sampler import Sampler, num_workers_of, split_data, worker_batches
from diloco_jax.schedule import Schedule, Sync, leaf_indices, part, synced_groups
from diloco_jax.trainable import frozen_leaves, masked_optimizer
from diloco_jax.workers import WORKER_AXIS, Backend, exact_mean, make_backend, stack_workers


class DiLoCoState(NamedTuple):
    """Everything a DiLoCo run carries between rounds (fields an option doesn't use are None).

    params: global θ, the caller's structure, shapes and dtypes (with fragments: each
      fragment's values as of its last sync).
    outer_opt_state: outer optimizer state in `delta_dtype` (float32 or wider): over θ; with
      fragments, a tuple of P states, fragment p's over the list of its leaves.
    inner_opt_state: each worker's inner optimizer state, leaves stacked [M, ...].
    round: int32 scalar, rounds completed.
    residual: error-feedback residuals, float32 leaves stacked [M, ...] like params (what each
      worker's compression dropped so far, added to its next delta); None unless the run
      compresses with error feedback.
    local_params: each worker's own params, leaves stacked [M, ...] in the params' dtypes,
      where it continues from: with fragments always (Streaming DiLoCo never resets them);
      under simulated drops (a dropped worker whose delta was finite carries on from its
      own params, the others from θ); under eager updates (each worker's own θ_m). None
      otherwise.
    pending_deltas, pending_weights, delayed_means: what is in flight under a delayed outer
      update (`outer_delay` d >= 1, see `diloco_jax.delay`): each worker's deltas of the
      last round (eager: of the last d rounds), a tuple of leaves [M, ...] in the delta
      dtype, oldest first; each worker's weight in last round's mean (float32 [M]); the
      means launched in the last d - 1 rounds, a tuple of (mean delta, float32 weight sum),
      oldest first. None without a delay. With fragments the weights are per fragment
      (float32 [M, P] in flight, [P] per waiting mean). Under eager updates `params` is None
      (every worker keeps its own θ_m: in `local_params`, or with fragments in
      `worker_params`) and `outer_opt_state` is per worker [M, ...].
    norm_stats: under EDiT's anomaly skip, each worker's EWMA statistics of its delta norms,
      a tuple per sync of (mean, variance float32 [M], count int32 [M]); None otherwise.
    worker_params: under eager updates with fragments, each worker's own θ_m (leaves
      [M, ...] in the params' dtypes; each fragment as of that worker's last outer step of
      it), beside the params it keeps training in `local_params`. None otherwise.
    model_state: each worker's model state (`diloco_jax.model_state`), leaves stacked
      [M, ...] (merged leaves equal on every worker after a round); None without one.

    With a worker step (`train_diloco_step`) `inner_opt_state` holds each worker's whole
    worker state (its params as of its last step inside).
    """

    params: Any
    outer_opt_state: Any
    inner_opt_state: Any
    round: jax.Array
    residual: Any = None
    local_params: Any = None
    pending_deltas: Any = None
    pending_weights: Any = None
    delayed_means: Any = None
    norm_stats: Any = None
    worker_params: Any = None
    model_state: Any = None


def init_state(
    params: Any,
    num_workers: int,
    method: DiLoCo | None = None,
    *,
    trainable: Any = None,
    model_state: Any = None,
    worker_state: Any = None,
    backend: "str | Backend | None" = None,
    **options,
) -> DiLoCoState:
    """Round-0 state for `method` (a `DiLoCo`; or its keyword shorthand, see
    `method_from_options`), M = `num_workers` >= 1 workers: θ copied (never aliased), M
    identical inner states, fresh outer state (one per fragment under Streaming DiLoCo), zero
    float32 residuals [M, ...] when the compression feeds its error back (else None), and
    `local_params` = θ stacked [M, ...] with fragments or drops (else None). With a delay,
    zero deltas in flight (the first d rounds apply a zero mean); with eager updates, every
    worker's own θ and outer state (see `diloco_jax.delay`); with an anomaly skip, empty
    norm statistics. `trainable` (see `diloco_jax.trainable`): frozen leaves get no inner
    optimizer state and no outer state. `model_state` (a pytree of arrays, see
    `diloco_jax.model_state`): copied to every worker, [M, ...]. `worker_state`: a worker
    step's state (`train_diloco_step`), copied to every worker as `inner_opt_state` in place
    of the inner optimizer's. `backend`: a `Backend` from `make_backend(..., mesh=,
    param_sharding=)` builds the state in place on its mesh, every field at its shards
    (`diloco_jax.placement`), as `train_diloco` does; without a mesh it changes nothing.
    `diloco_round` refuses a state built for another method."""
    method = method_from_options(method, options, caller="init_state")
    if backend is not None:
        backend = make_backend(backend, num_workers)
    if backend is not None and backend.mesh_axes:
        frozen = frozen_leaves(params, trainable)
        placed = placement_lib.of_backend(backend, params, None, method.schedule, frozen)
        init = functools.partial(
            init_state, num_workers=num_workers, method=method, trainable=trainable
        )
        return placement_lib.build_in_place(init, placed, params, model_state, worker_state)
    frozen = frozen_leaves(params, trainable)
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    residual = None
    if method.carries_residual:
        residual = stack_workers(init_residual(params), num_workers)
    local_params = None
    if method.fragmented or method.weights.drop_probability is not None:
        local_params = stack_workers(params, num_workers)
    outer_optimizer = method.outer_optimizer
    groups = synced_groups(params, method.schedule, frozen)
    if method.fragmented:
        outer_opt_state = tuple(outer_init(outer_optimizer, group) for group in groups)
    else:  # over the caller's tree, or the list of its trainable leaves
        outer_opt_state = outer_init(outer_optimizer, groups[0] if frozen else params)
    norm_stats = None
    if method.weights.anomaly is not None:
        norm_stats = faults.initial_stats(num_workers, method.num_syncs(params))
    if worker_state is None:
        inner_state = masked_optimizer(method.inner_optimizer, params, frozen).init(params)
    else:
        inner_state = worker_state
    if model_state is not None:
        check_model_state(model_state)
        model_state = stack_workers(model_state, num_workers)
    state = DiLoCoState(
        params=params,
        outer_opt_state=outer_opt_state,
        inner_opt_state=stack_workers(inner_state, num_workers),
        round=jnp.zeros((), jnp.int32),
        residual=residual,
        local_params=local_params,
        norm_stats=norm_stats,
        model_state=model_state,
    )
    if not method.outer_delay:
        return state
    num_fragments = len(outer_opt_state) if method.fragmented else None
    return delay.initial(state, num_workers, method.outer_delay, method.eager, num_fragments)


def diloco_round(
    loss_fn: LossFn,
    state: DiLoCoState,
    batches: Any,
    method: DiLoCo | None = None,
    backend: "str | Backend" = "vmap",
    *,
    num_workers: int | None = None,
    inner_steps: int | None = None,
    has_aux: bool = False,
    rng_seed: int | None = None,
    trainable: Any = None,
    model_state_merge: Any = None,
    params_of: Any = None,
    with_params: Any = None,
    outer_shards: "outer_shards_lib.OuterShards | None" = None,
    outer_state_memory: str = "device",
    param_specs: "tuple[jax.sharding.PartitionSpec, ...] | None" = None,
    **options,
) -> tuple[DiLoCoState, dict[str, jax.Array]]:
    """One DiLoCo communication round (Algorithm 1, one outer iteration). Pure; jit it.

    Args:
      loss_fn: (params, batch) -> float scalar; with a model state in `state` (`init_state(...,
        model_state=)`), (params, model_state, batch) -> (loss, new_model_state). With
        `params_of` and `with_params`, a worker step instead (see `train_diloco_step`).
      state: from `init_state` with the same method, or a previous round (a state built for
        another method is a ValueError).
      batches: batch pytree with leaves [M, H, ...] (worker m's step h uses leaf[m, h]); or a
        `Sampler` drawing each step's batch in the graph, with `num_workers` and `inner_steps`.
      method: a `DiLoCo` spec (its parts: `diloco_jax.method`), or its keyword shorthand in
        `options` (`inner_optimizer`, `outer_optimizer`, `compression`, `fragments`,
        `outer_delay`, ...: `method_from_options`). None and no options: plain DiLoCo.
      backend: "vmap" | "shard_map" | "pmap" | "auto", or a `Backend` from `make_backend`.
      num_workers, inner_steps: M and H, needed only when `batches` is a Sampler.
      has_aux: `loss_fn` returns (loss, aux), aux a dict of scalars; each aux metric joins
        the metrics like "loss" / "worker_loss": its mean over the steps taken, over workers
        as metrics[name], per worker as metrics["worker_" + name] (float32 [M]).
      rng_seed: an int >= 0: `loss_fn(params, batch, key)` with one key per (round, worker,
        inner step): `step_key(worker_key(rng_seed, round, m), h)` (`diloco_jax.inner`), the
        same on every backend and after a resume. None: `loss_fn(params, batch)`.
      trainable: a pytree of bools like the params, or a callable (path, leaf) -> bool; the
        frozen leaves keep their values bit for bit (`diloco_jax.trainable`). The state must
        be built with the same mask.
      model_state_merge: the merge rule of the model state's leaves at the round's end, one
        rule or a pytree of rules: "mean" (float leaves' default), "first", "keep" (the
        default for other leaves; `diloco_jax.model_state`).
      params_of, with_params: `loss_fn` is a worker step `(worker_state, batch, info) ->
        (worker_state, metrics)` over the worker states in `state.inner_opt_state`
        (`init_state(..., worker_state=)`); these read and write its params.
      outer_shards: the outer state split over the workers (ZeRO-1; see
        `diloco_jax.outer_sharding`), its leaves in storage at `OuterShards.storage_spec`
        (what `train_diloco(..., shard_outer_over_workers=True)` passes). None: replicated.
      outer_state_memory: "device", or "pinned_host" when θ and the outer state arrive in
        host memory (`diloco_jax.offload`): the round copies them to the device where it
        reads them, after the inner steps (with outer_shards, each device's shards of the
        outer state). Not with a delay, eager updates or pmap.
      param_specs: each param leaf's `PartitionSpec` over the mesh's non-worker axes, in
        `jax.tree.leaves` order (`diloco_jax.placement.resolve_param_specs`; what
        `train_diloco` passes on a mesh). Read by a compressed exchange on a mesh backend:
        each device encodes and exchanges its own shards (the codec's blocks per shard).
        None: the backend's `make_backend(param_sharding=)`, resolved against the state's
        params; without one, the leaves are taken as replicated inside a worker.

    A weights part with fault options on (exclusion, drops, worker steps, weighting, anomaly)
    leaves workers out of a sync's mean or weighs them (`diloco_jax.faults`); a delay applies
    the mean launched d rounds earlier, its own exchange running at the start of the next
    round, independent of that round's inner steps (`diloco_jax.delay`).

    Returns:
      (new state, metrics) with metrics "loss" (float32 mean inner loss over the steps
      taken), "worker_loss" (float32 [M], each worker's mean over its steps, each loss taken
      before that step's update) and "outer_grad_norm" (global L2 norm of the averaged deltas
      of every sync). With any fault option on, metrics also hold "excluded_workers" (bool
      [M], a non-finite delta or an anomaly outlier at some sync), "dropped_workers" (bool
      [M], dropped at some sync) and "skipped" (bool scalar: some sync included no worker,
      so those leaves and their outer state are unchanged and their delta counts as 0;
      `round` still advances).
    """
    method = method_from_options(method, options, caller="diloco_round")
    check_loss_options(has_aux, rng_seed)
    custom = _check_step_functions(params_of, with_params, method, has_aux)
    num_workers = num_workers_of(batches, num_workers)
    backend = make_backend(backend, num_workers)
    _check_round_mesh(backend, state, "state")
    _check_round_mesh(backend, batches, "batches")
    num_steps = _inner_steps_of(batches, inner_steps)
    # Under eager updates (and for a state built for them, which `_check_state` refuses
    # below) θ is the workers' mean.
    like = state.params
    if like is None:
        like = jax.eval_shape(delay.global_params, state)
    frozen = frozen_leaves(like, trainable)
    worker_like = _one_worker(state.inner_opt_state) if custom else None
    model_like = None if state.model_state is None else _one_worker(state.model_state)
    schedule, syncs = method.check_run(like, num_workers, num_steps, frozen, worker_like)
    _check_state(state, like, num_workers, method, trainable, model_like, worker_like)
    rules = model_states.merge_rules(model_like, model_state_merge)
    if custom:
        step = train_step(loss_fn, params_of, with_params, frozen)
    else:
        inner = masked_optimizer(method.inner_optimizer, like, frozen)
        step = loss_step(loss_fn, inner, has_aux, with_model_state=model_like is not None)
    rule = method.weights
    weighted = rule.active
    drops = rule.drop_probability is not None
    outer_delay, eager = method.outer_delay, method.eager
    carried = drops or schedule.fragmented or eager

    leaves, treedef = jax.tree.flatten(like)
    outer_states = state.outer_opt_state if schedule.fragmented else (state.outer_opt_state,)
    zero = _sync_shards(outer_shards, method, backend, schedule, leaves, treedef, outer_states)
    host = _check_host(outer_state_memory, method, backend)
    exchanges = [
        make_exchange(
            method.compression,
            jax.eval_shape(widen, part(sync, leaves, treedef)),
            num_workers,
            weighted,
        )
        for sync in schedule.syncs
    ]
    if param_specs is None and backend.param_sharding is not None:
        param_specs = placement_lib.resolve_param_specs(
            like, backend.mesh, backend.param_sharding.value()
        )
    per_shard = _per_shard(param_specs, method, backend, schedule, leaves, weighted)
    steps_M = dropped_MxP = None
    if weighted:
        steps_M = jnp.asarray(rule.worker_steps or (num_steps,) * num_workers, jnp.int32)
    if drops:
        dropped_MxP = faults.drop_masks(
            rule.drop_seed, state.round, num_workers, rule.drop_probability, len(schedule.syncs)
        ).T
    zero_local = None
    if zero is not None:  # each sync's split leaves travel per worker, the rest shared
        halves = [sync.split(s) for sync, s in zip(zero, outer_states, strict=True)]
        outer_states = tuple(shared for shared, _ in halves)
        zero_local = tuple(local for _, local in halves)
    if eager:  # each worker's own outer state travels with the worker
        outer_states, worker_outer = None, state.outer_opt_state
    else:
        worker_outer = None
    pending = (state.pending_deltas, state.pending_weights) if outer_delay else None
    shared_data, per_worker_data = split_data(batches, num_workers, state.round)
    body = functools.partial(
        _round_body,
        step=step,
        outer_optimizer=method.outer_optimizer,
        batches=batches,
        num_steps=num_steps,
        schedule=schedule,
        exchanges=exchanges,
        rule=rule if weighted else None,
        carried=carried,
        treedef=treedef,
        outer_delay=outer_delay,
        eager=eager,
        num_workers=num_workers,
        syncs=syncs,
        rng_seed=rng_seed,
        merge_rules=rules,
        zero=zero,
        host=host,
        per_shard=per_shard,
        one_per_device=backend.name in ("shard_map", "pmap") and backend.workers_per_device == 1,
    )
    ids_M = None
    if rng_seed is not None or custom:  # what a step's key or StepInfo needs
        ids_M = jnp.arange(num_workers, dtype=jnp.int32)
    # Fragmented rounds keep the program they ran before the round bodies were folded into
    # this one (on vmap, the workers under a size-1 device axis), so those runs stay bit for
    # bit; un-nesting it is faster on CPU but rounds differently.
    same, mine = backend.map_workers(body, nested=schedule.fragmented)(
        (state.params, outer_states, shared_data, state.delayed_means, state.round),
        (
            state.local_params if carried else None,
            state.inner_opt_state,
            state.residual,
            dropped_MxP,
            steps_M,
            per_worker_data,
            pending,
            worker_outer,
            state.norm_stats if rule.anomaly is not None else None,
            state.worker_params,
            ids_M,
            state.model_state,
            zero_local,
        ),
    )
    params, outer_states, grad_norm, skipped, delayed_means = same
    local_params, inner_opt_state, residual, outputs, excluded_M, dropped_M = mine[:6]
    pending, worker_outer, norm_stats, worker_params, model_state, zero_local = mine[6:]
    if zero is not None:
        outer_states = tuple(
            sync.joined(shared, local)
            for sync, shared, local in zip(zero, outer_states, zero_local, strict=True)
        )
    losses_MxH, aux_MxH = outputs
    metrics = step_means(losses_MxH, aux_MxH, steps_M if rule.worker_steps else None)
    metrics["outer_grad_norm"] = grad_norm
    if weighted:
        metrics |= {
            "excluded_workers": excluded_M,
            "dropped_workers": dropped_M,
            "skipped": skipped,
        }
    if eager:
        outer_opt_state = worker_outer
    else:
        outer_opt_state = outer_states if schedule.fragmented else outer_states[0]
    new_state = DiLoCoState(
        params,
        outer_opt_state,
        inner_opt_state,
        state.round + 1,
        residual,
        local_params if carried else state.local_params,
        *(pending if outer_delay else (None, None)),
        delayed_means,
        norm_stats if rule.anomaly is not None else state.norm_stats,
        worker_params,
        model_state,
    )
    return new_state, metrics


def _round_body(
    shared,
    local,
    collectives,
    *,
    step: Step,
    outer_optimizer,
    batches,
    num_steps,
    schedule: Schedule,
    exchanges,
    rule: faults.Weights | None,
    carried: bool,
    treedef,
    outer_delay: int,
    eager: bool,
    num_workers: int,
    syncs: "state_syncs.Syncs | None",
    rng_seed: int | None,
    merge_rules: "model_states.Rules | None",
    zero: "tuple[outer_shards_lib.SyncShards, ...] | None" = None,
    host: bool = False,
    per_shard: tuple | None = None,
    one_per_device: bool = False,
):
    """The round on one device's k workers (leaves [k, ...]): inner-step segments between
    the schedule's boundaries; at each sync the deltas, weights, exchange, outer update and
    merge. Returns ((θ, outer states, delta norm, skipped, delayed means), per-worker
    outputs)."""
    global_params, outer_states, shared_data, delayed_means, round_ = shared
    params_k, opt_k, residual_k, dropped_kxP, steps_k, data_k, pending_k, outer_k = local[:8]
    stats_k = None if local[8] is None else list(local[8])
    theta_k, ids_k, model_k = local[9], local[10], local[11]
    zero_local = None if local[12] is None else list(local[12])
    squares = []  # each sync's squared mean-delta norm, under split outer states
    model_start_k = model_k
    # A device's workers step under a vmap; one worker a device steps without it: XLA's CPU
    # dots lose half their speed to a unit batch dimension.
    per_worker = _unbatched if one_per_device else _batched
    keys_k = None  # each worker's base key of this round's steps (`inner.worker_key`)
    if rng_seed is not None:
        keys_k = jax.vmap(lambda w: worker_key(rng_seed, round_, w))(ids_k)
    global_leaves = None if eager else treedef.flatten_up_to(global_params)
    on_device = set()  # under host memory: θ's leaves updated on the device this round
    outer_states = None if eager else list(outer_states)
    if eager:
        # Each worker's own θ_m (what its deltas are taken against) and outer states, one per
        # sync. Without fragments a worker restarts each round from θ_m: its params are θ_m.
        theta_leaves_k = treedef.flatten_up_to(params_k if theta_k is None else theta_k)
        outer_k = list(outer_k) if schedule.fragmented else [outer_k]
    opt_start_k = opt_k
    num_local = jax.tree.leaves(data_k)[0].shape[0]
    res_leaves = None if residual_k is None else treedef.flatten_up_to(residual_k)
    false_k = jnp.zeros((num_local,), bool)
    # With one worker per device (shard_map, pmap, a user mesh), what only a fault changes (θ
    # and its outer state at a sync that includes no worker, a left-out worker's inner state)
    # is updated by a loop of zero or one trip: the usual round passes the values on in place,
    # where a select reads two copies, writes a third and makes XLA keep the old ones alive.
    # With several workers on a device (vmap) they stay selects: XLA fuses the workers' sum
    # into the outer update (a loop would change its rounding), and with the whole state
    # donated it copies the inner state twice more around a restore loop.
    in_place_skips = num_local == 1
    excluded_k, dropped_any_k, skipped = false_k, false_k, jnp.bool_(False)
    losses, auxes, snapshots, means = [], [], {}, []
    if outer_delay:
        # Last round's deltas first: this exchange reads only the state, so it can run while
        # the workers take this round's inner steps.
        launched, res_leaves = _launch(
            exchanges, schedule, pending_k, res_leaves, rule, treedef, collectives, num_workers,
            per_shard,
        )  # fmt: skip
        (applied_mean, applied_weights), delayed_means = _applied(launched, delayed_means)
        applied_leaves = treedef.flatten_up_to(applied_mean)
        stale_leaves_k = treedef.flatten_up_to(pending_k[0][0])
        # Each synced leaf's slot is filled at its sync; a frozen leaf (in no sync) keeps the
        # zero delta it started with.
        fresh_leaves_k, in_flight_syncs = treedef.flatten_up_to(pending_k[0][-1]), []

    def segment(params, opt_state, model_state, steps, my_data, key, worker, start, stop):
        data = worker_batches(batches, shared_data, my_data)
        if isinstance(batches, Sampler):
            data = data if start == 0 else functools.partial(_offset, data, start)
        elif (start, stop) != (0, num_steps):
            data = jax.tree.map(lambda x: x[start:stop], data)
        active = None if rule is None or rule.worker_steps is None else steps - start
        return run_steps(
            step,
            params,
            opt_state,
            model_state,
            data,
            num_steps=stop - start,
            active_steps=active,
            key=key,
            first_step=start,
            round_=None if worker is None else round_,
            worker=worker,
        )

    def one_step(carried, opt_state, steps, my_data, key, worker, x):
        # One worker's inner step h (masked after its h_m steps), for the synced scan; the
        # model state rides with the params (`synced_scan` averages optimizer fields only).
        h, batch = (x, worker_batches(batches, shared_data, my_data)(x)) if sampled else x
        active = None if rule is None or rule.worker_steps is None else h < steps
        info = StepInfo(
            None if worker is None else round_, worker, h, None if key is None else step_key(key, h)
        )
        (params, model_state) = carried
        params, opt_state, model_state, loss, aux = masked_step(
            step, params, opt_state, model_state, batch, info, active
        )
        return (params, model_state), opt_state, (loss, aux)

    def synced_segment(start_params, in_axis, opt_k, model_k, start, stop):
        # DES-LOC: every worker steps under one scan, averaging state fields when due.
        if in_axis is None:
            start_params = jax.tree.map(
                lambda x: jnp.broadcast_to(x, (num_local, *x.shape)), start_params
            )
        hs = jnp.arange(start, stop, dtype=jnp.int32)
        if sampled:
            xs, x_axis = hs, None
        else:
            xs = (hs, jax.tree.map(lambda x: jnp.moveaxis(x[:, start:stop], 1, 0), data_k))
            x_axis = (None, 0)
        key_axis = None if keys_k is None else 0
        id_axis = None if ids_k is None else 0
        step_k = per_worker(one_step, (0, 0, 0, 0, key_axis, id_axis, x_axis))

        def average(field_k):
            mean = collectives.reduce(
                functools.partial(_mean_to_every_worker, num_workers=num_workers), field_k
            )
            return collectives.vary(mean)

        (params_k, model_k), opt_k, out_kxS = state_syncs.synced_scan(
            lambda p, o, x: step_k(p, o, steps_k, data_k, keys_k, ids_k, x),
            (start_params, model_k),
            opt_k,
            xs,
            round_ * num_steps + start,
            syncs,
            average,
        )
        return params_k, opt_k, model_k, *out_kxS

    sampled = isinstance(batches, Sampler)
    bounds = schedule.boundaries(num_steps)
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        if params_k is None:  # every worker starts the round from θ
            theta = offload.fetch(global_params) if host else global_params
            start_params, in_axis = collectives.vary(theta), None
        else:
            start_params, in_axis = params_k, 0
        if syncs:
            params_k, opt_k, model_k, *out_kxS = synced_segment(
                start_params, in_axis, opt_k, model_k, start, stop
            )
        else:
            run = functools.partial(segment, start=start, stop=stop)
            key_axis = None if keys_k is None else 0
            id_axis = None if ids_k is None else 0
            params_k, opt_k, model_k, *out_kxS = per_worker(
                run, (in_axis, 0, 0, 0, 0, key_axis, id_axis)
            )(start_params, opt_k, model_k, steps_k, data_k, keys_k, ids_k)
        losses.append(out_kxS[0])
        auxes.append(out_kxS[1])
        for sync in schedule.syncs:
            if sync.snapshot == stop:
                snapshots[sync.index] = jax.tree.leaves(params_k)
            if sync.at != stop:
                continue
            local_leaves = treedef.flatten_up_to(params_k)
            indices = leaf_indices(sync, len(local_leaves))
            snapshot_k = part(sync, snapshots.pop(sync.index), treedef)
            if eager:  # each worker's delta against its own θ_m^{t-1}
                old_k = part(sync, theta_leaves_k, treedef)
                delta_k = jax.vmap(worker_delta)(old_k, snapshot_k)
            else:
                old = part(sync, global_leaves, treedef)
                base = old
                if host:  # θ's leaves from host memory, once the workers' steps are done
                    base = offload.fetch(collectives.vary(old), after=snapshot_k)
                delta_k = jax.vmap(worker_delta, in_axes=(None, 0))(base, snapshot_k)
            included_k = weight_k = finite_k = dropped_now_k = None
            if rule is not None:
                finite_k, weight_k = _weights(
                    rule, delta_k, steps_k, stats_k, sync.index, round_, collectives
                )
                dropped_now_k = false_k if dropped_kxP is None else dropped_kxP[:, sync.index]
                included_k = finite_k & ~dropped_now_k
            if outer_delay:
                # The round's mean loss is all-reduced after the inner loop. Made to read the
                # launched mean (adding 0 x one of its values: exact, and not folded for
                # floats), XLA can't combine the two all-reduces into one that waits for the
                # loop (optimization barriers don't survive XLA's CPU pipeline).
                losses[-1] = losses[-1] + 0.0 * jax.tree.leaves(launched[0])[0].ravel()[0]
                in_flight = jnp.ones((num_local,), jnp.float32)
                if rule is not None:
                    in_flight = jnp.where(
                        included_k, in_flight if weight_k is None else weight_k, 0.0
                    )
                in_flight_syncs.append(in_flight)
                for i, value in zip(indices, jax.tree.leaves(delta_k), strict=True):
                    fresh_leaves_k[i] = value
                mean = part(sync, applied_leaves, treedef)
                weight_sum = None
                if rule is not None:
                    weight_sum = applied_weights
                    if schedule.fragmented:
                        weight_sum = applied_weights[sync.index]
            elif zero is not None:
                mean = None  # each device holds its slice of it only
                to_reduce_k, _ = jax.vmap(exchanges[len(means)].send)(
                    delta_k, None, included_k, weight_k
                )
                weight_sum = None
                if rule is not None:
                    to_reduce_k, sent_weights_k = to_reduce_k
                    weight_sum = collectives.reduce(_total, sent_weights_k)
                sums = jax.tree.map(lambda x: jnp.sum(x, 0), to_reduce_k)
                if host:  # θ's leaves and this device's outer-state pieces, for the update
                    # (θ and the shared pieces are the same on every worker: tied to no
                    # per-worker value, they stay so)
                    old, outer_states[sync.index] = offload.fetch((old, outer_states[sync.index]))
                    zero_local[sync.index] = offload.fetch(zero_local[sync.index], after=sums)
                    on_device.update(indices)
                new, new_shared, new_local, squared = outer_shards_lib.sync_step(
                    zero[sync.index], outer_optimizer, old, outer_states[sync.index],
                    zero_local[sync.index], sums, weight_sum,
                )  # fmt: skip
                squares.append(squared)
                if weight_sum is not None:
                    keep = weight_sum <= 0
                    new_shared = faults.select_tree(keep, outer_states[sync.index], new_shared)
                    new_local = faults.select_tree(keep, zero_local[sync.index], new_local)
                zero_local[sync.index] = new_local
            else:
                res_k = None if res_leaves is None else part(sync, res_leaves, treedef)
                mean, weight_sum, res_k = _exchanged(
                    exchanges[len(means)], collectives, per_shard and per_shard[sync.index],
                    delta_k, res_k, included_k, weight_k,
                )  # fmt: skip
                if res_leaves is not None:
                    for i, value in zip(indices, jax.tree.leaves(res_k), strict=True):
                        res_leaves[i] = value
            means.append(mean)
            if eager:
                stale_k = part(sync, stale_leaves_k, treedef)
                tilde_k = delay.eager_delta(mean, delta_k, stale_k, num_workers)
                new_k, outer_k[sync.index] = jax.vmap(
                    functools.partial(outer_update, outer_optimizer)
                )(old_k, outer_k[sync.index], tilde_k)
                for i, value in zip(indices, jax.tree.leaves(new_k), strict=True):
                    theta_leaves_k[i] = value
                if not schedule.fragmented:  # the whole tree (frozen leaves as they were)
                    params_k = jax.tree.unflatten(treedef, theta_leaves_k)
                    continue
                params_k = _merged(
                    local_leaves, theta_leaves_k, indices, schedule.merge_alpha, None, None,
                    treedef, collectives.vary, per_worker=True,
                )  # fmt: skip
                continue
            if host and zero is None:  # θ's leaves and their outer state, for the update
                old, outer_states[sync.index] = offload.fetch(
                    (old, outer_states[sync.index]), after=mean
                )
                on_device.update(indices)
            # A sync that includes no worker leaves θ's leaves and their outer state as they are.
            none_included = None if weight_sum is None else weight_sum <= 0
            apply_outer = functools.partial(outer_update, outer_optimizer)
            if zero is not None:  # its outer-state pieces were kept above
                new_outer = new_shared
                if none_included is not None:
                    new = faults.select_tree(none_included, old, new)
            elif none_included is not None and in_place_skips:
                new, new_outer = faults.unless(
                    none_included, apply_outer, (old, outer_states[sync.index]), mean
                )
            else:
                new, new_outer = apply_outer(old, outer_states[sync.index], mean)
                if none_included is not None:
                    new = faults.select_tree(none_included, old, new)
                    new_outer = faults.select_tree(
                        none_included, outer_states[sync.index], new_outer
                    )
            if none_included is not None:
                skipped = skipped | none_included
            outer_states[sync.index] = new_outer
            for i, value in zip(indices, jax.tree.leaves(new), strict=True):
                global_leaves[i] = value
            if rule is not None:
                excluded_k = excluded_k | ~finite_k
                dropped_any_k = dropped_any_k | dropped_now_k
            if carried:
                merge_from = global_leaves
                if host:  # a left-out worker restarts from all of θ: the rest from host memory
                    merge_from = [
                        g if i in on_device else offload.fetch(g, after=mean)
                        for i, g in enumerate(global_leaves)
                    ]
                params_k = _merged(
                    local_leaves, merge_from, indices, schedule.merge_alpha, finite_k,
                    dropped_now_k, treedef, collectives.vary,
                )  # fmt: skip
            if rule is not None and rule.leaves_out:
                # A non-finite worker's new inner state may hold NaNs: back to the round's start.
                restore = faults.restore_workers if in_place_skips else jax.vmap(faults.select_tree)
                opt_k, model_k = restore(finite_k, (opt_k, model_k), (opt_start_k, model_start_k))
    if merge_rules is not None:  # once a round, after its last sync
        model_k = model_states.merge(model_k, merge_rules, collectives, num_workers)
    if zero is not None:
        grad_norm = jnp.sqrt(sum(squares))
    else:
        grad_norm = optax.tree.norm(means[0] if len(means) == 1 else means).astype(jnp.float32)
    residual_k = None if res_leaves is None else jax.tree.unflatten(treedef, res_leaves)
    losses_kxH = losses[0] if len(losses) == 1 else jnp.concatenate(losses, axis=1)
    aux_kxH = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *auxes)
    new_global = None if eager else jax.tree.unflatten(treedef, global_leaves)
    outer_states = None if eager else tuple(outer_states)
    if eager:
        outer_k = tuple(outer_k) if schedule.fragmented else outer_k[0]
        if theta_k is not None:
            theta_k = jax.tree.unflatten(treedef, theta_leaves_k)
    if outer_delay:  # what goes in flight: this round's deltas (eager: the last d rounds')
        fresh_k = jax.tree.unflatten(treedef, fresh_leaves_k)
        in_flight = in_flight_syncs[0]
        if schedule.fragmented:
            in_flight = jnp.stack(in_flight_syncs, axis=1)
        pending_k = (pending_k[0][1:] if eager else ()) + (fresh_k,), in_flight
    same = (new_global, outer_states, grad_norm, skipped, delayed_means)
    faulted = (None, None) if rule is None else (excluded_k, dropped_any_k)
    local_out = (params_k if carried else None, opt_k, residual_k, (losses_kxH, aux_kxH), *faulted)
    stats_out = None if stats_k is None else tuple(stats_k)
    zero_out = None if zero_local is None else tuple(zero_local)
    return same, (*local_out, pending_k, outer_k, stats_out, theta_k, model_k, zero_out)


def _batched(fn, in_axes):
    return jax.vmap(fn, in_axes=in_axes)


def _unbatched(fn, in_axes):
    """`jax.vmap(fn, in_axes)` for a batch of one (in_axes: 0 or None per argument), without
    the batch dimension inside `fn`."""

    def squeeze(a, axis):
        if isinstance(axis, tuple):  # a prefix of the argument's tree
            return tuple(squeeze(x, ax) for x, ax in zip(a, axis, strict=True))
        return a if axis is None else jax.tree.map(lambda x: x[0], a)

    def one(*args):
        args = [squeeze(a, axis) for a, axis in zip(args, in_axes, strict=True)]
        return jax.tree.map(lambda x: x[None], fn(*args))

    return one


def _weights(rule: faults.Weights, delta_k, steps_k, stats_k, index, round_, collectives):
    """The weight rule at a sync: (finite_k: bool [k], False for a worker left out as
    non-finite or an outlier; weight_k: float32 [k], or None for weight 1). Updates
    `stats_k[index]` (the anomaly statistics) in place."""
    num_local = steps_k.shape[0]
    finite_k = jnp.ones((num_local,), bool)
    if rule.exclude_nonfinite:
        finite_k = jax.vmap(faults.all_finite)(delta_k)
    norms_k = None
    if rule.scheme == "norm_softmax" or rule.anomaly is not None:
        norms_k = jax.vmap(lambda d: optax.tree.norm(d).astype(jnp.float32))(delta_k)
    if rule.anomaly is not None:
        outlier_k = faults.anomalous(norms_k, stats_k[index], round_, rule.anomaly)
        keep_k = jnp.isfinite(norms_k) & ~outlier_k
        stats_k[index] = faults.updated_stats(norms_k, stats_k[index], keep_k, rule.anomaly)
        finite_k = finite_k & ~outlier_k
    weight_k = None
    if rule.scheme == "steps":
        weight_k = steps_k.astype(jnp.float32)
    elif rule.scheme == "norm_softmax":
        finite_norms = jnp.where(jnp.isfinite(norms_k), norms_k, jnp.inf)
        smallest = collectives.reduce(_smallest, finite_norms)
        weight_k = faults.softmax_weights(norms_k, smallest, rule.temperature)
    return finite_k, weight_k


def _mean_to_every_worker(local: Any, num_workers: int) -> Any:
    """Reducer: the mean over all M workers of leaves [k, ...], given to each of the k."""
    mean = exact_mean(local, num_workers)
    return jax.tree.map(lambda m, x: jnp.broadcast_to(m, x.shape), mean, local)


def _check_host(memory, method, backend) -> bool:
    """Whether θ and the outer state arrive in host memory; ValueError naming
    outer_state_memory for what it can't run with."""
    if offload.check_memory(memory) != offload.HOST:
        return False
    why = None
    if method.outer_delay:
        why = "a delayed or eager outer update (its mean is ready before the inner steps)"
    elif backend.name == "pmap":
        why = "the pmap backend"
    if why is not None:
        raise ValueError(f"outer_state_memory='pinned_host' does not run with {why}")
    return True


def _total(local: jax.Array) -> jax.Array:
    """Reducer: the sum over every worker (one all-reduce of a float32)."""
    return lax.psum(jnp.sum(local), WORKER_AXIS)


def _sync_shards(shards, method, backend, schedule, leaves, treedef, outer_states):
    """Each sync's `SyncShards` under a split outer state (None without one); ValueError
    naming shard_outer_over_workers for what it can't run with."""
    if shards is None:
        return None
    if not isinstance(shards, outer_shards_lib.OuterShards):
        raise ValueError(f"outer_shards must be an OuterShards, got {shards!r}")
    why = None
    if method.outer_delay:
        why = "a delayed or eager outer update (its means are launched a round early)"
    elif method.compression.kind != "none":
        why = "compression (its exchange decodes the whole mean on every worker)"
    elif backend.name != "shard_map" or backend.workers_per_device != 1:
        why = "workers other than one per device group of a shard_map backend"
    if why is not None:
        raise ValueError(f"shard_outer_over_workers does not run with {why}")
    if shards.num_workers != backend.num_workers or len(shards.dims) != len(leaves):
        raise ValueError(
            f"outer_shards was built for {shards.num_workers} workers and {len(shards.dims)} "
            f"param leaves, not {backend.num_workers} and {len(leaves)}"
        )
    wide = [jax.ShapeDtypeStruct(x.shape, delta_dtype(x.dtype)) for x in leaves]
    outer_shards_lib.check_per_coordinate(method.outer_optimizer, jax.tree.unflatten(treedef, wide))
    return tuple(
        outer_shards_lib.sync_shards(
            shards,
            jax.eval_shape(functools.partial(part, sync, wide, treedef)),
            leaf_indices(sync, len(leaves)),
            jax.eval_shape(lambda s=s: s),
        )
        for sync, s in zip(schedule.syncs, outer_states, strict=True)
    )


def _smallest(local: jax.Array) -> jax.Array:
    """Reducer: the smallest value over every worker (one all-reduce of a float32)."""
    return lax.pmin(jnp.min(local), WORKER_AXIS)


def _launch(
    exchanges, schedule, pending_k, res_leaves, rule, treedef, collectives, num_workers, per_shard
):
    """Exchanges last round's deltas (in flight in the state) at the start of a delayed
    round, one exchange per sync: ((mean tree, float32 weight sum: a scalar, with fragments
    one per fragment [P]), this device's updated residual leaves)."""
    deltas_k, weights_k = pending_k
    delta_leaves_k = treedef.flatten_up_to(deltas_k[-1])
    # A frozen leaf (in no sync) has a zero mean.
    mean_leaves = [jnp.zeros(x.shape[1:], x.dtype) for x in delta_leaves_k]
    weight_sums = []
    res_leaves = None if res_leaves is None else list(res_leaves)
    for sync, exchange in zip(schedule.syncs, exchanges, strict=True):
        indices = leaf_indices(sync, len(delta_leaves_k))
        included_k = weight_k = None
        if rule is not None:
            sync_weights_k = weights_k[:, sync.index] if schedule.fragmented else weights_k
            included_k = sync_weights_k > 0
            weight_k = None if rule.scheme == "uniform" else sync_weights_k
        residual = None if res_leaves is None else part(sync, res_leaves, treedef)
        mean, weight_sum, residual = _exchanged(
            exchange, collectives, per_shard and per_shard[sync.index],
            part(sync, delta_leaves_k, treedef), residual, included_k, weight_k,
        )  # fmt: skip
        weight_sums.append(jnp.float32(num_workers) if weight_sum is None else weight_sum)
        for i, value in zip(indices, jax.tree.leaves(mean), strict=True):
            mean_leaves[i] = value
        if residual is not None:
            for i, value in zip(indices, jax.tree.leaves(residual), strict=True):
                res_leaves[i] = value
    weight_sum = jnp.stack(weight_sums) if schedule.fragmented else weight_sums[0]
    return (jax.tree.unflatten(treedef, mean_leaves), weight_sum), res_leaves


def _exchanged(exchange, collectives, groups, delta_k, residual_k, included_k, weight_k):
    """One sync's exchange of this device's workers' deltas (leaves [k, ...]): (the mean,
    float32 weight sum or None, the new residuals). `groups` (`_per_shard`'s, for this sync):
    one exchange per group of leaves split over the same axes, run manual over those axes, so
    each device encodes and exchanges its own shards: XLA's partitioner would otherwise gather
    a sharded leaf to cut it into the codec's blocks, and every device would send the whole
    payload. (One exchange over leaves split differently would mix values that vary over an
    axis into leaves that don't.)"""

    def run(exchange, delta_k, residual_k, included_k, weight_k):
        to_reduce_k, residual_k = jax.vmap(exchange.send)(delta_k, residual_k, included_k, weight_k)
        mean, weight_sum = collectives.reduce(exchange.reduce, to_reduce_k)
        return mean, weight_sum, residual_k

    if groups is None:
        return run(exchange, delta_k, residual_k, included_k, weight_k)
    delta_leaves, treedef = jax.tree.flatten(delta_k)
    res_leaves = None if residual_k is None else treedef.flatten_up_to(residual_k)
    means, residuals = [None] * len(delta_leaves), [None] * len(delta_leaves)
    for positions, specs, axes, group_exchange in groups:
        deltas = [delta_leaves[i] for i in positions]
        res = None if res_leaves is None else [res_leaves[i] for i in positions]
        fn = functools.partial(run, group_exchange)
        if axes:
            specs_k = [P(None, *s) for s in specs]
            fn = jax.shard_map(
                fn,
                in_specs=(specs_k, None if res is None else specs_k, P(), P()),
                out_specs=(list(specs), P(), None if res is None else specs_k),
                axis_names=set(axes),
            )
        mean, weight_sum, res = fn(deltas, res, included_k, weight_k)
        for j, i in enumerate(positions):
            means[i] = mean[j]
            if res is not None:
                residuals[i] = res[j]
    residual_k = None if res_leaves is None else treedef.unflatten(residuals)
    # Every group sends the same weights, so any group's weight sum is the sync's.
    return treedef.unflatten(means), weight_sum, residual_k


def _check_round_mesh(backend: Backend, tree: Any, name: str) -> None:
    """ValueError naming `name` for an array typed on a mesh with Explicit axes other than the
    round's (`Backend.mesh`): the round can't take it (e.g. a state placed by hand on the
    user's mesh with a worker axis of another name)."""
    if not backend.mesh_axes:
        return
    names = tuple(backend.mesh.axis_names)
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
        types = getattr(mesh, "axis_types", ())
        if tuple(getattr(mesh, "axis_names", names)) != names and AxisType.Explicit in types:
            raise ValueError(
                f"{name} holds arrays on a mesh with Explicit axes {mesh.axis_names}, not the "
                f"round's mesh {names}: build the state with init_state(..., backend=backend) "
                "and put batches with backend.place_batches (Backend.on_user_mesh moves "
                "results back)"
            )


def _per_shard(param_specs, method, backend: Backend, schedule, leaves: list, weighted: bool):
    """Per sync, the groups a compressed exchange runs in on a mesh when some leaf is split
    over the worker's own axes: (positions in the sync's leaves, their specs, the axes they
    are split over, the exchange of their shards), by `exchange.shard_groups`. None when the
    exchange runs whole. ValueError naming param_specs for a malformed one."""
    if param_specs is None:
        return None
    if not isinstance(param_specs, tuple | list) or len(param_specs) != len(leaves):
        raise ValueError(
            f"param_specs must be a tuple of one PartitionSpec per param leaf ({len(leaves)}), "
            f"got {param_specs!r}"
        )
    for spec in param_specs:
        if not isinstance(spec, P):
            raise ValueError(f"param_specs must hold PartitionSpecs, got {spec!r}")
    split = any(entry is not None for spec in param_specs for entry in spec)
    if method.compression.kind == "none" or not backend.mesh_axes or not split:
        return None
    mesh = backend.mesh
    out = []
    for sync in schedule.syncs:
        indices = leaf_indices(sync, len(leaves))
        specs = [param_specs[i] for i in indices]
        groups = []
        for axes, positions in shard_groups(specs):
            shards = [
                jax.ShapeDtypeStruct(
                    placement_lib.shard_shape(leaves[indices[j]].shape, specs[j], mesh),
                    delta_dtype(leaves[indices[j]].dtype),
                )
                for j in positions
            ]
            exchange = make_exchange(method.compression, shards, backend.num_workers, weighted)
            groups.append((positions, [specs[j] for j in positions], axes, exchange))
        out.append(tuple(groups))
    return tuple(out)


def _applied(launched, delayed_means):
    """The (mean, weight sum) this round applies and the means still waiting: the one
    launched this round when d = 1, else the oldest waiting one."""
    if delayed_means is None:
        return launched, None
    return delayed_means[0], (*delayed_means[1:], launched)


def _offset(batch_of, start, h):
    return batch_of(h + start)


def _merged(
    local_leaves, global_leaves, indices, alpha, finite_k, dropped_k, treedef, vary,
    per_worker=False,
):  # fmt: skip
    """Each worker's params after a sync of the leaves `indices`: the synced leaves become
    θ' + alpha (θ_m - θ') (θ' for alpha 0), except that a dropped worker keeps its own; a
    non-finite worker (finite_k False) restarts every leaf from the current global values.
    finite_k / dropped_k are None without fault options. `vary` types θ' copies as
    per-worker: inner steps from a value typed shared would sum their gradients over workers.
    `per_worker`: the global leaves are each worker's own θ' ([k, ...], eager updates)."""
    leaves = list(local_leaves)
    for i in indices:
        at_sync = leaves[i]
        new = global_leaves[i] if per_worker else global_leaves[i][None]
        if alpha:
            merged = (new + alpha * (at_sync - new)).astype(at_sync.dtype)
        elif per_worker:
            merged = new.astype(at_sync.dtype)
        else:
            merged = vary(jnp.broadcast_to(new.astype(at_sync.dtype), at_sync.shape))
        if dropped_k is not None:
            merged = _where_k(dropped_k, at_sync, merged)
        leaves[i] = merged
    if finite_k is not None:
        leaves = [
            _where_k(finite_k, x, g[None].astype(x.dtype))
            for x, g in zip(leaves, global_leaves, strict=True)
        ]
    return jax.tree.unflatten(treedef, leaves)


def _where_k(mask_k, on_true_k, on_false):
    """Per worker: `on_true_k` ([k, ...]) where mask_k ([k]) holds, else `on_false`."""
    mask = mask_k.reshape(mask_k.shape + (1,) * (on_true_k.ndim - 1))
    return jnp.where(mask, on_true_k, on_false)


def _check_state(
    state: DiLoCoState,
    params_like: Any,
    num_workers: int,
    method: DiLoCo,
    trainable: Any,
    model_like: Any = None,
    worker_like: Any = None,
) -> None:
    """Raises one ValueError when `state` is not what `init_state(params, M, method,
    trainable=...)` builds: the fields that differ in structure, shape or dtype are named."""
    want = jax.eval_shape(
        lambda p, m, w: init_state(
            p, num_workers, method, trainable=trainable, model_state=m, worker_state=w
        ),
        params_like,
        model_like,
        worker_like,
    )
    differ = [
        name
        for name, have, expect in zip(DiLoCoState._fields, state, want, strict=True)
        if _shapes(have) != _shapes(expect)
    ]
    if differ:
        raise ValueError(
            f"state was built for another method than {method!r}, another number of workers "
            f"({num_workers}) or another trainable mask: its fields {differ} differ from "
            "init_state(params, num_workers, method, trainable=...)'s; build the state with "
            "what you run"
        )


def _one_worker(tree_M: Any) -> Any:
    """The shapes of one worker's slice of a [M, ...]-stacked pytree."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree_M)


def _check_step_functions(params_of: Any, with_params: Any, method: DiLoCo, has_aux: bool) -> bool:
    """Whether the round runs a worker step: both `params_of` and `with_params` are
    callables (ValueError naming the one missing; or a method with its own inner optimizer,
    which a worker step replaces)."""
    if params_of is None and with_params is None:
        return False
    for name, fn in (("params_of", params_of), ("with_params", with_params)):
        if not callable(fn):
            raise ValueError(f"{name} must be a callable with a worker step, got {fn!r}")
    if method.inner is not None:
        raise ValueError("a worker step is its own inner optimizer: give a DiLoCo without inner")
    if has_aux:
        raise ValueError("has_aux does not apply to a worker step: its metrics dict is the aux")
    return True


def _shapes(tree: Any) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [(tuple(jnp.shape(x)), jnp.result_type(x)) for x in leaves]


def _inner_steps_of(batches: Any, inner_steps: int | None) -> int:
    """H from host batches' second dim [M, H, ...], or the explicit `inner_steps`."""
    if isinstance(batches, Sampler):
        if inner_steps is None:
            raise ValueError("inner_steps is required when batches is a Sampler")
        return inner_steps
    return jax.tree.leaves(batches)[0].shape[1]


__all__ = ["DiLoCoState", "Sync", "diloco_round", "init_state"]

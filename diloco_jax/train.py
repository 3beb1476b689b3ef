"""The host loops: `train_diloco` (rounds of DiLoCo) and `train_sync` (the data-parallel
baseline). They validate inputs at the boundary, place state on the backend's devices, run
one compiled dispatch per round (or step), and record one history dict per round."""

import dataclasses
import functools
import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_jax import checkpoint, delay, donation, offload, outer_sharding
from diloco_jax import model_state as model_state_lib
from diloco_jax import placement as placement_lib
from diloco_jax import sampler as sampler_lib
from diloco_jax import state_sync as state_sync_lib
from diloco_jax import trainable as trainable_lib
from diloco_jax.comm import payload_bytes, round_bytes, sync_step_wire_bytes
from diloco_jax.distributed import is_multiprocess, place_global, to_host
from diloco_jax.inner import LossFn, StepInfo, check_loss_options
from diloco_jax.layout import Rounds
from diloco_jax.method import DiLoCo, default_inner_optimizer, method_from_options, only_optimizers
from diloco_jax.placement import Placement
from diloco_jax.round import diloco_round, init_state
from diloco_jax.sampler import Sampler
from diloco_jax.sync import init_sync_state, sync_step
from diloco_jax.workers import Backend, make_backend

Record = dict[str, Any]


class TrainResult(NamedTuple):
    """params: final global params; state: the full final state; history: one dict a round
    (a step for `train_sync`); model_state: the merged model state (leaves under "keep"
    stacked [M, ...], see `diloco_jax.model_state`), None without one."""

    params: Any
    state: Any
    history: list[Record]
    model_state: Any = None


def train_diloco(
    loss_fn: LossFn,
    params: Any,
    data: Iterable[Any],
    *,
    num_rounds: int,
    num_workers: int,
    inner_steps: int,
    method: DiLoCo | None = None,
    backend: "str | Backend" = "auto",
    devices: list[jax.Device] | None = None,
    eval_fn: Callable[..., dict[str, jax.Array]] | None = None,
    eval_every: int = 1,
    eval_data: Any = None,
    callback: Callable[[Record], None] | None = None,
    checkpoint_dir: "str | os.PathLike | None" = None,
    checkpoint_every: int = 1,
    keep_checkpoints: int = 3,
    data_parallel: int = 1,
    has_aux: bool = False,
    rng_seed: int | None = None,
    trainable: Any = None,
    model_state: Any = None,
    model_state_merge: Any = None,
    mesh: Mesh | None = None,
    worker_axis: str = "workers",
    param_sharding: Any = None,
    batch_sharding: P | None = None,
    process_local_data: bool = False,
    shard_outer_over_workers: bool = False,
    outer_state_memory: str = "device",
    **options: Any,
) -> TrainResult:
    """Trains with DiLoCo for `num_rounds` communication rounds.

    Args:
      loss_fn: (params, batch) -> float scalar; batch is one worker's batch for one step.
        With `model_state`: (params, model_state, batch) -> (loss, new_model_state), or
        (loss, (new_model_state, aux)) with `has_aux`; a key comes last with `rng_seed`.
      params: initial global params, any pytree of float arrays. Never mutated or donated.
      data: iterable of rounds; each a batch pytree with leaves [num_workers, inner_steps, ...].
        Exactly `num_rounds` items are consumed. Or a `Sampler`, which draws every inner
        step's batch inside the compiled round (round r, worker m, step h). Or a callable
        `start_round -> iterable of the rounds from start_round on`: a resumed run calls it
        with its first round, so the skipped rounds are never drawn (the same for
        `train_sync`'s steps).
      num_rounds: R >= 0. num_workers: M >= 1. inner_steps: H >= 1.
      method: the method, a `DiLoCo` spec (inner / outer optimizers, schedule, compression,
        weights, delay, state sync, outer state dtype: see `diloco_jax.method`); None: the
        paper's DiLoCo, or the spec its keyword shorthand in `options` builds
        (`method_from_options`):
        inner_optimizer, outer_optimizer, outer_clip (EDiT's clip chained before the outer
        optimizer), compression, exclude_nonfinite, drop_probability, drop_seed,
        worker_steps, weighting, temperature, anomaly, fragments, overlap_steps,
        merge_alpha, outer_delay, eager, state_sync, outer_state_dtype (e.g. "bfloat16":
        the outer momentum stored in it, lossy). `train_diloco(..., fragments=2)` is
        exactly `method=DiLoCo(schedule=Streaming(2))`; giving both is a ValueError.
      backend: "auto" | "vmap" | "shard_map" | "pmap" (see `diloco_jax.workers`).
      devices: devices for the device backends (default `jax.devices()`).
      data_parallel: devices per worker (shard_map): each worker's batch (the dim after
        [M, H]) is split over its devices and its gradients averaged there every inner step;
        the deltas are averaged over workers once a round.
      mesh, worker_axis, param_sharding, batch_sharding: the user's `jax.sharding.Mesh`, with
        one axis `worker_axis` of size M; its other axes partition each worker
        (`diloco_jax.placement`). `param_sharding`: a pytree like `params` of
        `PartitionSpec`s over the other axes, or a callable (path, leaf) -> PartitionSpec;
        None keeps each param's own `NamedSharding` spec, else replicates it inside a worker.
        θ and the outer state sit at each leaf's spec, every per-worker field at
        P(worker_axis, *spec); the result's arrays keep these shardings. `batch_sharding`:
        one worker's one-step batch (default: its leading dim over every other axis). Not
        with `devices` or `data_parallel`.
      process_local_data: in a multi-process run, each process's `data` items hold only
        the workers its devices own (leaves [M_local, H, ...]; where a worker spans
        processes, this process's part of its batch), assembled into the global batch with
        `jax.make_array_from_process_local_data`, so no host reads another's data. Default
        False: every process passes the whole global batch. Not with a `Sampler`.
      shard_outer_over_workers: ZeRO-1 across workers: the outer optimizer state is split
        over the worker axis (each worker's devices hold 1/M of it, at the leaf's spec with
        the worker axis added on its first dim divisible by M; a leaf with none stays
        replicated), the deltas are reduce-scattered, each worker updates its slice of θ and
        θ is all-gathered: the bytes of one all-reduce (`diloco_jax.outer_sharding`). Needs a
        shard_map backend with one worker per device group and an outer optimizer that
        updates each coordinate on its own; not with compression or a delay.
      outer_state_memory: "device" (default) or "pinned_host": θ and the outer optimizer
        state live in the devices' pinned host memory between rounds and during the inner
        steps, copied to the device inside the compiled round only for the sync (and θ for
        the workers' start); the same arithmetic, so the same bits (`diloco_jax.offload`).
        `TrainResult.params` is copied back to device memory, `TrainResult.state` keeps
        them in host memory. With shard_outer_over_workers, each device's shards of the outer
        state. Not with a delay, eager updates or pmap.
      has_aux: `loss_fn` returns (loss, aux), aux a dict of scalars (e.g. accuracy): each
        joins the history like "loss" / "worker_loss", as history[r][name] (mean over the
        round's steps and workers) and history[r]["worker_" + name] ([M]); a name that
        collides with a history key is a ValueError.
      rng_seed: an int >= 0: `loss_fn(params, batch, key)`, one key per (round r, worker m,
        inner step h), `fold_in(fold_in(fold_in(PRNGKey(rng_seed), r), m), h)`: independent
        streams per worker, bit-identical runs, the same keys after a resume and on every
        backend. None: `loss_fn(params, batch)`.
      trainable: a pytree of bools like `params`, or a callable (path, leaf) -> bool: frozen
        leaves keep their values bit for bit (no inner update or weight decay, no delta, no
        outer state, no bytes; see `diloco_jax.trainable`). None: every leaf trains.
      model_state: a pytree of arrays beside the params (BatchNorm statistics, counters of
        any dtype): each worker carries its own copy through its inner steps; at the end of
        every round it is merged by `model_state_merge` (one rule or a pytree of rules:
        "mean", the default for float leaves; "first"; "keep", the default for the others;
        see `diloco_jax.model_state`). No optimizer sees it; it is not in the deltas or
        "wire_bytes"; its merge's bytes are history's "model_state_wire_bytes".
      eval_fn: optional jittable (params[, model_state][, eval_data]) -> dict of scalars (the
        model state when the run has one, `eval_data` when given), run at the first round
        end at or past every multiple of `eval_every` inner steps and after the last round;
        its values join that round's history entry. Under eager updates it sees the mean of
        the workers' own params (as does the result's `params`); the model state it sees is
        the merged one (`TrainResult.model_state`).
      eval_data: any pytree of arrays passed to `eval_fn` as its last argument (placed on the
        devices once, not baked into the program).
      callback: called with each history entry as it is recorded (e.g. a progress bar).
      checkpoint_dir: if set, the full state and history are saved there (Orbax, atomic) every
        `checkpoint_every` rounds and after the last, keeping the newest `keep_checkpoints`;
        a call with a `checkpoint_dir` that holds a checkpoint resumes from it (the data of
        completed rounds is skipped; a Sampler is keyed by round), so the result is
        bit-identical to an uninterrupted run. A checkpoint of another configuration (M, H,
        param shapes or dtypes, optimizer state, the method's parts but its optimizers,
        which have no stable form) is a ValueError.

    Returns:
      TrainResult(params, state: DiLoCoState, history, model_state). history[r] has "round"
      (0-based),
      "steps" (inner steps per worker so far), "loss", "worker_loss" ([M]), "outer_grad_norm"
      "bytes_communicated" (cumulative payload each worker contributes: size x itemsize of
      every averaged delta leaf, float32 or wider, or of every compressed payload array its
      encoding produces; 0 when M = 1) and "wire_bytes" (cumulative bytes each worker sends
      on the wire for every collective of its rounds under ring algorithms over the M
      workers: payloads, scales, fault weights, the loss metric, DES-LOC's state syncs; see
      `DiLoCo.round_wire_bytes`; the same whatever the device layout). With fault options on
      (exclusion, drops, worker_steps, weighting, anomaly), also "excluded_workers",
      "dropped_workers" and "skipped" (see `diloco_round`).
    """
    here = locals()
    method = method_from_options(method, options, caller="train_diloco")
    return _train_diloco(
        loss_fn,
        params,
        data,
        method,
        dict(num_rounds=num_rounds, num_workers=num_workers, inner_steps=inner_steps),
        _RunOptions.of(here),
        has_aux=has_aux,
        model_state=model_state,
        model_state_merge=model_state_merge,
    )


def train_diloco_step(
    worker_step: Callable[[Any, Any, StepInfo], tuple[Any, dict[str, jax.Array]]],
    worker_state: Any,
    data: Iterable[Any],
    *,
    params_of: Callable[[Any], Any],
    with_params: Callable[[Any, Any], Any],
    num_rounds: int,
    num_workers: int,
    inner_steps: int,
    method: DiLoCo | None = None,
    backend: "str | Backend" = "auto",
    devices: list[jax.Device] | None = None,
    eval_fn: Callable[..., dict[str, jax.Array]] | None = None,
    eval_every: int = 1,
    eval_data: Any = None,
    callback: Callable[[Record], None] | None = None,
    checkpoint_dir: "str | os.PathLike | None" = None,
    checkpoint_every: int = 1,
    keep_checkpoints: int = 3,
    data_parallel: int = 1,
    rng_seed: int | None = None,
    trainable: Any = None,
    mesh: Mesh | None = None,
    worker_axis: str = "workers",
    param_sharding: Any = None,
    batch_sharding: P | None = None,
    process_local_data: bool = False,
    shard_outer_over_workers: bool = False,
    outer_state_memory: str = "device",
    **options: Any,
) -> TrainResult:
    """DiLoCo around your own train step: `train_diloco` with the inner step replaced.

    Args:
      worker_step: (worker_state, batch, info) -> (worker_state, metrics), jittable; runs H
        times per round inside the compiled round. `info` is a `StepInfo` (round, worker, step
        within the round, and the step's key with `rng_seed`); `metrics` a dict of scalars
        holding a float "loss" (before the update): the others join the history like aux
        metrics ("name" and "worker_name").
      worker_state: one worker's initial state (e.g. params, optimizer state, counters);
        every worker starts from a copy, keeps all of it but its params from round to round,
        and has its params set to θ (or its own, under fragments, drops or eager updates) at
        each round's start.
      params_of: worker_state -> params, the pytree DiLoCo averages (float leaves).
      with_params: (worker_state, params) -> worker_state with those params.
      method: a `DiLoCo` without `inner` (the worker step is the inner optimizer) or its
        shorthand; every other part applies as in `train_diloco` (state sync finds its fields
        by name inside the worker state).
      trainable: frozen leaves of the params are written back after every step (bit for bit;
        the worker step's optimizer still sees them).
      The rest as in `train_diloco`; `eval_fn(params[, eval_data])`.

    Returns:
      TrainResult(params, state, history): `state.inner_opt_state` holds each worker's worker
      state, leaves [M, ...]. The `loss_fn` form of `train_diloco` is this contract with the
      worker state (params, inner optimizer state[, model state]).
    """
    here = locals()
    method = method_from_options(method, options, caller="train_diloco_step")
    if not callable(worker_step):
        raise ValueError(f"worker_step must be a callable, got {worker_step!r}")
    for name, fn in (("params_of", params_of), ("with_params", with_params)):
        if not callable(fn):
            raise ValueError(f"{name} must be a callable, got {fn!r}")
    try:
        params = params_of(worker_state)
    except Exception as error:  # noqa: BLE001 (the user's function: say which one failed)
        raise ValueError(f"params_of(worker_state) failed: {error}") from error
    return _train_diloco(
        worker_step,
        params,
        data,
        method,
        dict(num_rounds=num_rounds, num_workers=num_workers, inner_steps=inner_steps),
        _RunOptions.of(here),
        worker_state=(worker_state, params_of, with_params),
    )


class _RunOptions(NamedTuple):
    """The run options both DiLoCo trainers take, as their keyword arguments name them."""

    backend: Any
    devices: Any
    eval_fn: Any
    eval_every: int
    eval_data: Any
    callback: Any
    checkpoint_dir: Any
    checkpoint_every: int
    keep_checkpoints: int
    data_parallel: int
    rng_seed: int | None
    trainable: Any
    mesh: Any
    worker_axis: str
    param_sharding: Any
    batch_sharding: Any
    process_local_data: bool
    shard_outer_over_workers: bool = False  # train_sync has no outer state
    outer_state_memory: str = "device"

    @classmethod
    def of(cls, arguments: dict[str, Any]) -> "_RunOptions":
        return cls(**{name: arguments[name] for name in cls._fields if name in arguments})


def _train_diloco(
    fn,
    params,
    data,
    method: DiLoCo,
    sizes: dict[str, int],
    run: _RunOptions,
    *,
    has_aux: bool = False,
    model_state: Any = None,
    model_state_merge: Any = None,
    worker_state: Any = None,
) -> TrainResult:
    """The host loop of `train_diloco` and `train_diloco_step` (`fn` a loss_fn or, with
    `worker_state` = (state, params_of, with_params), a worker step)."""
    num_rounds, num_workers, inner_steps = (sizes[k] for k in sizes)
    check_loss_options(has_aux, run.rng_seed)
    _check_int("num_rounds", num_rounds, 0)
    _check_int("num_workers", num_workers, 1)
    _check_int("inner_steps", inner_steps, 1)
    _check_int("eval_every", run.eval_every, 1)
    _check_params(params)
    backend = _check_processes(_backend(run, num_workers))
    mask = trainable_lib.resolved(params, run.trainable)
    frozen = trainable_lib.frozen_leaves(params, mask)
    step_options = {}
    if worker_state is not None:
        worker_state, params_of, with_params = worker_state
        step_options = {"params_of": params_of, "with_params": with_params}
        inner_state = jax.eval_shape(lambda w: w, worker_state)
    else:
        inner = trainable_lib.masked_optimizer(method.inner_optimizer, params, frozen)
        inner_state = jax.eval_shape(inner.init, params)
    _, syncs = method.check_run(params, num_workers, inner_steps, frozen, inner_state)
    placed = _placement(run, backend, params, method, frozen)
    rules = _model_state_rules(model_state, model_state_merge)
    if rules is not None:
        step_options["model_state_merge"] = model_state_lib.Resolved(rules)
    init = functools.partial(init_state, num_workers=num_workers, method=method, trainable=mask)
    if placed is None:
        state = init(params, model_state=model_state, worker_state=worker_state)
    else:  # built in place: no device ever holds more than its shards
        state = placement_lib.build_in_place(init, placed, params, model_state, worker_state)
    step = _jitted(
        diloco_round,
        fn,
        backend,
        method=method,
        num_workers=num_workers,
        inner_steps=inner_steps,
        **({"has_aux": True} if has_aux else {}),
        **({"rng_seed": run.rng_seed} if run.rng_seed is not None else {}),
        **({"trainable": mask} if mask is not None else {}),
        **step_options,
        **({} if placed is None or placed.outer is None else {"outer_shards": placed.outer}),
        **({"outer_state_memory": offload.HOST} if placed is not None and placed.host else {}),
        # A compressed exchange encodes each device's own shards.
        **({"param_specs": placed.specs} if placed is not None and backend.mesh_axes else {}),
        placement=placed,
    )
    # A lone worker has no one to send to: its mean over workers is local.
    per_round = round_bytes(params, method.compression, frozen) if num_workers > 1 else 0
    wire_per_round = method.round_wire_bytes(params, num_workers, frozen)
    if placed is not None and placed.outer is not None:  # the mean's norm, gathered per sync
        wire_per_round += outer_sharding.wire_bytes(method.num_syncs(params), num_workers)
    per_device = None
    if placed is not None and backend.mesh_axes:  # each device: the exchange of its shards
        shards = placement_lib.shard_shapes(params, placed)
        inner_shards = inner_state
        if worker_state is None:
            inner_shards = jax.eval_shape(inner.init, shards)
        device_round = method.round_wire_bytes(shards, num_workers, frozen, placed.specs)
        if placed.outer is not None:
            device_round += outer_sharding.wire_bytes(method.num_syncs(params), num_workers)
        per_device = (device_round, inner_shards)
    elif backend.data_parallel > 1:  # replicated inside a worker: every device sends it all
        per_device = (wire_per_round, inner_state)
    merge_per_round = 0.0
    if rules is not None:
        merge_per_round = model_state_lib.wire_bytes(model_state, rules, num_workers)
    faulty = method.weights.active

    def record(r: int, metrics: dict[str, np.ndarray]) -> Record:
        synced = state_sync_lib.wire_bytes(syncs, inner_state, num_workers, (r + 1) * inner_steps)
        device = {}
        if per_device is not None:
            steps = (r + 1) * inner_steps
            device_synced = state_sync_lib.wire_bytes(syncs, per_device[1], num_workers, steps)
            device = {"wire_bytes_per_device": round((r + 1) * per_device[0] + device_synced)}
        return (
            {"round": r, "steps": (r + 1) * inner_steps}
            | _step_record(metrics)
            | {
                "outer_grad_norm": float(metrics["outer_grad_norm"]),
                "bytes_communicated": (r + 1) * per_round,
                "wire_bytes": round((r + 1) * wire_per_round + synced),
            }
            | device
            | (
                {}
                if rules is None
                else {"model_state_wire_bytes": round((r + 1) * merge_per_round)}
            )
            | (_fault_record(metrics) if faulty else {})
        )

    fingerprint = {}
    if rules is not None:
        fingerprint["model_state_merge"] = list(rules)
    if step_options.get("params_of") is not None:
        fingerprint["worker_step"] = True
    loop = _Loop(
        backend=backend,
        total=num_rounds,
        lead=(num_workers, inner_steps),
        what="[num_workers, inner_steps]",
        eval_fn=run.eval_fn,
        eval_every=run.eval_every,
        eval_data=run.eval_data,
        steps_each=inner_steps,
        merge_rules=rules,
        placement=placed,
        process_local_data=_check_bool("process_local_data", run.process_local_data),
        callback=run.callback,
        checkpoints=_checkpoints(
            run.checkpoint_dir,
            run.checkpoint_every,
            run.keep_checkpoints,
            params,
            algorithm="diloco",
            num_workers=num_workers,
            inner_steps=inner_steps,
            **method.fingerprint(),
            **({} if run.rng_seed is None else {"rng_seed": run.rng_seed}),
            **({} if mask is None else {"trainable": list(mask.flags)}),
            **fingerprint,
        ),
    )
    state, history = loop.run(step, record, state, data)
    return _result(state, history, backend, rules)


def _backend(run: _RunOptions, num_workers: int) -> Backend:
    """The backend of a run's options (ValueError naming the placement option given without
    a mesh)."""
    on_mesh = isinstance(run.backend, Backend) and bool(run.backend.mesh_axes)
    if run.mesh is None and not on_mesh:
        for name in ("param_sharding", "batch_sharding"):
            if getattr(run, name) is not None:
                raise ValueError(f"{name} needs a mesh (mesh=jax.sharding.Mesh(...))")
        if run.worker_axis != "workers":
            raise ValueError("worker_axis needs a mesh (mesh=jax.sharding.Mesh(...))")
    if on_mesh and run.mesh is None and run.batch_sharding is not None:
        raise ValueError("batch_sharding with a built backend: give it to make_backend")
    if on_mesh and run.param_sharding is not None and run.backend.param_sharding is not None:
        raise ValueError(
            "param_sharding given twice: to train_diloco and to the backend's make_backend"
        )
    return make_backend(
        run.backend, num_workers, run.devices, run.data_parallel, mesh=run.mesh,
        worker_axis=run.worker_axis, batch_sharding=run.batch_sharding,
    )  # fmt: skip


def _placement(
    run: _RunOptions, backend: Backend, params: Any, method: DiLoCo | None, frozen: tuple
) -> Placement | None:
    """The state's shardings on a user's mesh, or with the outer state split over the
    workers (None with neither)."""
    # What each can't run with (a backend among it) the round refuses, when first traced.
    split = _check_bool("shard_outer_over_workers", run.shard_outer_over_workers)
    if split and backend.num_workers == 1:
        split = False  # one worker: nothing to split across
    host = offload.check_memory(run.outer_state_memory) == offload.HOST
    if not backend.mesh_axes and not split and not host:
        return None
    streaming = None if method is None else method.schedule
    return placement_lib.of_backend(
        backend, params, run.param_sharding, streaming, frozen, split_outer=split, host=host
    )


def _model_state_rules(model_state: Any, model_state_merge: Any) -> tuple[str, ...] | None:
    """The model state's merge rules (None without one), its leaves checked."""
    if model_state is not None:
        model_state_lib.check_model_state(model_state)
    return model_state_lib.merge_rules(model_state, model_state_merge)


def train_sync(
    loss_fn: LossFn,
    params: Any,
    data: Iterable[Any],
    *,
    num_steps: int,
    num_workers: int,
    optimizer: optax.GradientTransformation | None = None,
    method: DiLoCo | None = None,
    backend: "str | Backend" = "auto",
    devices: list[jax.Device] | None = None,
    eval_fn: Callable[..., dict[str, jax.Array]] | None = None,
    eval_every: int = 1,
    eval_data: Any = None,
    callback: Callable[[Record], None] | None = None,
    checkpoint_dir: "str | os.PathLike | None" = None,
    checkpoint_every: int = 1,
    keep_checkpoints: int = 3,
    data_parallel: int = 1,
    has_aux: bool = False,
    rng_seed: int | None = None,
    trainable: Any = None,
    model_state: Any = None,
    model_state_merge: Any = None,
    mesh: Mesh | None = None,
    worker_axis: str = "workers",
    param_sharding: Any = None,
    batch_sharding: P | None = None,
    process_local_data: bool = False,
) -> TrainResult:
    """Synchronous data parallelism: each step averages M workers' gradients, then one update.

    Args:
      data: iterable of steps; each a batch pytree with leaves [num_workers, ...]; or a
        `Sampler` (called with round = step index, step = 0). Rounds from
        `dj.worker_rounds` are refused (`dj.sync_steps` gives their examples as steps); rounds
        [M, H, B, ...] built by hand can't be told apart from steps and would train one step
        per round on H x B examples each.
      num_steps: >= 0. num_workers: M >= 1. optimizer: default as DiLoCo's inner AdamW.
      method: or a `DiLoCo` spec whose `inner` is the optimizer (so a DiLoCo run and its
        baseline share one value); its other parts don't apply to data parallelism and are
        refused. Not both `optimizer` and `method`.
      rng_seed: worker m's key at step s is fold_in(fold_in(PRNGKey(rng_seed), s), m).
      trainable: frozen leaves get zero updates (their gradients are still averaged).
      model_state: as in `train_diloco`, each worker's copy merged after every step.
      mesh, worker_axis, param_sharding, batch_sharding: as in `train_diloco`: each
        worker's gradients are computed on its devices, the params and optimizer state sit
        at the params' specs; history adds "wire_bytes_per_device".
      The rest as in `train_diloco` (checkpoints count steps instead of rounds; `eval_every`
      counts steps, as it does for every trainer).

    Returns:
      TrainResult(params, state: SyncState, history, model_state). history[s] has "step" (0-based),
      "steps" (s + 1), "loss", "worker_loss" ([M]), "bytes_communicated" (cumulative bytes
      each worker contributes: size x itemsize of every averaged gradient leaf; 0 when
      M = 1) and "wire_bytes" (cumulative bytes it sends on the wire: the ring all-reduce
      of the gradients and the loss, `comm.sync_step_wire_bytes`); with `has_aux`, each aux
      metric and its "worker_" list.
    """
    check_loss_options(has_aux, rng_seed)
    _check_int("num_steps", num_steps, 0)
    _check_int("num_workers", num_workers, 1)
    _check_int("eval_every", eval_every, 1)
    _check_params(params)
    if isinstance(data, Rounds):
        raise ValueError(
            "train_sync: data holds DiLoCo rounds from dj.worker_rounds (leaves [M, H, B, ...], "
            "one item per round); train_sync takes one item per step (leaves [M, B, ...]): pass "
            "dj.sync_steps(...) with the same arguments"
        )
    if method is not None:
        if optimizer is not None:
            raise ValueError("train_sync: give either optimizer= or method=, not both")
        method = method_from_options(method, {}, caller="train_sync")
        only_optimizers(method, "train_sync", "data parallelism has no outer step")
        if method.outer is not None:
            raise ValueError(
                "train_sync takes DiLoCo.inner only (data parallelism has no outer step)"
            )
        optimizer = method.inner
    optimizer = _optimizer("optimizer", optimizer, default_inner_optimizer)
    frozen = trainable_lib.frozen_leaves(params, trainable)
    optimizer = trainable_lib.masked_optimizer(optimizer, params, frozen)
    run = _RunOptions.of(locals())
    backend = _check_processes(_backend(run, num_workers))
    placed = _placement(run, backend, params, None, ())
    rules = _model_state_rules(model_state, model_state_merge)

    state = init_sync_state(params, optimizer, model_state, num_workers)
    step = _jitted(
        sync_step,
        loss_fn,
        backend,
        optimizer=optimizer,
        num_workers=num_workers,
        **({"has_aux": True} if has_aux else {}),
        **({"rng_seed": rng_seed} if rng_seed is not None else {}),
        **({} if rules is None else {"model_state_merge": model_state_lib.Resolved(rules)}),
        placement=placed,
    )
    per_step = payload_bytes(params) if num_workers > 1 else 0
    wire_per_step = sync_step_wire_bytes(params, num_workers)
    per_device = None
    if placed is not None:
        per_device = sync_step_wire_bytes(placement_lib.shard_shapes(params, placed), num_workers)
    elif backend.data_parallel > 1:
        per_device = wire_per_step
    merge_per_step = 0.0
    if rules is not None:
        merge_per_step = model_state_lib.wire_bytes(model_state, rules, num_workers)

    def record(s: int, metrics: dict[str, np.ndarray]) -> Record:
        return (
            {"step": s, "steps": s + 1}
            | _step_record(metrics)
            | {
                "bytes_communicated": (s + 1) * per_step,
                "wire_bytes": round((s + 1) * wire_per_step),
            }
            | ({} if per_device is None else {"wire_bytes_per_device": round((s + 1) * per_device)})
            | ({} if rules is None else {"model_state_wire_bytes": round((s + 1) * merge_per_step)})
        )

    loop = _Loop(
        backend=backend,
        total=num_steps,
        lead=(num_workers,),
        what="[num_workers]",
        eval_fn=eval_fn,
        eval_every=eval_every,
        eval_data=eval_data,
        merge_rules=rules,
        placement=placed,
        process_local_data=_check_bool("process_local_data", process_local_data),
        callback=callback,
        checkpoints=_checkpoints(
            checkpoint_dir,
            checkpoint_every,
            keep_checkpoints,
            params,
            algorithm="sync",
            num_workers=num_workers,
            **({} if rng_seed is None else {"rng_seed": rng_seed}),
            **({} if rules is None else {"model_state_merge": list(rules)}),
        ),
    )
    state, history = loop.run(step, record, state, data)
    return _result(state, history, backend, rules)


def _result(state: Any, history: list[Record], backend: Backend, rules=None) -> TrainResult:
    """The final result, as the run's arrays: in a multi-process run, global arrays (each
    process holds its shards; `distributed.to_host` copies them whole to every host, a
    collective, when the caller wants that); on a user's mesh, on that mesh
    (`Backend.on_user_mesh`). Under eager updates the params are the mean of the workers'
    own; the model state is the merged one (`model_state.merged_view`)."""
    params = state.params if state.params is not None else jax.jit(delay.global_params)(state)
    params = offload.in_device_memory(params)
    model_state = None
    if rules is not None:
        model_state = model_state_lib.merged_view(state.model_state, rules)
    return TrainResult(*backend.on_user_mesh((params, state)), history,
                       backend.on_user_mesh(model_state))  # fmt: skip


def _check_processes(backend: Backend) -> Backend:
    """In a multi-process run: "shard_map" over devices of every process, or "vmap" run whole
    on each process's own device; "pmap" is refused."""
    if not is_multiprocess():
        return backend
    if backend.name == "vmap":
        # Nothing to split over processes: every process runs all M workers, redundantly and
        # identically, on its own first device (e.g. the CLI's 1-worker warm start).
        return Backend("vmap", backend.num_workers, tuple(jax.local_devices()[:1]))
    if backend.name != "shard_map":
        raise ValueError(
            f"a run over {jax.process_count()} processes needs backend='shard_map' (workers "
            f"over the global device mesh), got {backend.name!r}"
        )
    spanned = {d.process_index for d in backend.devices}
    if spanned != set(range(jax.process_count())):
        raise ValueError(
            f"num_workers={backend.num_workers} uses devices of processes {sorted(spanned)} "
            f"only; every one of the {jax.process_count()} processes needs at least one: use "
            f"at least {len(jax.devices())} workers (a multiple of it)"
        )
    return backend


def _step_record(metrics: dict[str, np.ndarray]) -> Record:
    """The per-step means of a round or step's metrics: "loss", "worker_loss" ([M]) and each
    aux metric's pair, in the order the round returned them."""
    out = {}
    for name in metrics:
        if "worker_" + name in metrics:
            out[name] = float(metrics[name])
            out["worker_" + name] = [float(x) for x in metrics["worker_" + name]]
    return out


def _fault_record(metrics: dict[str, np.ndarray]) -> Record:
    return {
        "excluded_workers": [int(m) for m in np.flatnonzero(metrics["excluded_workers"])],
        "dropped_workers": [int(m) for m in np.flatnonzero(metrics["dropped_workers"])],
        "skipped": bool(metrics["skipped"]),
    }


def _place_state(state: Any, backend: Backend) -> Any:
    """Puts a DiLoCoState / SyncState on the backend's devices (under eager updates, with no
    global params, the outer states are per worker too)."""
    per_worker = placement_lib.per_worker_fields(state)
    return type(state)(
        **{
            name: place_global(
                backend.place_workers if name in per_worker else backend.place_shared, value
            )
            for name, value in state._asdict().items()
        }
    )


@dataclasses.dataclass(frozen=True)
class _Checkpoints:
    directory: str
    every: int
    keep: int
    fingerprint: dict[str, Any]


def _checkpoints(directory, every, keep, params, **fields) -> _Checkpoints | None:
    _check_int("checkpoint_every", every, 1)
    _check_int("keep_checkpoints", keep, 1)
    if directory is None:
        return None
    if not isinstance(directory, str | os.PathLike):
        raise ValueError(f"checkpoint_dir must be a path, got {directory!r}")
    checkpoint.prepare(directory)
    return _Checkpoints(os.fspath(directory), every, keep, checkpoint.fingerprint(params, **fields))


@dataclasses.dataclass(frozen=True)
class _Loop:
    """The host loop shared by both trainers."""

    backend: Backend
    total: int
    lead: tuple[int, ...]
    what: str
    eval_fn: Callable | None
    eval_every: int
    callback: Callable[[Record], None] | None
    checkpoints: _Checkpoints | None
    eval_data: Any = None
    steps_each: int = 1  # inner steps per worker in one iteration (H for a DiLoCo round)
    merge_rules: tuple[str, ...] | None = None
    placement: "Placement | None" = None  # the state's shardings on a user's mesh
    process_local_data: bool = False  # each process's data holds only its own workers

    def due(self, done: int) -> bool:
        """Whether to evaluate after iteration `done` (1-based): the first iteration end at
        or past each multiple of `eval_every` inner steps, and the last."""
        step = self.steps_each
        return (
            done == self.total
            or (done * step) // self.eval_every > ((done - 1) * step) // self.eval_every
        )

    def evaluator(self) -> Callable[[Any, Any], Any] | None:
        """state, eval data -> eval_fn's dict, jitted: of θ (under eager updates, of the
        workers' mean), with the merged model state and the eval data when they exist."""
        if self.eval_fn is None:
            return None
        rules, with_data = self.merge_rules, self.eval_data is not None

        def evaluate(state, eval_data):
            params = delay.global_params(state) if hasattr(state, "round") else state.params
            if self.placement is not None and self.placement.host:
                params = offload.fetch(params)
            args = [params]
            if rules is not None:
                args.append(model_state_lib.merged_view(state.model_state, rules))
            if with_data:
                args.append(eval_data)
            return self.eval_fn(*args)

        return jax.jit(evaluate)

    def run(self, step, record, state, data) -> tuple[Any, list[Record]]:
        """Resumes from the latest checkpoint if any, then dispatches iteration i + 1 before
        pulling iteration i's metrics, so the host never stalls the device. The state is
        donated to each dispatch (it is the library's own, never the caller's)."""
        if self.placement is not None:
            state = jax.device_put(state, self.placement.shardings(state))
        else:
            state = _place_state(state, self.backend)
        state, history = self._resume(state)
        evaluate = self.evaluator()
        eval_data = None
        if evaluate is not None and self.eval_data is not None:
            eval_data = place_global(self.backend.place_shared, self.eval_data)
        pending = None

        def finish(i, metrics, evals):
            entry = record(i, to_host(metrics))
            if evals is not None:
                entry.update({k: float(v) for k, v in to_host(evals).items()})
            history.append(entry)
            if self.callback is not None:
                self.callback(entry)

        batches = _placed(
            data, self.total, self.lead, self.what, self.backend, len(history),
            self.process_local_data,
        )  # fmt: skip
        ckpt = self.checkpoints
        # Written in the background: the loop goes on while a checkpoint's files are written.
        saver = None if ckpt is None else checkpoint.Saver(ckpt.directory, keep=ckpt.keep)
        try:
            for i, batch in enumerate(batches, start=len(history)):
                state, metrics = step(state, batch)
                done = i + 1
                last = done == self.total
                evals = evaluate(state, eval_data) if evaluate and self.due(done) else None
                if pending is not None:
                    finish(*pending)
                pending = (i, metrics, evals)
                if ckpt is not None and (done % ckpt.every == 0 or last):
                    finish(*pending)
                    pending = None
                    saver.save(
                        done,
                        self._global(state),
                        {**ckpt.fingerprint, "data_position": done, "history": history},
                    )
        finally:
            if saver is not None:
                saver.close()
        if pending is not None:
            finish(*pending)
        return state, history

    def _global(self, state: Any) -> Any:
        """The state as Orbax can save it: a multi-process "vmap" run's per-process copies
        (identical on every process) become global arrays replicated over all devices."""
        if not (is_multiprocess() and self.backend.name == "vmap"):
            return state
        everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("all",)), P())
        return jax.device_put(to_host(state), everywhere)

    def _local(self, state: Any) -> Any:
        """Inverse of `_global`: back onto this process's own device."""
        if not (is_multiprocess() and self.backend.name == "vmap"):
            return state
        return jax.device_put(to_host(state), self.backend.devices[0])

    def _resume(self, state) -> tuple[Any, list[Record]]:
        ckpt = self.checkpoints
        restored = (
            None
            if ckpt is None
            else checkpoint.restore(ckpt.directory, self._global(state), ckpt.fingerprint)
        )
        if restored is None:
            return state, []
        state, metadata, step = restored
        state = self._local(state)
        checkpoint.discard_after(ckpt.directory, step)  # damaged newer ones restore skipped
        if metadata["data_position"] > self.total:
            raise ValueError(
                f"checkpoint_dir {ckpt.directory} holds {metadata['data_position']} completed "
                f"iterations, more than the {self.total} asked for"
            )
        return state, list(metadata["history"])


@functools.lru_cache(maxsize=64)
def _cached_jit(fn, loss_fn, backend, options, placement=None):
    step = functools.partial(fn, loss_fn, backend=backend, **dict(options))
    kept = ()
    if fn is diloco_round:
        kept = donation.kept_fields(dict(options)["method"], donation.platform_of(backend))
    if placement is not None and placement.host:
        return _HostKept(step, placement, kept)
    if placement is not None:
        step = functools.partial(placement_lib.kept_in_place, step, placement)
    return donation.jit_donating(step, kept)


class _HostKept:
    """`jax.jit(step)` with θ and the outer state returned to host memory: out_shardings at
    the placement's (built at the first call, from the state's shapes). A constraint inside
    the program keeps no memory kind, and a device_put there fuses apart and rounds the
    update differently from the on-device run; out_shardings does neither."""

    def __init__(self, step, placement: Placement, kept: tuple[str, ...]):
        self.step, self.placement, self.kept, self.jitted = step, placement, kept, None

    def __call__(self, state, batch):
        if self.jitted is None:
            new_state, _ = jax.eval_shape(self.step, state, batch)
            out = (self.placement.shardings(new_state), None)
            self.jitted = donation.jit_donating(self.step, self.kept, out_shardings=out)
        return self.jitted(state, batch)


def _jitted(fn, loss_fn, backend: Backend, placement: "Placement | None" = None, **options):
    """The jitted step, donating its state; cached so repeated runs reuse the compilation."""
    key = tuple(sorted(options.items()))
    try:
        return _cached_jit(fn, loss_fn, backend, key, placement)
    except TypeError:  # an unhashable loss_fn or optimizer: compile without the cache
        return _cached_jit.__wrapped__(fn, loss_fn, backend, key, placement)


def _placed(
    data: Any,
    count: int,
    lead: tuple[int, ...],
    what: str,
    backend: Backend,
    skip: int = 0,
    local: bool = False,
):
    """Inputs for iterations skip..count-1 on the backend's devices: a Sampler's arrays once
    (`place_sampler`; it is keyed by the state's counter), or each host batch split along
    workers (the first `skip` items, already trained on, are read and dropped). `local`:
    each item (a Sampler's `worker_arrays`) holds this process's workers only
    (`process_local_data`)."""
    if isinstance(data, Sampler):
        return itertools.repeat(sampler_lib.place_sampler(data, backend, local), count - skip)
    if local:
        lead = (backend.local_workers(), *lead[1:])
        what = what.replace("[num_workers", "[this process's workers")
    if callable(data):  # start -> the items from there on: nothing skipped is drawn
        batches = _batches(data(skip), count - skip, lead, what)
    else:
        batches = itertools.islice(_batches(data, count, lead, what), skip, None)
    if local:
        return (backend.assemble_batches(b, len(lead)) for b in batches)
    place = functools.partial(backend.place_batches, lead=len(lead))
    return (place_global(place, b) for b in batches)


def _batches(data: Iterable[Any], count: int, lead: tuple[int, ...], what: str) -> Iterator[Any]:
    """Yields `count` items of `data`, each checked to have leaves with leading dims `lead`."""
    if count == 0:
        return
    try:
        items = iter(data)
    except TypeError:
        raise ValueError(
            f"data must be an iterable of batches, got {type(data).__name__}"
        ) from None
    done = 0
    for batch in itertools.islice(items, count):
        leaves = jax.tree.leaves(batch)
        if not leaves:
            raise ValueError(f"data item {done} has no arrays")
        for leaf in leaves:
            shape = tuple(np.shape(leaf))
            if shape[: len(lead)] != lead:
                raise ValueError(
                    f"data item {done}: every leaf must have leading dims {what} = {lead}, "
                    f"got shape {shape}"
                )
        yield batch
        done += 1
    if done < count:
        raise ValueError(f"data ran out after {done} items; {count} were asked for")


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_params(params: Any) -> None:
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if not leaves:
        raise ValueError("params must be a pytree with at least one array leaf")
    for path, leaf in leaves:
        dtype = np.dtype(jnp.result_type(leaf))
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"params leaves must be floating point, got a {dtype} leaf")
        # JAX computes a float64 array as float32 unless x64 is on: the result would come
        # back in another dtype than the params went in.
        given = getattr(leaf, "dtype", None)
        if given is not None and np.dtype(given) != dtype:
            raise ValueError(
                f"params{jax.tree_util.keystr(path)} is {np.dtype(given)}, which JAX runs as "
                f"{dtype} while 64-bit mode is off: the run would train and return {dtype}; "
                f"cast it to {dtype}, or call jax.config.update('jax_enable_x64', True) first"
            )


def _optimizer(name: str, optimizer, default) -> optax.GradientTransformation:
    if optimizer is None:
        return default()
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise ValueError(f"{name} must be an optax GradientTransformation, got {optimizer!r}")
    return optimizer

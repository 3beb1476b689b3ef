"""The host loops: `train_diloco` (rounds of DiLoCo) and `train_sync` (the data-parallel
baseline). They validate inputs at the boundary, place state on the backend's devices, run
one compiled dispatch per round (or step), and record one history dict per round."""

import functools
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from diloco_jax import checkpoint, delay, donation, limits, offload
from diloco_jax import model_state as model_state_lib
from diloco_jax import placement as placement_lib
from diloco_jax import trainable as trainable_lib
from diloco_jax.checks import check_bool, check_int, check_params, checked_optimizer
from diloco_jax.comm import (
    Bill,
    merge_wire_bytes,
    payload_bytes,
    round_bytes,
    split_outer_wire_bytes,
    sync_step_wire_bytes,
)
from diloco_jax.distributed import is_multiprocess
from diloco_jax.inner import LossFn, StepInfo, check_loss_options
from diloco_jax.layout import Rounds
from diloco_jax.loop import Loop, Record, Steps, checkpoints, jitted, place_state, step_record
from diloco_jax.method import DiLoCo, default_inner_optimizer, method_from_options, only_optimizers
from diloco_jax.placement import Placement
from diloco_jax.round import diloco_round, init_state
from diloco_jax.sync import init_sync_state, sync_step
from diloco_jax.workers import Backend, make_backend


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
    checkpoint_fingerprint: dict[str, Any] | None = None,
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
    unroll_inner_steps: bool = False,
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
      backend: "auto" | "vmap" | "sequential" | "shard_map" | "pmap" (see
        `diloco_jax.workers`; "auto" on one device: "sequential" on a CPU, else "vmap").
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
      unroll_inner_steps: the H inner steps compiled as straight-line code, not one loop:
        the same arithmetic up to float rounding, a longer compile. For a CNN on a CPU with
        a small H (XLA's CPU backend runs a convolution's gradient many times slower inside
        a loop; docs/devices.md). Not part of a checkpoint's identity.
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
        which have no stable form) is a ValueError. The directory is the run's alone while it
        runs: a second run into it is a `run_lock.FolderInUse` (a ValueError) at once.
      checkpoint_fingerprint: a JSON-able dict describing what else makes the run (e.g. the
        learning rates or config its loss_fn and optimizers were built from), saved in every
        checkpoint (as "run") and compared on resume like the rest.

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
    checkpoint_fingerprint: dict[str, Any] | None = None,
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
    unroll_inner_steps: bool = False,
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
    checkpoint_fingerprint: Any
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
    unroll_inner_steps: bool = False  # train_sync has no inner loop

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
    check_int("num_rounds", num_rounds, 0)
    check_int("num_workers", num_workers, 1)
    check_int("inner_steps", inner_steps, 1)
    check_int("eval_every", run.eval_every, 1)
    unroll = check_bool("unroll_inner_steps", run.unroll_inner_steps)
    limits.check_steps("num_rounds x inner_steps", num_rounds, inner_steps)
    check_params(params)
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
    method.check_run(params, num_workers, inner_steps, frozen, inner_state)
    placed = _placement(run, backend, params, method, frozen)
    rules = _model_state_rules(model_state, model_state_merge)
    if rules is not None:
        step_options["model_state_merge"] = model_state_lib.Resolved(rules)
    # Before the state is built: the data holds these workers, the devices hold their state.
    if not run.process_local_data:
        limits.check_first_item(data, (num_workers, inner_steps), "[num_workers, inner_steps]")
    init = functools.partial(init_state, num_workers=num_workers, method=method, trainable=mask)
    state = _built_state(init, params, model_state, worker_state, placed, backend, num_workers)
    step = _round_step(fn, backend, method, num_workers, inner_steps, has_aux, run, mask,
                       step_options, placed, unroll)  # fmt: skip
    inner_like = None if worker_state is None else inner_state
    bill = _diloco_bill(method, params, frozen, backend, placed, inner_like, rules, model_state,
                        inner_steps)  # fmt: skip
    faulty = method.weights.active

    def record(r: int, metrics: dict[str, np.ndarray]) -> Record:
        return (
            {"round": r, "steps": (r + 1) * inner_steps}
            | step_record(metrics)
            | {"outer_grad_norm": float(metrics["outer_grad_norm"])}
            | bill.entries(r + 1)
            | (_fault_record(metrics) if faulty else {})
        )

    rounds = Steps(
        step=step,
        record_metrics=record,
        backend=backend,
        data=data,
        total=num_rounds,
        lead=(num_workers, inner_steps),
        what="[num_workers, inner_steps]",
        eval_fn=run.eval_fn,
        eval_every=run.eval_every,
        eval_data=run.eval_data,
        steps_each=inner_steps,
        merge_rules=rules,
        placement=placed,
        process_local_data=check_bool("process_local_data", run.process_local_data),
    )
    ckpt = _diloco_checkpoints(run, params, method, num_workers, inner_steps, mask, rules,
                               worker_step="params_of" in step_options)  # fmt: skip
    loop = Loop(total=num_rounds, checkpoints=ckpt, callback=run.callback)
    state, history = loop.run(rounds, place_state(state, backend, placed))
    _warn_if_all_excluded(history, num_workers)
    return _result(state, history, backend, rules)


def _built_state(init, params, model_state, worker_state, placed, backend, num_workers):
    """`init`'s state of the run, refused (naming num_workers) unless it fits the devices;
    on a placement, built in place: no device ever holds more than its shards."""
    shapes = jax.eval_shape(lambda p: init(p, model_state=model_state, worker_state=worker_state),
                            params)  # fmt: skip
    limits.check_fits(f"num_workers={num_workers}", limits.nbytes(shapes), backend.devices)
    if placed is None:
        return init(params, model_state=model_state, worker_state=worker_state)
    return placement_lib.build_in_place(init, placed, params, model_state, worker_state)


def _check_sync_data(data: Any, num_workers: int, process_local_data: bool) -> None:
    """ValueError unless `data` is train_sync's: one item a step, leaves [M, B, ...] (checked
    on its first item, before anything is built for it, where this process holds them all)."""
    if isinstance(data, Rounds):
        raise ValueError(
            "train_sync: data holds DiLoCo rounds from dj.worker_rounds (leaves [M, H, B, ...], "
            "one item per round); train_sync takes one item per step (leaves [M, B, ...]): pass "
            "dj.sync_steps(...) with the same arguments"
        )
    if not process_local_data:
        limits.check_first_item(data, (num_workers,), "[num_workers]")


def _round_step(fn, backend, method, num_workers, inner_steps, has_aux, run, mask, step_options,
                placed, unroll) -> Callable:  # fmt: skip
    """The jitted round of `train_diloco`'s loop (`diloco_round` on the backend, the state's
    fields the method keeps donated), every option stated once here."""
    return jitted(
        diloco_round,
        fn,
        backend,
        kept=donation.kept_fields(method, donation.platform_of(backend)),
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
        **({"unroll_inner_steps": True} if unroll else {}),
        placement=placed,
    )


def _diloco_checkpoints(run, params, method, num_workers, inner_steps, mask, rules,
                        worker_step: bool):  # fmt: skip
    """The run's `Checkpoints` (None without a checkpoint_dir), its fingerprint the method's,
    the run's sizes and what else makes the run another (the key, frozen leaves, merge rules,
    a user's worker step)."""
    return checkpoints(
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
        **({} if rules is None else {"model_state_merge": list(rules)}),
        **({"worker_step": True} if worker_step else {}),
        **checkpoint.run_fields(run.checkpoint_fingerprint),
    )


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
    split = check_bool("shard_outer_over_workers", run.shard_outer_over_workers)
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
    checkpoint_fingerprint: dict[str, Any] | None = None,
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
    check_int("num_steps", num_steps, 0)
    check_int("num_workers", num_workers, 1)
    check_int("eval_every", eval_every, 1)
    _check_sync_data(data, num_workers, process_local_data)
    check_params(params)
    optimizer = _sync_optimizer(optimizer, method, params, trainable)
    run = _RunOptions.of(locals())
    backend = _check_processes(_backend(run, num_workers))
    placed = _placement(run, backend, params, None, ())
    rules = _model_state_rules(model_state, model_state_merge)

    state = init_sync_state(params, optimizer, model_state, num_workers)
    step = jitted(
        sync_step, loss_fn, backend, optimizer=optimizer, num_workers=num_workers,
        **({"has_aux": True} if has_aux else {}),
        **({"rng_seed": rng_seed} if rng_seed is not None else {}),
        **({} if rules is None else {"model_state_merge": model_state_lib.Resolved(rules)}),
        placement=placed,
    )  # fmt: skip
    bill = _sync_bill(params, placed, backend, num_workers, model_state, rules)

    def record(s: int, metrics: dict[str, np.ndarray]) -> Record:
        return {"step": s, "steps": s + 1} | step_record(metrics) | bill.entries(s + 1)

    rounds = Steps(
        step=step,
        record_metrics=record,
        backend=backend,
        data=data,
        total=num_steps,
        lead=(num_workers,),
        what="[num_workers]",
        eval_fn=eval_fn,
        eval_every=eval_every,
        eval_data=eval_data,
        merge_rules=rules,
        placement=placed,
        process_local_data=check_bool("process_local_data", process_local_data),
    )
    ckpt = checkpoints(
        checkpoint_dir, checkpoint_every, keep_checkpoints, params, algorithm="sync",
        num_workers=num_workers, **({} if rng_seed is None else {"rng_seed": rng_seed}),
        **({} if rules is None else {"model_state_merge": list(rules)}),
        **checkpoint.run_fields(checkpoint_fingerprint),
    )  # fmt: skip
    loop = Loop(num_steps, ckpt, callback, unit="steps", total_name="num_steps")
    state, history = loop.run(rounds, place_state(state, backend, placed))
    return _result(state, history, backend, rules)


def _sync_optimizer(optimizer, method, params, trainable) -> optax.GradientTransformation:
    """train_sync's optimizer: `optimizer`, or a `method`'s inner one (refusing both, and a
    method with an outer rule or other parts), or the default inner optimizer; masked to
    leave `trainable`'s frozen leaves of `params` alone."""
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
    optimizer = checked_optimizer("optimizer", optimizer, default_inner_optimizer)
    frozen = trainable_lib.frozen_leaves(params, trainable)
    return trainable_lib.masked_optimizer(optimizer, params, frozen)


def _sync_bill(params, placed, backend, num_workers, model_state, rules) -> Bill:
    """What each step of train_sync sends: the gradients' all-reduce (per device too, on a
    mesh or with data parallelism) and the model state's merge."""
    per_device = None
    if placed is not None:
        per_device = sync_step_wire_bytes(placement_lib.shard_shapes(params, placed), num_workers)
    elif backend.data_parallel > 1:
        per_device = sync_step_wire_bytes(params, num_workers)
    return Bill(
        payload_bytes(params) if num_workers > 1 else 0,
        sync_step_wire_bytes(params, num_workers),
        per_device,
        merge=merge_wire_bytes(model_state, rules, num_workers),
        num_workers=num_workers,
    )


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


def _diloco_bill(
    method, params, frozen, backend, placed, worker_state, rules, model_state, inner_steps
) -> Bill:  # fmt: skip
    """What a DiLoCo round sends (`comm.Bill`). `worker_state`: one worker's state (shapes)
    under a worker step, None for the inner optimizer's."""
    num_workers = backend.num_workers
    inner = trainable_lib.masked_optimizer(method.inner_optimizer, params, frozen)
    own_state = worker_state is not None  # a worker step's state, not the inner optimizer's
    inner_state = worker_state if own_state else jax.eval_shape(inner.init, params)
    # A lone worker has no one to send to: its mean over workers is local.
    payload = (
        round_bytes(params, method.compression, frozen, method.gossip) if num_workers > 1 else 0
    )
    split = placed is not None and placed.outer is not None  # the mean's norm, per sync
    extra = split_outer_wire_bytes(method.num_syncs(params), num_workers) if split else 0.0
    wire = method.round_wire_bytes(params, num_workers, frozen)
    if split:
        wire += extra
    device, device_inner = None, None
    if placed is not None and backend.mesh_axes:  # each device: the exchange of its shards
        shards = placement_lib.shard_shapes(params, placed)
        device_inner = (
            inner_state if worker_state is not None else jax.eval_shape(inner.init, shards)
        )
        device = method.round_wire_bytes(shards, num_workers, frozen, placed.specs)
        if split:
            device += extra
    elif backend.data_parallel > 1:  # replicated inside a worker: every device sends it all
        device, device_inner = wire, inner_state
    merge = merge_wire_bytes(model_state, rules, num_workers)
    on_schedule = (method.parts, inner_state, device_inner)
    return Bill(
        payload=payload,
        wire=wire,
        device=device,
        on_schedule=on_schedule,
        merge=merge,
        num_workers=num_workers,
        steps_each=inner_steps,
    )


def _check_processes(backend: Backend) -> Backend:
    """The backend as a multi-process run runs it (`Backend.for_processes`)."""
    return backend.for_processes() if is_multiprocess() else backend


def _warn_if_all_excluded(history: list[Record], num_workers: int) -> None:
    """One RuntimeWarning saying in how many rounds every worker was left out of the mean
    (a non-finite or outlier delta), so θ did not move in them (a round otherwise reads
    like any other)."""
    excluded = [h["round"] for h in history if len(h.get("excluded_workers", ())) == num_workers]
    if excluded:
        warnings.warn(
            f"every worker was excluded (a non-finite or outlier delta) in {len(excluded)} of "
            f"{len(history)} rounds (the first: round {excluded[0]}); the params did not change "
            "in those rounds",
            RuntimeWarning,
            stacklevel=3,
        )


def _fault_record(metrics: dict[str, np.ndarray]) -> Record:
    return {
        "excluded_workers": [int(m) for m in np.flatnonzero(metrics["excluded_workers"])],
        "dropped_workers": [int(m) for m in np.flatnonzero(metrics["dropped_workers"])],
        "skipped": bool(metrics["skipped"]),
    }

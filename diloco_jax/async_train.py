"""Asynchronous DiLoCo (Liu et al. 2024, arXiv 2401.09135): workers of different speeds send
their deltas whenever they finish, and a server applies each one as it arrives.

A deterministic event simulation on one simulated clock:

- worker m takes `step_seconds[m]` simulated seconds per inner step and h_m steps per job:
  H, or with dynamic local updates (DyLU) floor(H v_m / max v), v = 1 / step_seconds (at
  least 1), so every worker's job takes about as long as the fastest worker's H steps;
- the server applies each finished job's delta, theta_start - theta_m (against the theta
  that worker started from, in the widened delta dtype of `diloco_jax.outer`), with the outer
  optimizer, in completion order (ties by worker index);
- the worker restarts from the current theta at once; with `grace_seconds` > 0 the server
  waits that long after a window's first arrival: every job finishing inside the window is
  applied before any of them restarts, and they all restart when the window closes. Jobs
  that finish at exactly the same instant always share a window.

The schedule depends only on the step times, so `async_schedule` computes it up front in
plain Python; `train_async` then runs each job as one compiled program (one per job length,
a `lax.scan` of h_m inner steps) and each outer update as another, in schedule order.
A job is computed when the server applies it, from the theta it started from (kept until
then), so a worker's inner optimizer state passes from job to job in order and jobs still
running when training stops are never computed. A checkpoint after u updates holds theta,
the outer state, every worker's inner state and the theta each worker's running job started
from; the schedule itself is recomputed on resume (its first u events don't depend on how
many follow).
"""

import collections
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from diloco_jax import checkpoint, limits
from diloco_jax import sampler as sampler_lib
from diloco_jax import trainable as trainable_lib
from diloco_jax.arrival_rule import ArrivalRule, age, checked_step_seconds, dynamic_local_steps
from diloco_jax.async_placement import OneDevice, OnMesh
from diloco_jax.checks import check_int, check_params, checked_optimizer
from diloco_jax.comm import round_bytes
from diloco_jax.distributed import is_multiprocess, to_host
from diloco_jax.heloco_outer import job_start
from diloco_jax.inner import LossFn, check_loss_options, inner_loop, worker_key
from diloco_jax.loop import Loop, checkpoints
from diloco_jax.method import (
    DiLoCo,
    default_inner_optimizer,
    default_outer_optimizer,
    method_from_options,
    only_optimizers,
)
from diloco_jax.outer import outer_init, outer_update, worker_delta
from diloco_jax.placement import resolve_param_specs
from diloco_jax.sampler import Sampler
from diloco_jax.workers import WORKER_AXIS, in_mesh_context, make_backend

Record = dict[str, Any]


class AsyncEvent(NamedTuple):
    """One server update of the simulation.

    update: its index (0-based). worker, job: whose job it applies, and which of that
    worker's jobs (0-based). steps: the job's inner steps. start, time: simulated seconds
    when the job started and when it arrived (the server applies it then). start_update:
    server updates applied before the job started (it started from theta after that many).
    staleness: update - start_update, the server updates applied while it ran.
    """

    update: int
    worker: int
    job: int
    steps: int
    start: float
    time: float
    start_update: int
    staleness: int


class AsyncSchedule(NamedTuple):
    """events: the server updates in order. elapsed_seconds: the simulated time of the last
    one (0 with none). utilization: busy worker-seconds / (M x elapsed_seconds), 0 with no
    updates; a worker is busy while it runs a job (jobs still running at the end count up to
    elapsed_seconds) and idle while it waits for its grace window to close."""

    events: tuple[AsyncEvent, ...]
    elapsed_seconds: float
    utilization: float


class AsyncState(NamedTuple):
    """params: theta. outer_opt_state: the outer optimizer's state (delta dtype).
    inner_opt_state: each worker's inner optimizer state, leaves stacked [M, ...].
    update: server updates applied."""

    params: Any
    outer_opt_state: Any
    inner_opt_state: Any
    update: int


class _AsyncCheckpoint(NamedTuple):
    """What a checkpoint after u updates saves: AsyncState's arrays and, per worker, the
    theta its running job started from (leaves [M, ...]; theta for a worker with no job
    left to apply)."""

    params: Any
    outer_opt_state: Any
    inner_opt_state: Any
    job_starts: Any


class AsyncResult(NamedTuple):
    """params: final theta; state: AsyncState; history: one dict per server update;
    elapsed_seconds and utilization: as in `AsyncSchedule`."""

    params: Any
    state: AsyncState
    history: list[Record]
    elapsed_seconds: float
    utilization: float


def async_schedule(
    step_seconds: Sequence[float],
    inner_steps: int,
    num_updates: int,
    *,
    grace_seconds: float = 0.0,
    dynamic_steps: bool = False,
) -> AsyncSchedule:
    """The event order of `train_async` (see the module docstring), in plain Python.

    Args:
      step_seconds: M positive finite floats, worker m's simulated seconds per inner step.
      inner_steps: H >= 1. num_updates: server updates to simulate, >= 0.
      grace_seconds: >= 0; 0 restarts each worker at its arrival (exact ties share a window).
      dynamic_steps: DyLU step counts (`dynamic_local_steps`) instead of H for every worker.

    Returns:
      AsyncSchedule(events, elapsed_seconds, utilization). Raises ValueError naming a bad
      argument.
    """
    seconds = checked_step_seconds(step_seconds)
    check_int("inner_steps", inner_steps, 1)
    check_int("num_updates", num_updates, 0)
    grace = _checked_grace(grace_seconds)
    num_workers, serials = len(seconds), itertools.count()
    rule = ArrivalRule(inner_steps, dynamic_steps)
    for m, s in enumerate(seconds):  # the clock knows each worker's speed from the start
        rule.timed(m, s)
    for m in range(num_workers):
        rule.hand_out(m, next(serials), 0, 0, 0.0)
    finish = {m: job.steps * seconds[m] for m, job in rule.jobs.items()}
    spans = []  # (start, finish) of every job that was applied or is still running
    events: list[AsyncEvent] = []
    while len(events) < num_updates:
        close = min(finish.values()) + grace
        window = sorted((at, m) for m, at in finish.items() if at <= close)
        taken = []
        for at, m in window[: num_updates - len(events)]:
            job = rule.take(m, rule.jobs[m].serial)
            update = len(events)
            events.append(
                AsyncEvent(
                    update=update,
                    worker=m,
                    job=job.position,
                    steps=job.steps,
                    start=job.started,
                    time=at,
                    start_update=job.start_update,
                    staleness=age(job, update),
                )
            )
            spans.append((job.started, at))
            taken.append((m, job))
        for m, job in taken:  # restart when the window closes, from theta after all of it
            new = rule.hand_out(m, next(serials), len(events), job.position + 1, close)
            finish[m] = close + new.steps * seconds[m]
    if not events:
        return AsyncSchedule((), 0.0, 0.0)
    elapsed = events[-1].time
    spans += [(rule.jobs[m].started, at) for m, at in finish.items()]
    busy = sum(max(0.0, min(end, elapsed) - start) for start, end in spans)
    return AsyncSchedule(tuple(events), elapsed, busy / (num_workers * elapsed))


def train_async(
    loss_fn: LossFn,
    params: Any,
    data: Any,
    *,
    num_workers: int,
    inner_steps: int,
    num_updates: int,
    step_seconds: Sequence[float] | None = None,
    grace_seconds: float = 0.0,
    dynamic_steps: bool = False,
    arrivals: Sequence[AsyncEvent] | None = None,
    has_aux: bool = False,
    rng_seed: int | None = None,
    trainable: Any = None,
    inner_optimizer: optax.GradientTransformation | None = None,
    outer_optimizer: optax.GradientTransformation | None = None,
    method: DiLoCo | None = None,
    eval_fn: Callable[[Any], dict[str, jax.Array]] | None = None,
    eval_every: int = 1,
    callback: Callable[[Record], None] | None = None,
    backend: str = "auto",
    devices: "list[jax.Device] | None" = None,
    mesh: Mesh | None = None,
    worker_axis: str = WORKER_AXIS,
    param_sharding: Any = None,
    batch_sharding: P | None = None,
    checkpoint_dir: "str | os.PathLike | None" = None,
    checkpoint_every: int = 1,
    keep_checkpoints: int = 3,
    checkpoint_fingerprint: dict[str, Any] | None = None,
    server: Any = None,
) -> AsyncResult:
    """Trains with asynchronous DiLoCo for `num_updates` server updates (simulated clock).

    Args:
      loss_fn: (params, batch) -> float scalar; batch is one worker's batch for one step.
      params: initial theta, any pytree of float arrays. Never mutated or donated.
      data: a `Sampler` (job j of worker m, step h draws `sample(arrays, j, m, h)`, with
        worker m's slice of its `worker_arrays` as a fifth argument where it has them), or an
        indexable sequence of rounds, each a batch pytree with leaves [M, H, ...]: worker m's
        job j uses rounds[j][m] (its first h_m steps), as round j of `train_diloco` would.
      num_workers: M >= 1. inner_steps: H >= 1. num_updates: >= 0.
      step_seconds: M positive finite floats, simulated seconds per inner step of each worker.
      grace_seconds, dynamic_steps: see `async_schedule`.
      arrivals: instead of step_seconds (and without grace_seconds or dynamic_steps), a
        recorded arrival log to replay: at least num_updates `AsyncEvent`s in update order
        (update u at index u), e.g. a real run's (`elastic.arrivals`). Each names its worker,
        job (the worker's data position: its round of `data` and its keys), steps (1..H),
        start_update (<= update: the θ it started from) and staleness (update -
        start_update); a worker's jobs increase. The replay applies them in that order,
        exactly as the simulated clock's own schedule. With `server=dj.DecoupledDiLoCo(...)`:
        a real Decoupled DiLoCo run's `decoupled.Merge`s (`elastic.arrivals` of its syncer's
        folder), its merges, boundaries and learner restarts in place of the schedule; with
        `server=dj.HALoS(...)`: a real HALoS run's `halos_replay.Record` (`elastic.arrivals`
        of its global syncer's folder), num_updates its region updates, all of them.
      has_aux: `loss_fn` returns (loss, aux dict of scalars); each aux metric's mean over the
        job's steps joins its history entry beside "loss".
      rng_seed: `loss_fn(params, batch, key)`; job j of worker m, step h draws
        fold_in(fold_in(fold_in(PRNGKey(rng_seed), j), m), h) (a job is that worker's round).
      trainable: frozen leaves get zero inner updates, so their deltas are exactly 0 and the
        outer step leaves them as they were (see `diloco_jax.trainable`).
      inner_optimizer: default AdamW(4e-4, b1=0.9, b2=0.95, weight_decay=0.1); its state
        stays with its worker across jobs.
      outer_optimizer: applied once per arrival; default SGD(0.7, momentum=0.9,
        nesterov=True) (async DiLoCo as in the paper's baseline); `delayed_nesterov` is the
        paper's fix.
      method: or a `DiLoCo` spec giving `inner` and `outer` (its other parts don't apply to
        asynchronous arrivals and are refused); not together with the optimizer keywords.
      eval_fn: optional jittable params -> dict of scalars, run every `eval_every` inner steps
        per worker (after the first update at which the workers' applied steps reach each
        multiple of M x eval_every)
        and after the last; its values join that update's history entry.
      callback: called with each history entry as it is recorded.
      backend, devices: "auto" or "vmap": jobs run one at a time (each depends on the theta
        its worker started from) on the first of `devices` (default `jax.devices()`).
      mesh, worker_axis, param_sharding, batch_sharding: as `train_diloco`'s (backend
        "auto"): worker m's jobs run on the mesh's slice m of `worker_axis`, its params and
        inner state sharded there by `param_sharding`, each step's batch at
        `batch_sharding`; theta and the outer state sit at the params' specs on the whole
        mesh (`diloco_jax.async_placement`). Single-process runs only.
      checkpoint_dir: if set, theta, the outer state, every worker's inner state, the theta
        each running job started from and the history are saved there (Orbax, atomic) every
        `checkpoint_every` updates and after the last, keeping the newest
        `keep_checkpoints`; a call with a `checkpoint_dir` that holds a checkpoint of the
        same run (params, M, H, step times, grace, DyLU) resumes from it, bit-identical to
        an uninterrupted run, and may ask for more updates than the run it resumes (its
        history then keeps the shorter run's evaluation after its last update, as
        `train_diloco`'s does). A second run into it while this one runs is refused.
      checkpoint_fingerprint: as `train_diloco`'s.
      server: None (one server applying each arrival, as above), or another server part
        running the same workers on the same clock: `dj.DecoupledDiLoCo(...)` (learners that
        never wait, a syncer merging a quorum of pushes; `diloco_jax.decoupled`) or
        `dj.HALoS(...)` (a server per region under a global one; `diloco_jax.halos`). Their
        history entries and results are described there; they take no `grace_seconds` (a
        syncer has its own window) and save checkpoints (`checkpoint_dir`, resumed bit for
        bit); both run their workers on a `mesh` as the one server does.

    Returns:
      AsyncResult(params, state, history, elapsed_seconds, utilization). history[u] has
      "update", "time" (simulated seconds at its arrival), "worker", "steps" (the job's
      inner steps), "total_steps" (inner steps of every job applied so far), "staleness",
      "loss" (the job's mean inner loss), "bytes_communicated" and "wire_bytes" (cumulative
      bytes each worker sent, averaged over the M workers: a delta of |theta| x itemsize
      bytes in float32 or wider to the server per applied job; the server's reply is not
      counted), "worker_bytes" (each worker's own cumulative bytes, [M]); on a mesh,
      "wire_bytes_per_device" (the same, per device: each sends its shard of the delta).
      Same inputs give bit-identical results.
    """
    _check_counts(num_workers, inner_steps, num_updates, eval_every, dynamic_steps)
    seconds, recorded, clock = _clock(step_seconds, grace_seconds, dynamic_steps, arrivals,
                                      server, num_workers, inner_steps, num_updates)  # fmt: skip
    check_params(params)
    check_loss_options(has_aux, rng_seed)
    inner_optimizer, outer_optimizer = _optimizers(
        method, inner_optimizer, outer_optimizer, params, trainable
    )
    where = _where(backend, devices, mesh, worker_axis, param_sharding, batch_sharding, params,
                   num_workers)  # fmt: skip
    _check_fits(where, params, inner_optimizer, num_workers)
    run_checkpoints = functools.partial(
        checkpoints,
        checkpoint_dir,
        checkpoint_every,
        keep_checkpoints,
        params,
        algorithm="async",
        num_workers=num_workers,
        inner_steps=inner_steps,
        **clock,
        **({} if rng_seed is None else {"rng_seed": rng_seed}),
        **checkpoint.run_fields(checkpoint_fingerprint),
    )
    run = AsyncRun(
        loss_fn=loss_fn,
        params=params,
        data=data,
        num_workers=num_workers,
        inner_steps=inner_steps,
        num_updates=num_updates,
        step_seconds=seconds,
        dynamic_steps=dynamic_steps,
        has_aux=has_aux,
        rng_seed=rng_seed,
        inner_optimizer=inner_optimizer,
        outer_optimizer=outer_optimizer,
        eval_fn=eval_fn,
        eval_every=eval_every,
        callback=callback,
        where=where,
        recorded=recorded,
    )
    if server is not None:
        return _other_server(server, run, mesh=mesh, checkpoint_dir=checkpoint_dir,
                             grace_seconds=grace_seconds, checkpoints=run_checkpoints)  # fmt: skip
    return _one_server(run._replace(checkpoints=run_checkpoints()), grace_seconds)


def _check_counts(num_workers, inner_steps, num_updates, eval_every, dynamic_steps) -> None:
    """ValueError naming the first of `train_async`'s counts out of range."""
    check_int("num_workers", num_workers, 1)
    check_int("inner_steps", inner_steps, 1)
    check_int("num_updates", num_updates, 0)
    check_int("eval_every", eval_every, 1)
    limits.check_steps("num_updates x inner_steps", num_updates, inner_steps)
    if not isinstance(dynamic_steps, bool):
        raise ValueError(f"dynamic_steps must be True or False, got {dynamic_steps!r}")


def _optimizers(method, inner_optimizer, outer_optimizer, params, trainable) -> tuple:
    """(inner, outer) optax rules of `train_async`'s method (or its two optimizer arguments),
    checked; the inner one masked by `trainable`."""
    given = {"inner_optimizer": inner_optimizer, "outer_optimizer": outer_optimizer}
    given = {k: checked_optimizer(k, v, None) for k, v in given.items() if v is not None}
    method = method_from_options(method, given, caller="train_async")
    only_optimizers(method, "train_async", "each arrival applies one worker's whole delta")
    inner = checked_optimizer("inner_optimizer", method.inner, default_inner_optimizer)
    frozen = trainable_lib.frozen_leaves(params, trainable)
    inner = trainable_lib.masked_optimizer(inner, params, frozen)
    return inner, checked_optimizer("outer_optimizer", method.outer, default_outer_optimizer)


def _clock(
    step_seconds,
    grace_seconds,
    dynamic_steps,
    arrivals,
    server,
    num_workers,
    inner_steps,
    num_updates,
) -> tuple[Any, Any, dict]:
    """(step seconds or None, the recorded arrivals or None, the clock's fingerprint fields):
    `train_async`'s simulated clock, or the recorded run its `arrivals` replay, checked."""
    if arrivals is None:
        seconds = checked_step_seconds(step_seconds, num_workers)
        clock = {
            "step_seconds": list(seconds),
            "grace_seconds": _checked_grace(grace_seconds),
            "dynamic_steps": dynamic_steps,
        }
        return seconds, None, clock
    if step_seconds is not None or grace_seconds or dynamic_steps:
        raise ValueError(
            "arrivals replays a recorded schedule: it takes no step_seconds, "
            "grace_seconds or dynamic_steps"
        )
    if server is not None:  # the part's own record of a real run (Decoupled DiLoCo's)
        if not callable(getattr(server, "recorded", None)):
            raise ValueError(f"server={type(server).__name__}(...) replays no arrivals")
        recorded = server.recorded(arrivals, num_workers, inner_steps, num_updates)
        return None, recorded, {"arrivals": recorded.digest}
    recorded = _recorded_events(arrivals, num_workers, inner_steps)
    if len(recorded) < num_updates:
        raise ValueError(f"arrivals holds {len(recorded)} updates; num_updates = {num_updates}")
    return None, recorded, {"arrivals": _digest(recorded)}  # fmt: skip


def _check_fits(where: Any, params: Any, inner_optimizer: Any, num_workers: int) -> None:
    """ValueError naming num_workers unless every worker's inner state (and, in a checkpoint,
    its job's start) fits the run's devices."""
    per_worker = limits.nbytes(params) + limits.nbytes(jax.eval_shape(inner_optimizer.init, params))
    on = (
        [where.device]
        if isinstance(where, OneDevice)
        else [d for m in where.meshes for d in m.devices.flat]
    )
    limits.check_fits(f"num_workers={num_workers}", num_workers * per_worker, on)


def _one_server(run: "AsyncRun", grace_seconds: float) -> AsyncResult:
    """`train_async` with its one server (see its docstring): the schedule of `run`'s clock
    (or the arrivals `run.recorded` replays), each arrival's job and outer update in the
    loop of `diloco_jax.loop`, checkpointed with `run.checkpoints`."""
    seconds, inner_steps, num_updates = run.step_seconds, run.inner_steps, run.num_updates
    where = run.where
    recorded = run.recorded
    if recorded is None:
        schedule = async_schedule(
            seconds, inner_steps, num_updates, grace_seconds=grace_seconds,
            dynamic_steps=run.dynamic_steps,
        )  # fmt: skip
    else:
        schedule = _recorded_schedule(recorded[:num_updates], run.num_workers)
    job_data = _job_data(run.data, run.num_workers, inner_steps, schedule.events, where)
    # On a mesh, a job runs under plain jit on its worker's slice of it: traced with that
    # slice's axes in context (the same axes for every worker) as a round's body is.
    job_mesh = where.meshes[0].abstract_mesh if isinstance(where, OnMesh) else None
    run_job, apply_delta = _programs(
        run.loss_fn, run.inner_optimizer, run.outer_optimizer, run.has_aux, run.rng_seed, job_mesh
    )
    lookahead = job_start(run.outer_optimizer)  # HeLoCo's θ̄; without one, θ itself (no copy)
    start_of_job = (lambda theta, state: theta) if lookahead is None else jax.jit(lookahead)

    theta = where.shared(jax.tree.map(lambda x: jnp.array(x, copy=True), run.params))
    # Committed to the devices like the programs' outputs, so each job length compiles once.
    outer_state = where.shared(outer_init(run.outer_optimizer, theta))
    inner_states = where.inner_states(run.inner_optimizer.init, theta, run.num_workers)
    events = schedule.events
    if run.checkpoints is not None:
        # A checkpoint saves the theta each job in flight started from: look ahead to them.
        events = recorded if recorded is not None else _with_jobs_in_flight(
            seconds, inner_steps, num_updates, grace_seconds, run.dynamic_steps
        )  # fmt: skip
    shards = where.shards(run.params)  # on a mesh: each device sends its shard of a delta
    arrivals = _Arrivals(
        events=events,
        num_updates=num_updates,
        num_workers=run.num_workers,
        where=where,
        run_job=run_job,
        apply_delta=apply_delta,
        job_data=job_data,
        evaluate_fn=jax.jit(run.eval_fn) if run.eval_fn is not None else None,
        eval_every=run.eval_every,
        job_start=start_of_job,
        per_job=round_bytes(run.params),
        per_job_device=None if shards is None else round_bytes(shards),
    )
    loop = Loop(num_updates, run.checkpoints, run.callback, unit="updates",
                total_name="num_updates")  # fmt: skip
    first = {0: start_of_job(theta, outer_state)}
    running, history = loop.run(
        arrivals,
        _Running(
            theta=theta, outer_state=outer_state, inner_states=inner_states, starts=first, done=0
        ),
    )
    state = AsyncState(
        running.theta, running.outer_state, where.stack(running.inner_states), num_updates
    )
    theta, state = where.results((running.theta, state))
    return AsyncResult(
        params=theta,
        state=state,
        history=history,
        elapsed_seconds=schedule.elapsed_seconds,
        utilization=schedule.utilization,
    )


class AsyncRun(NamedTuple):
    """What a `server=` part of `train_async` trains with: the call's checked arguments (the
    inner optimizer already masked by `trainable`), and where the run's arrays live (one
    device, or each worker's slice of the user's mesh)."""

    loss_fn: Any
    params: Any
    data: Any
    num_workers: int
    inner_steps: int
    num_updates: int
    step_seconds: tuple[float, ...] | None  # None: a recorded run's arrivals replayed
    dynamic_steps: bool
    has_aux: bool
    rng_seed: int | None
    inner_optimizer: optax.GradientTransformation
    outer_optimizer: optax.GradientTransformation
    eval_fn: Callable | None
    eval_every: int
    callback: Callable | None
    where: Any  # where its arrays live: `async_placement.OneDevice` or `OnMesh`
    checkpoints: Any = None  # diloco_jax.loop.Checkpoints, for a part that saves them
    recorded: Any = None  # a recorded real run to replay (the one server's, or a part's)


def _other_server(
    server: Any, run: AsyncRun, *, mesh, checkpoint_dir, grace_seconds, checkpoints
):  # fmt: skip
    """Runs a `server=` part (its `train(run)`), after refusing what it doesn't take; a part
    with `checkpoint_fields()` saves checkpoints (`run.checkpoints`, made by
    `checkpoints(**fields)` with those fields in the run's fingerprint)."""
    if not callable(getattr(server, "train", None)):
        raise ValueError(
            f"server must be None, dj.DecoupledDiLoCo(...) or dj.HALoS(...), got {server!r}"
        )
    name = type(server).__name__
    if job_start(run.outer_optimizer) is not None:  # no job would start at its θ̄
        raise ValueError(
            f"outer_optimizer {type(run.outer_optimizer).__name__} (HeLoCo's look-ahead) runs "
            f"with train_async's one server, not server={name}"
        )
    if mesh is not None and not getattr(server, "takes_mesh", False):
        raise ValueError(f"server={name}(...) runs on one device: it takes no mesh=")
    if checkpoint_dir is not None and not hasattr(server, "checkpoint_fields"):
        raise ValueError(f"server={name}(...) does not save checkpoints: leave checkpoint_dir out")
    if _checked_grace(grace_seconds):
        raise ValueError(
            f"grace_seconds belongs to the single server; server={name}(...) sets its own timing"
        )
    if checkpoint_dir is not None:
        run = run._replace(checkpoints=checkpoints(server=server.checkpoint_fields()))
    return server.train(run)


class _Running(NamedTuple):
    """The loop's state: theta, the outer state, each worker's inner state (a list), the
    theta after k updates for every k some job still to apply started from, and the updates
    applied."""

    theta: Any
    outer_state: Any
    inner_states: list
    starts: dict[int, Any]
    done: int


@dataclasses.dataclass
class _Arrivals:
    """The loop's `Job` (`diloco_jax.loop`): one iteration applies one arrival (`AsyncEvent`):
    the job of its worker, run from the theta that job started from, then the outer update.
    A job is computed when the server applies it, so a worker's inner optimizer state
    passes from job to job in order."""

    events: tuple[AsyncEvent, ...]  # the schedule, looking past num_updates with checkpoints
    num_updates: int
    num_workers: int
    where: Any
    run_job: Callable
    apply_delta: Callable
    job_data: Callable
    evaluate_fn: Callable | None
    eval_every: int
    job_start: Callable  # (θ, outer state) -> the θ a job starts from
    per_job: int
    per_job_device: int | None
    # Bookkeeping from `items(start)` on: how many jobs still to apply started from the theta
    # after k updates, bytes each worker sent, inner steps applied.
    waiting: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    sent: list = dataclasses.field(default_factory=list)
    total_steps: int = 0

    def items(self, start: int) -> Sequence[AsyncEvent]:
        self.waiting = collections.Counter(e.start_update for e in self.events[start:])
        self.sent = [0] * self.num_workers
        for e in self.events[:start]:
            self.sent[e.worker] += self.per_job
        self.total_steps = sum(e.steps for e in self.events[:start])
        return self.events[start : self.num_updates]

    def step(self, state: _Running, e: AsyncEvent) -> tuple[_Running, Any]:
        starts, inner_states = dict(state.starts), list(state.inner_states)
        start = starts[e.start_update]
        self.waiting[e.start_update] -= 1
        if not self.waiting[e.start_update]:
            del starts[e.start_update]
        delta, inner_states[e.worker], loss = self.run_job(
            self.where.to_worker(start, e.worker),
            inner_states[e.worker],
            self.job_data(e),
            jnp.int32(e.job),
            jnp.int32(e.worker),
            num_steps=e.steps,
        )
        theta, outer_state = self.apply_delta(  # the delta's age: its job's staleness
            state.theta, state.outer_state, self.where.arrived(delta), jnp.int32(e.staleness)
        )
        if self.waiting[e.update + 1]:
            starts[e.update + 1] = self.job_start(theta, outer_state)
        self.sent[e.worker] += self.per_job
        self.total_steps += e.steps
        done = e.update + 1
        entry = {
            "update": e.update,
            "time": e.time,
            "worker": e.worker,
            "steps": e.steps,
            "total_steps": self.total_steps,
            "staleness": e.staleness,
            "bytes_communicated": round(sum(self.sent) / self.num_workers),
            "wire_bytes": round(sum(self.sent) / self.num_workers),
            "worker_bytes": list(self.sent),
        }
        if self.per_job_device is not None:
            entry["wire_bytes_per_device"] = round(done * self.per_job_device / self.num_workers)
        return _Running(
            theta=theta,
            outer_state=outer_state,
            inner_states=inner_states,
            starts=starts,
            done=done,
        ), (entry, loss)

    def evaluate(self, state: _Running, done: int) -> Any:
        # Every `eval_every` inner steps per worker: when the applied steps of all workers
        # first reach each multiple of M x eval_every.
        if self.evaluate_fn is None:
            return None
        before = self.total_steps - self.events[done - 1].steps
        due = eval_due(before, self.total_steps, self.num_workers * self.eval_every)
        return self.evaluate_fn(state.theta) if due or done == self.num_updates else None

    def record(self, i: int, e: AsyncEvent, metrics: Any, evals: Any) -> dict[str, Any]:
        entry, means = metrics
        loss, aux = to_host(means)
        entry["loss"] = float(loss)
        return joined(entry, aux, evals)

    def savable(self, state: _Running) -> _AsyncCheckpoint:
        job_starts = _job_starts(
            self.events, state.done, state.starts, state.theta, self.num_workers, self.where
        )
        return _AsyncCheckpoint(
            state.theta, state.outer_state, self.where.stack(state.inner_states), job_starts
        )

    def restored(self, saved: _AsyncCheckpoint, done: int) -> _Running:
        """The loop's state after `done` updates: the jobs running then started from their
        worker's saved start."""
        job_starts = self.where.unstack(saved.job_starts, self.num_workers)
        starts = {
            e.start_update: job_starts[e.worker]
            for e in self.events[done:]
            if e.start_update <= done
        }
        inner_states = self.where.unstack(saved.inner_opt_state, self.num_workers)
        return _Running(
            theta=saved.params,
            outer_state=saved.outer_opt_state,
            inner_states=inner_states,
            starts=starts,
            done=done,
        )


def eval_due(before: int, now: int, every: int) -> bool:
    """Whether the inner steps applied, summed over the workers, first reached a multiple of
    `every` (M x eval_every) in going from `before` to `now`: an asynchronous run's
    evaluations (the last update's is the caller's)."""
    return now // every > before // every


def joined(entry: dict, aux: dict, evals: Any) -> dict:
    """`entry` with the jobs' aux metrics (floats; a name the entry holds is refused) and the
    evaluation's values (None: none), as an asynchronous run's history records them."""
    for name, value in aux.items():
        if name in entry:
            raise ValueError(f"loss_fn's aux name {name!r} collides with the history key")
        entry[name] = float(value)
    if evals is not None:
        entry.update({k: float(v) for k, v in to_host(evals).items()})
    return entry


def _recorded_events(
    arrivals: Sequence[Any], num_workers: int, inner_steps: int
) -> tuple[AsyncEvent, ...]:
    """A recorded arrival log as `AsyncEvent`s, checked: ValueError naming arrivals[i] where
    an event can't be replayed."""
    try:
        events = tuple(AsyncEvent(*e) for e in arrivals)
    except TypeError:
        raise ValueError(
            "arrivals must be a sequence of AsyncEvent (update, worker, job, steps, start, time, "
            "start_update, staleness)"
        ) from None
    last_job: dict[int, int] = {}
    for i, e in enumerate(events):
        fields = (e.update, e.worker, e.job, e.steps, e.start_update, e.staleness)
        if not all(isinstance(x, int | np.integer) and not isinstance(x, bool) for x in fields):
            raise ValueError(f"arrivals[{i}] must hold integer indices, got {e!r}")
        why = None
        if e.update != i:
            why = f"its update must be {i} (in update order)"
        elif not 0 <= e.worker < num_workers:
            why = f"its worker must be in [0, {num_workers})"
        elif not 1 <= e.steps <= inner_steps:
            why = f"its steps must be in [1, inner_steps = {inner_steps}]"
        elif not 0 <= e.start_update <= e.update or e.staleness != e.update - e.start_update:
            why = "its start_update must be in [0, update] and staleness update - start_update"
        elif e.job <= last_job.get(e.worker, -1):
            why = f"worker {e.worker}'s jobs must increase"
        if why is not None:
            raise ValueError(f"arrivals[{i}] can't be replayed: {why}; got {e!r}")
        last_job[e.worker] = e.job
    return events


def _recorded_schedule(events: tuple[AsyncEvent, ...], num_workers: int) -> AsyncSchedule:
    """Recorded events as an `AsyncSchedule` (utilization: the applied jobs' busy seconds /
    (M x elapsed_seconds); jobs a fault cut short don't count)."""
    if not events:
        return AsyncSchedule((), 0.0, 0.0)
    elapsed = max(e.time for e in events)
    busy = sum(e.time - e.start for e in events)
    return AsyncSchedule(events, elapsed, busy / (num_workers * elapsed) if elapsed > 0 else 0.0)


def _digest(events: Sequence[AsyncEvent]) -> str:
    """A checkpoint's fingerprint of a replayed log: every event's indices, hashed (a
    longer replay of the same log resumes a shorter one)."""
    text = json.dumps([[e.worker, e.job, e.steps, e.start_update] for e in events])
    return hashlib.sha256(text.encode()).hexdigest()


def _with_jobs_in_flight(
    seconds: tuple[float, ...],
    inner_steps: int,
    num_updates: int,
    grace_seconds: float,
    dynamic_steps: bool,
) -> tuple[AsyncEvent, ...]:
    """The first `num_updates` events followed by enough later ones that every worker's next
    job appears (the first events don't depend on how many follow)."""
    count = num_updates + len(seconds)
    while True:
        events = async_schedule(
            seconds, inner_steps, count, grace_seconds=grace_seconds, dynamic_steps=dynamic_steps
        ).events
        if len({e.worker for e in events[num_updates:]}) == len(seconds):
            return events
        count *= 2


def _job_starts(
    events: Sequence[AsyncEvent], done: int, starts: dict, theta: Any, num_workers: int, where
) -> Any:
    """Leaves [M, ...]: the theta each worker's next job (applied after update `done`)
    started from when it started by then, else theta (a placeholder never read)."""
    first: dict[int, int] = {}
    for e in events[done:]:
        first.setdefault(e.worker, e.start_update)
    return where.stack(
        [starts[first[m]] if first.get(m, done + 1) <= done else theta for m in range(num_workers)]
    )


def _job(
    loss_fn, inner_optimizer, has_aux, rng_seed, params, opt_state, data, job, worker, *, num_steps
):
    """One job of one worker: `num_steps` inner steps from `params` (its theta_start), step h
    keyed `step_key(worker_key(rng_seed, job, worker), h)` with a seed. Returns (delta
    theta_start - theta_m in the delta dtype, new inner state, (mean loss, mean aux))."""
    if isinstance(data, sampler_lib.WorkerSampler):
        batches = functools.partial(data.draw, job, worker)
    else:
        batches = data  # leaves [num_steps, ...]
    key = None if rng_seed is None else worker_key(rng_seed, job, worker)
    new_params, opt_state, losses, *aux = inner_loop(
        loss_fn, inner_optimizer, params, opt_state, batches, num_steps=num_steps, key=key,
        has_aux=has_aux,
    )  # fmt: skip
    means = jax.tree.map(jnp.mean, (losses, aux[0] if aux else {}))
    return worker_delta(params, new_params), opt_state, means


def _apply(outer_optimizer, params, outer_state, delta, age):
    return outer_update(outer_optimizer, params, outer_state, delta, age)


@functools.lru_cache(maxsize=32)
def _cached_programs(loss_fn, inner_optimizer, outer_optimizer, has_aux, rng_seed, job_mesh):
    run_job = jax.jit(
        in_mesh_context(
            functools.partial(_job, loss_fn, inner_optimizer, has_aux, rng_seed), job_mesh
        ),
        static_argnames=("num_steps",),
    )
    return run_job, jax.jit(functools.partial(_apply, outer_optimizer))


def _programs(
    loss_fn, inner_optimizer, outer_optimizer, has_aux=False, rng_seed=None, job_mesh=None
):
    """(jitted job: one program per job length, traced with `job_mesh`'s axes in context,
    jitted outer update); cached per (loss_fn, optimizers, loss options, job mesh) so
    repeated runs reuse the compilations."""
    args = (loss_fn, inner_optimizer, outer_optimizer, has_aux, rng_seed, job_mesh)
    try:
        return _cached_programs(*args)
    except TypeError:  # unhashable loss_fn or optimizer: compile without the cache
        return _cached_programs.__wrapped__(*args)


def _job_data(
    data: Any, num_workers: int, inner_steps: int, events: Sequence[AsyncEvent], where
) -> Callable[[AsyncEvent], Any]:
    """event -> that job's data on its worker's devices (`where`): the Sampler (placed once
    per worker, with that worker's slice of its `worker_arrays`), or worker m's first h_m
    steps of round j. Checks up front that the rounds cover every job."""
    if isinstance(data, Sampler):
        sampler_lib.check_workers(data, num_workers)
        placed = [where.sampler(sampler_lib.for_worker(data, m), m) for m in range(num_workers)]
        return lambda e: placed[e.worker]
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise ValueError(
            "data must be a Sampler or an indexable sequence of rounds (leaves [M, H, ...]), "
            f"got {type(data).__name__}"
        )
    needed = 1 + max((e.job for e in events), default=-1)
    if len(data) < needed:
        raise ValueError(
            f"data has {len(data)} rounds; the schedule runs up to {needed} jobs per worker"
        )
    lead = (num_workers, inner_steps)

    def of(e: AsyncEvent) -> Any:
        if e.job >= len(data):  # a schedule not known up front (HALoS) runs out here
            raise ValueError(f"data has {len(data)} rounds; worker {e.worker} reached job {e.job}")
        batch = data[e.job]
        leaves = jax.tree.leaves(batch)
        if not leaves:
            raise ValueError(f"data round {e.job} has no arrays")
        for leaf in leaves:
            if tuple(np.shape(leaf))[:2] != lead:
                raise ValueError(
                    f"data round {e.job}: every leaf must have leading dims [num_workers, "
                    f"inner_steps] = {lead}, got shape {np.shape(leaf)}"
                )
        mine = jax.tree.map(lambda x: np.asarray(x)[e.worker, : e.steps], batch)
        return where.batch(mine, e.worker)

    return of


def _where(
    backend, devices, mesh, worker_axis, param_sharding, batch_sharding, params, num_workers
):
    """Where the run's arrays live: `OneDevice` (the first of `devices`), or `OnMesh` on the
    user's mesh."""
    if mesh is None:
        if param_sharding is not None or batch_sharding is not None:
            raise ValueError("param_sharding and batch_sharding need a mesh (mesh=...)")
        return OneDevice(_device(backend, devices))
    if backend != "auto" or devices is not None:
        raise ValueError(
            f"mesh= places the jobs itself: it needs backend='auto' and no devices=, got "
            f"backend={backend!r}"
        )
    if is_multiprocess():
        raise ValueError("train_async with mesh= runs in one process (jax.process_count() > 1)")
    placed = make_backend(
        "auto", num_workers, mesh=mesh, worker_axis=worker_axis, batch_sharding=batch_sharding
    )
    return OnMesh(placed, params, resolve_param_specs(params, placed.mesh, param_sharding))


def _device(backend: str, devices) -> jax.Device:
    if backend not in ("auto", "vmap"):
        raise ValueError(
            f"backend must be 'auto' or 'vmap' for train_async (jobs run one at a time on one "
            f"device), got {backend!r}"
        )
    devices = jax.devices() if devices is None else list(devices)
    if not devices:
        raise ValueError("devices must hold at least one device")
    return devices[0]


def _checked_grace(grace_seconds: Any) -> float:
    if (
        isinstance(grace_seconds, bool)
        or not isinstance(grace_seconds, int | float | np.number)
        or not (math.isfinite(grace_seconds) and grace_seconds >= 0)
    ):
        raise ValueError(f"grace_seconds must be a finite number >= 0, got {grace_seconds!r}")
    return float(grace_seconds)


__all__ = [
    "AsyncEvent",
    "AsyncResult",
    "AsyncSchedule",
    "AsyncState",
    "async_schedule",
    "dynamic_local_steps",
    "train_async",
]

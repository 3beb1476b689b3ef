"""The one host loop under every trainer: resume from the latest checkpoint, run the
iterations (a round, a step, or an asynchronous arrival), evaluate when due, record one
history entry per iteration, save checkpoints in the background, and finish.

What differs between trainers is a `Job`: what one iteration runs, what it records, what a
checkpoint holds. `train_diloco`, `train_diloco_step` and `train_sync` run `Steps` (a jitted
step over batches placed on the backend); `train_async` its own job of simulated arrivals.
The jitted steps are cached here too (`jitted`), so repeated runs reuse their compilations.
"""

import dataclasses
import functools
import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_jax import checkpoint, delay, donation, offload
from diloco_jax import model_state as model_state_lib
from diloco_jax import placement as placement_lib
from diloco_jax import sampler as sampler_lib
from diloco_jax.checks import check_int
from diloco_jax.distributed import is_multiprocess, place_global, to_host
from diloco_jax.placement import Placement
from diloco_jax.sampler import Sampler
from diloco_jax.workers import Backend

Record = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """Where and how often a run saves: every `every` iterations and after the last, keeping
    the newest `keep`; `fingerprint` is the run's identity a resume must match."""

    directory: str
    every: int
    keep: int
    fingerprint: dict[str, Any]


def checkpoints(directory, every, keep, params, **fields) -> Checkpoints | None:
    """A run's `Checkpoints` (None without a directory), its options checked (ValueError
    naming checkpoint_every, keep_checkpoints or checkpoint_dir) and the directory made;
    `fields` join the params' description in the fingerprint (`checkpoint.fingerprint`)."""
    check_int("checkpoint_every", every, 1)
    check_int("keep_checkpoints", keep, 1)
    if directory is None:
        return None
    if not isinstance(directory, str | os.PathLike):
        raise ValueError(f"checkpoint_dir must be a path, got {directory!r}")
    checkpoint.prepare(directory)
    return Checkpoints(os.fspath(directory), every, keep, checkpoint.fingerprint(params, **fields))


class Job(Protocol):
    """What a trainer runs in the loop.

    items(start): the iterations' inputs from iteration `start` on (a resumed run skips the
      completed ones). step(state, item): one iteration -> (state, metrics), metrics left on
      the device. evaluate(state, done): the evaluation's values after iteration `done`
      (1-based), or None when none is due. record(i, item, metrics, evals): iteration i's
      history entry (metrics and evals as `step` and `evaluate` returned them).
      savable(state): what a checkpoint holds (a pytree of arrays), and restored(saved, done):
      the state again, from the checkpoint after `done` iterations read onto `savable`'s
      structure and devices. A job whose checkpoint layout varies with its progress may
      define restore_target(state): what `checkpoint.restore` takes as `like_state` (e.g.
      `checkpoint.as_saved` bound to its devices); `savable(state)` is the target otherwise.
    """

    def items(self, start: int) -> Iterable[Any]: ...
    def step(self, state: Any, item: Any) -> tuple[Any, Any]: ...
    def evaluate(self, state: Any, done: int) -> Any: ...
    def record(self, i: int, item: Any, metrics: Any, evals: Any) -> Record: ...
    def savable(self, state: Any) -> Any: ...
    def restored(self, saved: Any, done: int) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Loop:
    """Runs `total` iterations of a job (see the module docstring)."""

    total: int
    checkpoints: Checkpoints | None
    callback: Callable[[Record], None] | None = None
    # What an iteration is and the argument that counts them, for errors.
    unit: str = "rounds"
    total_name: str = "num_rounds"

    def run(self, job: Job, state: Any) -> tuple[Any, list[Record]]:
        """Resumes from the latest checkpoint if any, then dispatches iteration i + 1 before
        pulling iteration i's metrics, so the host never stalls the device."""
        pending, history = None, []

        def finish(i, item, metrics, evals):
            entry = job.record(i, item, metrics, evals)
            history.append(entry)
            if self.callback is not None:
                self.callback(entry)

        ckpt = self.checkpoints
        # Holds the directory for this run from before the resume to the last save (a second
        # run into it fails at once), and writes in the background: the loop goes on while a
        # checkpoint's files are written.
        saver = None if ckpt is None else checkpoint.Saver(ckpt.directory, keep=ckpt.keep)
        try:
            state, history = self.resume(job, state, saver)
            for i, item in enumerate(job.items(len(history)), start=len(history)):
                state, metrics = job.step(state, item)
                done = i + 1
                evals = job.evaluate(state, done)
                if pending is not None:
                    finish(*pending)
                pending = (i, item, metrics, evals)
                if ckpt is not None and (done % ckpt.every == 0 or done == self.total):
                    finish(*pending)
                    pending = None
                    metadata = {**ckpt.fingerprint, "data_position": done, "history": history}
                    saver.save(done, job.savable(state), metadata)
        finally:
            if saver is not None:
                saver.close()
        if pending is not None:
            finish(*pending)
        return state, history

    def resume(
        self, job: Job, state: Any, saver: checkpoint.Saver | None
    ) -> tuple[Any, list[Record]]:
        """(state, history) from the latest intact checkpoint through `saver` (damaged newer
        ones deleted), or (`state`, []) without one. ValueError when it holds more iterations
        than `total`."""
        ckpt = self.checkpoints
        if ckpt is None:
            return state, []
        target = getattr(job, "restore_target", job.savable)(state)
        restored = saver.resume(target, ckpt.fingerprint)
        if restored is None:
            return state, []
        saved, metadata, step = restored
        if metadata["data_position"] > self.total:
            raise ValueError(
                f"checkpoint_dir {ckpt.directory} holds {metadata['data_position']} completed "
                f"{self.unit}, more than the {self.total_name} = {self.total} asked for"
            )
        return job.restored(saved, step), list(metadata["history"])


def due(done: int, total: int, steps_each: int, eval_every: int) -> bool:
    """Whether to evaluate after iteration `done` (1-based) of `total`, each `steps_each` inner
    steps per worker: at the first iteration end at or past each multiple of `eval_every`
    inner steps, and after the last."""
    return (
        done == total or (done * steps_each) // eval_every > ((done - 1) * steps_each) // eval_every
    )


@dataclasses.dataclass(frozen=True)
class Steps:
    """The `Job` of the synchronous trainers: a jitted `step(state, batch)` per iteration on
    batches placed on the backend (`train_diloco`'s rounds, `train_sync`'s steps).

    data: the trainer's `data` (an iterable, a `start -> iterable` callable, or a Sampler).
    lead, what: the leading dims each item's leaves must have, and their names for errors.
    record_metrics(i, host metrics) -> the history entry, before evaluations join it.
    """

    step: Callable[[Any, Any], tuple[Any, Any]]
    record_metrics: Callable[[int, dict[str, np.ndarray]], Record]
    backend: Backend
    data: Any
    total: int
    lead: tuple[int, ...]
    what: str
    eval_fn: Callable | None = None
    eval_every: int = 1
    eval_data: Any = None
    steps_each: int = 1  # inner steps per worker in one iteration (H for a DiLoCo round)
    merge_rules: tuple[str, ...] | None = None
    placement: "Placement | None" = None  # the state's shardings on a user's mesh
    process_local_data: bool = False  # each process's data holds only its own workers

    def items(self, start: int) -> Iterator[Any]:
        return placed_items(
            self.data, self.total, self.lead, self.what, self.backend, start,
            self.process_local_data,
        )  # fmt: skip

    def evaluate(self, state: Any, done: int) -> Any:
        if self.eval_fn is None or not due(done, self.total, self.steps_each, self.eval_every):
            return None
        return self._evaluator(state, self._placed_eval_data)

    def record(self, i: int, item: Any, metrics: Any, evals: Any) -> Record:
        entry = self.record_metrics(i, to_host(metrics))
        if evals is not None:
            entry.update({k: float(v) for k, v in to_host(evals).items()})
        return entry

    def savable(self, state: Any) -> Any:
        """The state as Orbax can save it: a multi-process "vmap" run's per-process copies
        (identical on every process) become global arrays replicated over all devices."""
        if not (is_multiprocess() and not self.backend.spans_processes):
            return state
        everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("all",)), P())
        return jax.device_put(to_host(state), everywhere)

    def restored(self, saved: Any, done: int) -> Any:
        """Inverse of `savable`: back onto this process's own device."""
        if not (is_multiprocess() and not self.backend.spans_processes):
            return saved
        return jax.device_put(to_host(saved), self.backend.devices[0])

    @functools.cached_property
    def _evaluator(self) -> Callable[[Any, Any], Any]:
        """state, eval data -> eval_fn's dict, jitted: of θ (under eager updates, of the
        workers' mean), with the merged model state and the eval data when they exist."""
        rules, with_data = self.merge_rules, self.eval_data is not None
        host = self.placement is not None and self.placement.host

        def evaluate(state, eval_data):
            params = delay.global_params(state) if hasattr(state, "round") else state.params
            if host:
                params = offload.fetch(params)
            args = [params]
            if rules is not None:
                args.append(model_state_lib.merged_view(state.model_state, rules))
            if with_data:
                args.append(eval_data)
            return self.eval_fn(*args)

        return jax.jit(evaluate)

    @functools.cached_property
    def _placed_eval_data(self) -> Any:
        if self.eval_data is None:
            return None
        return place_global(self.backend.place_shared, self.eval_data)


def place_state(state: Any, backend: Backend, placement: "Placement | None" = None) -> Any:
    """A DiLoCoState / SyncState on the backend's devices: at the placement's shardings on a
    user's mesh, else each per-worker field split over the workers and the rest shared."""
    if placement is not None:
        return jax.device_put(state, placement.shardings(state))

    def place(owner, name, value, per_worker):
        return place_global(backend.place_workers if per_worker else backend.place_shared, value)

    return placement_lib.map_fields(state, place)


def placed_items(
    data: Any,
    count: int,
    lead: tuple[int, ...],
    what: str,
    backend: Backend,
    skip: int = 0,
    local: bool = False,
) -> Iterator[Any]:
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
        batches = checked_items(data(skip), count - skip, lead, what)
    else:
        batches = itertools.islice(checked_items(data, count, lead, what), skip, None)
    if local:
        return (backend.assemble_batches(b, len(lead)) for b in batches)
    place = functools.partial(backend.place_batches, lead=len(lead))
    return (place_global(place, b) for b in batches)


def checked_items(data: Iterable[Any], count: int, lead: tuple[int, ...], what: str) -> Iterator:
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


@functools.lru_cache(maxsize=64)
def _cached_jit(fn, loss_fn, backend, options, placement=None, kept=()):
    step = functools.partial(fn, loss_fn, backend=backend, **dict(options))
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


def jitted(fn, loss_fn, backend: Backend, placement: "Placement | None" = None, kept=(), **options):
    """`fn(loss_fn, state, batch, backend=backend, **options)` jitted, its state donated but for
    the fields in `kept` (`donation`), on a placement kept at its shardings; cached so
    repeated runs reuse the compilation."""
    key = tuple(sorted(options.items()))
    try:
        return _cached_jit(fn, loss_fn, backend, key, placement, kept)
    except TypeError:  # an unhashable loss_fn or optimizer: compile without the cache
        return _cached_jit.__wrapped__(fn, loss_fn, backend, key, placement, kept)


def step_record(metrics: dict[str, np.ndarray]) -> Record:
    """The per-step means of a round or step's metrics: "loss", "worker_loss" ([M]) and each
    aux metric's pair, in the order the round returned them."""
    out = {}
    for name in metrics:
        if "worker_" + name in metrics:
            out[name] = float(metrics[name])
            out["worker_" + name] = [float(x) for x in metrics["worker_" + name]]
    return out

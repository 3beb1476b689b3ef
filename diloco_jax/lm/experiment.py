"""Language-model experiments: data and model from a RunConfig, one training run of DiLoCo or
the synchronous baseline, evaluated on held-out documents. Used by the CLI and notebooks."""

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from diloco_jax import limits
from diloco_jax.async_train import async_schedule, dynamic_local_steps, train_async
from diloco_jax.decoupled import DecoupledDiLoCo, steps_by
from diloco_jax.halos import HALoS
from diloco_jax.lm import data as data_lib
from diloco_jax.lm import mfu as mfu_lib
from diloco_jax.lm import model as model_lib
from diloco_jax.lm import tokenizer as tokenizer_lib
from diloco_jax.lm.config import (
    MOMENTUM_OPTIMIZERS,
    WORKER_AXIS,
    ConfigError,
    RunConfig,
    format_mesh,
    inner_optimizer,
    mesh_axes,
    method,
    model_config,
    outer_optimizer,
    pretrain_optimizer,
    server_of,
)
from diloco_jax.sampler import Sampler
from diloco_jax.train import train_diloco, train_sync
from diloco_jax.workers import make_backend

Record = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Tokens of the train split (with document starts) and fixed eval batches."""

    train_tokens: np.ndarray  # int32 [N]
    doc_starts: np.ndarray  # int64 [D], first token of each train document
    eval_batches: dict[str, np.ndarray]  # {"inputs", "targets"}: int32 [num_batches, B, L]
    # source description, split sizes, "tokenizer" (tokenizer.Tokenizer.info), and
    # "eval_tokens" / "eval_bytes": the eval targets and the UTF-8 bytes they stand for
    info: dict[str, Any]

    @property
    def eval_bytes_per_token(self) -> float:
        """UTF-8 bytes per eval target token (exactly 1.0 for the byte tokenizer)."""
        return self.info["eval_bytes"] / self.info["eval_tokens"]


def bits_per_byte(loss_per_token: float, bytes_per_token: float) -> float:
    """Mean loss in nats per token -> bits per byte of the text those tokens encode: total nats
    / (ln 2 x bytes). For byte-level tokens (bytes_per_token 1) it is loss / ln 2."""
    return loss_per_token / (math.log(2) * bytes_per_token)


def load_corpus(cfg: RunConfig) -> Corpus:
    """Loads `cfg.data`, splits it by document, tokenizes it with `cfg.tokenizer` (a BPE
    tokenizer is trained on the train split, or loaded from its cache), and builds the train
    stream and eval batches.

    Raises ConfigError (one line, naming the problem) for a bad source, too little data, or
    a corpus too small for the BPE vocabulary.
    """
    try:
        source = data_lib.load_source(cfg.data, max_bytes=cfg.max_bytes)
        train_docs, val_docs = data_lib.split_documents(
            source.documents, cfg.val_fraction, cfg.seed
        )
    except ValueError as e:
        raise ConfigError(f"--data {cfg.data}: {e}") from None
    try:
        tokenizer = tokenizer_lib.get_tokenizer(cfg.tokenizer, train_docs)
    except ValueError as e:
        raise ConfigError(f"--tokenizer {cfg.tokenizer}: {e}") from None
    try:
        train_tokens, doc_starts = data_lib.concat_documents(tokenizer.encode_documents(train_docs))
        val_tokens, _ = data_lib.concat_documents(tokenizer.encode_documents(val_docs))
        evals = data_lib.eval_batches(val_tokens, cfg.eval_batches, cfg.batch_size, cfg.seq_len)
        # Fails early when a shard can't hold a window (non_iid with too little data).
        data_lib.worker_shards(
            doc_starts, len(train_tokens), cfg.workers, cfg.sharding, cfg.seq_len
        )
    except ValueError as e:
        raise ConfigError(f"--data {cfg.data}: {e}") from None
    info = dict(
        source.info,
        train_documents=len(train_docs),
        val_documents=len(val_docs),
        train_tokens=int(len(train_tokens)),
        val_tokens=int(len(val_tokens)),
        tokenizer=tokenizer.info,
        eval_tokens=int(evals["targets"].size),
        eval_bytes=int(tokenizer.byte_lengths[evals["targets"]].sum()),
    )
    evals = {k: np.asarray(v) for k, v in evals.items()}
    return Corpus(train_tokens, doc_starts, evals, info)


def sample_windows(batch_size: int, seq_len: int, arrays, round_index, worker, step, mine=None):
    """A `Sampler` function: B random windows of L + 1 tokens from worker `worker`'s shard,
    keyed by (round, worker, step). The shard is `arrays["tokens"]` from `arrays["starts"]`
    (every worker reading one stream), or with `mine` its own stream `mine["tokens"]` from 0;
    `arrays["lengths"]` holds each shard's length and `arrays["key"]` the base key."""
    key = data_lib.batch_key(arrays["key"], round_index, worker, step)
    tokens, start = (
        (arrays["tokens"], arrays["starts"][worker])
        if mine is None
        else (mine["tokens"], jnp.int32(0))
    )
    return data_lib.sample_batch(tokens, start, arrays["lengths"][worker], key, batch_size, seq_len)


def make_sampler(cfg: RunConfig, corpus: Corpus, num_workers: int, salt: int) -> Sampler:
    """In-graph windows of the train stream for `num_workers` workers (cfg.sharding), keyed by
    (seed, salt, round, worker, step). "iid": one stream every worker reads; "non_iid": each
    worker's shard is its row of `worker_arrays` (zero-padded to the longest, never read),
    stored on its own devices only. Under cfg.mesh each stream is split over a worker's
    devices (all its non-worker axes), so a device holds 1 / (their size) of it. The draws
    are the same tokens in every layout."""
    starts, lengths = data_lib.worker_shards(
        corpus.doc_starts, len(corpus.train_tokens), num_workers, cfg.sharding, cfg.seq_len
    )
    sample = functools.partial(sample_windows, cfg.batch_size, cfg.seq_len)
    arrays = {
        "starts": jnp.asarray(starts),
        "lengths": jnp.asarray(lengths),
        "key": jax.random.fold_in(jax.random.key(cfg.seed), salt),
    }
    inside = [] if cfg.mesh is None else [
        (name, size) for name, size in mesh_axes(cfg, num_workers) if name != WORKER_AXIS
    ]  # fmt: skip
    within = math.prod(size for _, size in inside)
    stream = P(tuple(name for name, _ in inside)) if inside else P()
    if cfg.sharding == "iid" or num_workers == 1:
        arrays["tokens"] = _padded(corpus.train_tokens, within)
        specs = {name: stream if name == "tokens" else P() for name in arrays}
        return Sampler(arrays, sample, sharding=specs)
    rows = [corpus.train_tokens[s : s + n] for s, n in zip(starts, lengths, strict=True)]
    width = -(-max(len(r) for r in rows) // within) * within
    tokens_MxN = np.zeros((num_workers, width), corpus.train_tokens.dtype)
    for m, row in enumerate(rows):
        tokens_MxN[m, : len(row)] = row
    return Sampler(arrays, sample, worker_arrays={"tokens": tokens_MxN}, worker_sharding=stream)


def _padded(tokens_N: np.ndarray, multiple: int) -> np.ndarray:
    """tokens_N zero-padded at the end to a multiple of `multiple` (the pad is never read:
    windows stay inside each shard)."""
    pad = -len(tokens_N) % multiple
    return np.concatenate([tokens_N, np.zeros(pad, tokens_N.dtype)]) if pad else tokens_N


def make_eval_fn(loss_fn: Callable, corpus: Corpus) -> Callable[[Any], dict[str, jax.Array]]:
    """params -> {"eval_loss": mean loss over the fixed eval batches} (nats per token).
    `loss_fn` returns the loss, or (loss, aux) like `init_model`'s (the aux is not used)."""
    evals = jax.tree.map(jnp.asarray, corpus.eval_batches)

    def batch_loss(params, batch):
        out = loss_fn(params, batch)
        return out[0] if isinstance(out, tuple) else out

    def eval_fn(params):
        losses = jax.lax.map(lambda batch: batch_loss(params, batch), evals)
        return {"eval_loss": jnp.mean(losses)}

    return eval_fn


def check_model(cfg: RunConfig) -> dict[str, str]:
    """The attention and embedding implementations cfg's model uses on this machine's first
    device: {"attention": "xla" | "cudnn", "embedding": "gather" | "onehot"}. Raises
    ConfigError when the run asks for one that can't run here (e.g. cudnn on a CPU)."""
    model_cfg = model_config(cfg)
    try:
        return {
            "attention": model_lib.attention_implementation(model_cfg),
            "embedding": model_lib.embedding_implementation(model_cfg),
        }
    except ValueError as e:
        raise ConfigError(str(e)) from None


def make_mesh(cfg: RunConfig, num_workers: int) -> jax.sharding.Mesh | None:
    """The device mesh of a run of `num_workers` workers under cfg.mesh (None without one):
    cfg.mesh's axes in its order, the "workers" axis resized to `num_workers`
    (`config.mesh_axes`), over the first product-of-sizes devices of `jax.devices()`, every
    axis `AxisType.Auto`. ConfigError naming --mesh when there are too few devices."""
    if cfg.mesh is None:
        return None
    axes = mesh_axes(cfg, num_workers)
    names = tuple(name for name, _ in axes)
    sizes = tuple(size for _, size in axes)
    devices = jax.devices()
    count = math.prod(sizes)
    if count > len(devices):
        raise ConfigError(
            f"--mesh {format_mesh(axes)} needs {count} devices, there are {len(devices)} "
            f"({devices[0].platform})"
        )
    return jax.sharding.Mesh(
        np.asarray(devices[:count], dtype=object).reshape(sizes),
        names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(names),
    )


def check_memory(cfg: RunConfig, algos: tuple[str, ...]) -> None:
    """Whether the runs of `algos` ("diloco", "sync", "async") with cfg.workers workers can fit
    the memory of the devices they run on, before anything is allocated: ConfigError naming
    --workers when even a lower bound of what they allocate does not (each DiLoCo or async
    worker's params and inner optimizer state, every worker's logits of one step), or when
    the backend can't place that many workers."""
    model_cfg = model_config(cfg)
    params = jax.eval_shape(model_lib.init_params, model_cfg, jax.random.key(0))
    per_worker = limits.nbytes(params) + limits.nbytes(
        jax.eval_shape(inner_optimizer(cfg).init, params)
    )
    logits = cfg.batch_size * cfg.seq_len * model_cfg.vocab_size * jnp.dtype(cfg.dtype).itemsize
    copies = cfg.workers if any(algo != "sync" for algo in algos) else 1
    try:
        mesh = make_mesh(cfg, cfg.workers)
        devices = list(mesh.devices.flat) if mesh is not None else None
        if devices is None:
            devices = make_backend(cfg.backend, cfg.workers).devices
        limits.check_fits(
            f"--workers {cfg.workers} (each worker's params and optimizer state, and one step's "
            f"logits of --batch-size {cfg.batch_size} x --seq-len {cfg.seq_len})",
            copies * per_worker + cfg.workers * logits,
            devices,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_mesh(cfg: RunConfig) -> None:
    """Whether cfg.mesh can run here, before anything is written: enough devices for the run's
    mesh. ConfigError naming --mesh otherwise."""
    if cfg.mesh is not None:
        make_mesh(cfg, cfg.workers)


def mesh_options(
    cfg: RunConfig,
    model_cfg: model_lib.ModelConfig,
    params: Any,
    num_workers: int,
) -> dict[str, Any]:
    """The trainer keywords that shard `num_workers` workers over cfg.mesh: `mesh`,
    `worker_axis` and `param_sharding` (`model.param_specs` over the non-worker axes; each
    worker's batch takes the trainer's default, its leading dim over every non-worker axis).
    {} without cfg.mesh, so a run without one passes exactly what it did before."""
    mesh = make_mesh(cfg, num_workers)
    if mesh is None:
        return {}
    within = {name: size for name, size in mesh.shape.items() if name != WORKER_AXIS}
    return dict(
        mesh=mesh,
        worker_axis=WORKER_AXIS,
        param_sharding=model_lib.param_specs(model_cfg, params, within),
    )


def init_model(cfg: RunConfig) -> tuple[model_lib.ModelConfig, Any, Callable]:
    """(model config, initial params, loss_fn) for cfg.model with cfg's dtypes, attention and
    embedding, seeded by cfg.seed. loss_fn(params, batch) -> (loss, aux), the trainers'
    `has_aux=True` form: aux is `model.metrics` of the batch (e.g. "accuracy"), which every
    history entry then holds like the loss."""
    model_cfg = model_config(cfg)
    params = model_lib.init_params(model_cfg, jax.random.key(cfg.seed))
    return model_cfg, params, model_lib.make_loss_fn(model_cfg, has_aux=True)


def aux_names(cfg: RunConfig) -> tuple[str, ...]:
    """The names of the aux metrics `init_model`'s loss_fn returns (its output's shape, traced
    without computing anything): the train metrics each history entry holds beside "loss"."""
    model_cfg = model_config(cfg)
    params = jax.eval_shape(model_lib.init_params, model_cfg, jax.random.key(0))
    batch = {k: jax.ShapeDtypeStruct((1, 1), jnp.int32) for k in ("inputs", "targets")}
    _, aux = jax.eval_shape(model_lib.make_loss_fn(model_cfg, has_aux=True), params, batch)
    return tuple(aux)


def _recorder(
    cfg: RunConfig,
    corpus: Corpus,
    name: str,
    num_workers: int,
    on_record: Callable[[Record], None] | None,
) -> Callable[[Record], None]:
    """A train_* callback that tags each history entry with the run, its token count, the
    throughput so far ("tokens_per_second" of all workers and "mfu", as in the summary but up
    to this entry) and, where evaluated, "eval_bits_per_byte"."""
    start = time.perf_counter()
    flops_per_token = model_lib.flops_per_token(model_config(cfg), cfg.seq_len)
    peak = peak_flops(cfg, num_workers)

    def record(entry: Record) -> None:
        steps = entry.get("steps")  # Decoupled DiLoCo's syncs have total_steps only
        if "total_steps" in entry:  # async: jobs differ in length; the mean over workers
            steps = entry["steps_per_worker"] = entry["total_steps"] / num_workers
        entry.update(
            run=name,
            workers=num_workers,
            wall_seconds=time.perf_counter() - start,
            tokens_per_worker=round(steps * cfg.batch_size * cfg.seq_len),
        )
        tokens_per_second = entry["tokens_per_worker"] * num_workers / entry["wall_seconds"]
        entry.update(
            tokens_per_second=tokens_per_second,
            mfu=mfu_lib.mfu(flops_per_token, tokens_per_second, peak),
        )
        if "eval_loss" in entry:
            entry["eval_bits_per_byte"] = bits_per_byte(
                entry["eval_loss"], corpus.eval_bytes_per_token
            )
        if on_record is not None:
            on_record(entry)

    return record


def run(
    cfg: RunConfig,
    corpus: Corpus,
    algo: str,
    num_workers: int,
    *,
    params: Any = None,
    name: str | None = None,
    on_record: Callable[[Record], None] | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 1,
    eval_every: int = 1,
    checkpoint_fingerprint: dict[str, Any] | None = None,
) -> tuple[Record, list[Record]]:
    """Trains one run from `params` (default: a fresh init) and returns (summary, history).

    algo "diloco": M = num_workers workers, H = cfg.inner_steps, R = cfg.rounds.
    algo "sync": M = num_workers workers averaging gradients every step, for H x R steps,
    evaluated every H steps (the same points as DiLoCo's rounds). `eval_every` > 1 evaluates
    every that many rounds (H x that many steps for sync; async ignores it) instead, and
    always at the end.
    algo "async": asynchronous DiLoCo (`train_async`) on the simulated clock of
    cfg.step_seconds (cfg.dynamic_steps: DyLU), each arriving delta applied with the outer
    optimizer, for as many server updates as it takes to match DiLoCo's total inner steps
    (M x H x R summed over workers: equal compute and tokens), evaluated every M updates;
    cfg.server (`config.server_of`) is `train_async`'s other server: Decoupled DiLoCo (as
    many syncs as it takes for the learners' steps to reach that total) or HALoS.
    Every history entry gets "run", "workers", "tokens_per_worker", "wall_seconds", the train
    metrics of `init_model`'s loss ("accuracy" beside "loss"; "worker_accuracy" too, except
    for async) and, where evaluated, "eval_loss". The summary's throughput fields cover the
    whole call (compiles and evaluations included): "tokens_per_second" (all workers),
    "model_flops_per_token"
    (`model.flops_per_token` at cfg.seq_len), "peak_flops" (`mfu.peak_flops` for cfg.dtype on
    the devices the workers use) and "mfu" (None where no peak is known). With
    `checkpoint_dir`, the run checkpoints every `checkpoint_every` rounds (steps for sync, M
    updates for async) and resumes from a checkpoint found there; `checkpoint_fingerprint`
    (JSON-able, e.g. the CLI's `run_identity`) is saved in every checkpoint and must match on
    resume. With cfg.mesh the workers
    run on `make_mesh(cfg, num_workers)`, each partitioned by
    `model.param_specs` (`mesh_options`); without it the trainers get no mesh keyword at all.
    """
    name = name or algo
    if cfg.server is not None and algo != "async":  # an option the run would not use
        raise ConfigError(f"server {cfg.server!r} is train_async's: it needs algo 'async'")
    model_cfg, init_params, loss_fn = init_model(cfg)
    params = init_params if params is None else params
    # async draws DiLoCo's stream: job j of worker m sees round j's batches of worker m.
    sampler = make_sampler(cfg, corpus, num_workers, salt=1 if algo == "sync" else 0)
    start = time.perf_counter()
    common = dict(
        num_workers=num_workers,
        backend=cfg.backend,
        has_aux=True,
        eval_fn=make_eval_fn(loss_fn, corpus),
        callback=_recorder(cfg, corpus, name, num_workers, on_record),
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        **_fingerprint_option(checkpoint_fingerprint),
    )
    if algo == "diloco":
        result = train_diloco(
            loss_fn,
            params,
            sampler,
            num_rounds=cfg.rounds,
            inner_steps=cfg.inner_steps,
            method=method(cfg),
            eval_every=cfg.inner_steps * eval_every,
            shard_outer_over_workers=cfg.shard_outer_over_workers,
            outer_state_memory=cfg.outer_state_memory,
            **common,
            **mesh_options(cfg, model_cfg, params, num_workers),
        )
    elif algo == "sync":
        common["checkpoint_every"] = checkpoint_every * cfg.inner_steps
        result = train_sync(
            loss_fn,
            params,
            sampler,
            num_steps=cfg.total_steps,
            optimizer=inner_optimizer(cfg),
            eval_every=cfg.inner_steps * eval_every,
            **common,
            **mesh_options(cfg, model_cfg, params, num_workers),
        )
    elif algo == "async":
        mesh = mesh_options(cfg, model_cfg, params, num_workers)
        result, seconds = _run_async(cfg, loss_fn, params, sampler, num_workers, common, mesh)
    else:
        raise ConfigError(f"algo must be one of 'diloco', 'sync', 'async', got {algo!r}")
    history = result.history
    summary = _summary(cfg, model_cfg, algo, num_workers, params, history, start)
    if algo == "async":
        summary.update(
            server="one" if cfg.server is None else cfg.server,
            step_seconds=list(seconds),
            dynamic_steps=cfg.dynamic_steps,
            job_steps=sorted({h["steps"] for h in history if "steps" in h}, reverse=True),
            simulated_seconds=result.elapsed_seconds,
            utilization=result.utilization,
        )
    return summary, history


def _summary(
    cfg: RunConfig, model_cfg: Any, algo: str, num_workers: int, params: Any,
    history: list[Record], start: float,
) -> Record:  # fmt: skip
    """A run's summary from its history (`run`'s docstring): its setup, final losses, bytes,
    tokens, wall seconds since `start` and throughput."""
    final = [h for h in history if "eval_loss" in h][-1]
    last = history[-1]
    summary = {
        "algo": algo,
        "workers": num_workers,
        "inner_steps": cfg.inner_steps if algo != "sync" else 1,
        "outer": _outer_label(cfg) if algo != "sync" else "-",
        "inner": cfg.inner_optimizer,
        "sharding": cfg.sharding if num_workers > 1 else "-",
        "compression": {"diloco": cfg.compression, "async": "none"}.get(algo, "-"),
        "steps_per_worker": last["steps_per_worker"]
        if "steps_per_worker" in last
        else last["steps"],
        "communication_rounds": {"diloco": cfg.rounds, "async": len(history)}.get(
            algo, cfg.total_steps if num_workers > 1 else 0
        ),
        "final_eval_loss": final["eval_loss"],
        "final_eval_ppl": math.exp(final["eval_loss"]),
        "final_eval_bits_per_byte": final["eval_bits_per_byte"],
        "final_train_loss": last["loss"],
        "bytes_communicated": last["bytes_communicated"],
        "wire_bytes": last["wire_bytes"],
        "tokens_per_worker": last["tokens_per_worker"],
        "tokens_seen": last["tokens_per_worker"] * num_workers,
        "wall_seconds": time.perf_counter() - start,
        "num_params": model_lib.count_params(params),
    }
    if "wire_bytes_per_device" in last:  # on a mesh: what each device sends of its shards
        summary["wire_bytes_per_device"] = last["wire_bytes_per_device"]
    summary.update(throughput(cfg, model_cfg, num_workers, summary))
    return summary


def _run_async(
    cfg: RunConfig, loss_fn, params, sampler, num_workers: int, common: dict, mesh: dict
):  # fmt: skip
    """train_async for as many updates as it takes to reach DiLoCo's M x H x R inner steps
    (summed over workers), with `mesh` (`mesh_options`) and cfg's server. Returns (result,
    step_seconds)."""
    server = server_of(cfg)
    seconds = cfg.step_seconds or (1.0,) * num_workers
    if len(seconds) != num_workers:
        raise ConfigError(f"step_seconds must hold {num_workers} numbers, got {seconds!r}")
    if cfg.backend not in ("auto", "vmap"):
        raise ConfigError(f"algo 'async' runs on backend auto or vmap, got {cfg.backend!r}")
    budget = num_workers * cfg.total_steps
    num_updates = _updates_for(cfg, seconds, budget, server)
    extra = {} if server is None else {"server": server}
    result = train_async(
        loss_fn,
        params,
        sampler,
        num_workers=num_workers,
        inner_steps=cfg.inner_steps,
        num_updates=num_updates,
        step_seconds=seconds,
        dynamic_steps=cfg.dynamic_steps,
        inner_optimizer=inner_optimizer(cfg),
        outer_optimizer=outer_optimizer(cfg),
        eval_fn=common["eval_fn"],
        eval_every=cfg.inner_steps,  # in steps per worker: about M updates
        callback=common["callback"],
        checkpoint_dir=common["checkpoint_dir"],
        checkpoint_every=common["checkpoint_every"] * num_workers,  # about M updates a round
        has_aux=common["has_aux"],
        **_fingerprint_option(common.get("checkpoint_fingerprint")),
        **mesh,
        **extra,
    )
    return result, seconds


def _updates_for(cfg: RunConfig, seconds, budget: int, server: Any) -> int:
    """The server updates after which the workers have run `budget` inner steps in all: jobs
    applied (one server, HALoS), or syncs by whose time the learners have (Decoupled)."""
    steps = (
        dynamic_local_steps(seconds, cfg.inner_steps)
        if cfg.dynamic_steps
        else (cfg.inner_steps,) * len(seconds)
    )
    if isinstance(server, DecoupledDiLoCo):
        # The learners reach `budget` steps by t = budget / sum(1 / s); each fragment syncs
        # no sooner than every H steps of the fastest learner.
        until = budget / sum(1 / s for s in seconds)
        count = server.fragments * (math.ceil(until / (cfg.inner_steps * min(seconds))) + 2)
        for u, sync in enumerate(server.schedule(seconds, cfg.inner_steps, count)):
            if sum(steps_by(sync.time, s) for s in seconds) >= budget:
                return u + 1
        return count
    if isinstance(server, HALoS):
        ends = server.arrivals(seconds, steps, budget)
    else:  # every job takes >= 1 step, so `budget` updates always reach the budget
        ends = [(e.time, e.worker) for e in async_schedule(
            seconds, cfg.inner_steps, budget, dynamic_steps=cfg.dynamic_steps).events]  # fmt: skip
    done = 0
    for u, (_, worker) in enumerate(ends):
        done += steps[worker]
        if done >= budget:
            return u + 1
    return len(ends)


def _fingerprint_option(fingerprint: dict[str, Any] | None) -> dict[str, Any]:
    """The trainers' `checkpoint_fingerprint` keyword when there is one (none otherwise)."""
    return {} if fingerprint is None else {"checkpoint_fingerprint": fingerprint}


def _outer_label(cfg: RunConfig) -> str:
    """e.g. "nesterov 0.7", "nesterov 0.7, delay 1", "nesterov 0.7, eager 2"."""
    label = f"{cfg.outer_optimizer} {cfg.resolved_outer_lr:g}"
    if cfg.outer_optimizer in MOMENTUM_OPTIMIZERS and cfg.outer_momentum != 0.9:
        label += f" (momentum {cfg.outer_momentum:g})"
    if cfg.age_decay is not None:
        cutoff = "" if cfg.age_cutoff is None else f", cutoff {cfg.age_cutoff:g}"
        label += f" (age decay {cfg.age_decay:g}{cutoff})"
    if cfg.gasloc is not None:
        label += f", gasloc {cfg.gasloc} in groups of {cfg.gossip_group_size or 2}"
    elif cfg.gossip_group_size is not None:
        label += f", noloco groups of {cfg.gossip_group_size}"
    if cfg.outer_delay:
        label += f", {'eager' if cfg.eager else 'delay'} {cfg.outer_delay}"
    return label


def throughput(
    cfg: RunConfig, model_cfg: model_lib.ModelConfig, num_workers: int, summary: Record
) -> Record:
    """A run's tokens/s, model FLOPs per token, peak FLOP/s of the devices its workers use
    (make_backend's choice for cfg.backend) and MFU."""
    tokens_per_second = summary["tokens_seen"] / summary["wall_seconds"]
    flops_per_token = model_lib.flops_per_token(model_cfg, cfg.seq_len)
    peak = peak_flops(cfg, num_workers)
    return {
        "tokens_per_second": tokens_per_second,
        "model_flops_per_token": flops_per_token,
        "devices": num_devices(cfg, num_workers),
        "peak_flops": peak,
        "mfu": mfu_lib.mfu(flops_per_token, tokens_per_second, peak),
    }


def num_devices(cfg: RunConfig, num_workers: int) -> int:
    """The devices `num_workers` workers use: their mesh's (`make_mesh`) under cfg.mesh, else
    make_backend's choice for cfg.backend."""
    mesh = make_mesh(cfg, num_workers)
    if mesh is not None:
        return mesh.size
    return len(make_backend(cfg.backend, num_workers).devices)


def peak_flops(cfg: RunConfig, num_workers: int) -> float | None:
    """`mfu.peak_flops` for cfg.dtype on the devices `num_workers` workers use
    (`num_devices`)."""
    return mfu_lib.peak_flops(cfg.dtype, num_devices=num_devices(cfg, num_workers))


def pretrain(
    cfg: RunConfig,
    corpus: Corpus,
    on_record: Callable[[Record], None] | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_fingerprint: dict[str, Any] | None = None,
) -> tuple[Any, list[Record]]:
    """The shared warm start: (params, history) after `cfg.pretrain_steps` steps of one worker
    from a fresh init (unchanged, with no history, when 0). Its records carry run "pretrain"
    and are not part of any compared run's budget. With cfg.mesh the one worker is partitioned
    as each run's are, on the mesh with a workers axis of 1. `checkpoint_fingerprint` as in
    `run`."""
    model_cfg, params, loss_fn = init_model(cfg)
    if cfg.pretrain_steps == 0:
        return params, []
    result = train_sync(
        loss_fn,
        params,
        make_sampler(cfg, corpus, 1, salt=2),
        num_steps=cfg.pretrain_steps,
        num_workers=1,
        optimizer=pretrain_optimizer(cfg),
        backend=cfg.backend,
        eval_fn=make_eval_fn(loss_fn, corpus),
        eval_every=cfg.pretrain_steps,
        callback=_recorder(cfg, corpus, "pretrain", 1, on_record),
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=cfg.pretrain_steps,
        has_aux=True,
        **_fingerprint_option(checkpoint_fingerprint),
        **mesh_options(cfg, model_cfg, params, 1),  # one worker, partitioned alike
    )
    return result.params, result.history


def describe(cfg: RunConfig, corpus: Corpus) -> str:
    """One line for the console: model size, precision and data."""
    model_cfg = model_config(cfg)
    shapes = jax.eval_shape(model_lib.init_params, model_cfg, jax.random.key(0))
    info = corpus.info
    return (
        f"model {cfg.model}: {model_lib.count_params(shapes):,} parameters ({cfg.param_dtype} "
        f"params, {cfg.dtype} compute); data {info['spec']}: "
        f"{info['num_documents']:,} documents, {info['train_tokens']:,} train / "
        f"{info['val_tokens']:,} eval tokens ({cfg.sharding})"
        + ("" if cfg.tokenizer == "bytes" else f"; tokenizer {cfg.tokenizer}")
        + ("" if cfg.mesh is None else f"; mesh {format_mesh(cfg.mesh)}")
    )


def config_record(cfg: RunConfig, corpus: Corpus, **extra: Any) -> dict[str, Any]:
    """What a run folder's config.json holds: the config, the data and the environment."""
    model_cfg = model_config(cfg)
    shapes = jax.eval_shape(model_lib.init_params, model_cfg, jax.random.key(0))
    return {
        "config": dataclasses.asdict(cfg),
        "outer_lr": cfg.resolved_outer_lr,
        "model": dataclasses.asdict(model_cfg),
        "num_params": model_lib.count_params(shapes),
        "data": corpus.info,
        "tokenizer": corpus.info["tokenizer"],
        "jax_version": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "implementations": check_model(cfg),
        **extra,
    }

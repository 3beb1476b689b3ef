"""Run configurations for the language-model experiments: presets and validation.

A config is a frozen dataclass; `make_config(preset, **overrides)` returns a checked one.
"""

import dataclasses
import math
import sys
from typing import Any

import optax

from diloco_jax import limits, offload
from diloco_jax.cgad_outer import adam_decay, cgad
from diloco_jax.checks import check_number
from diloco_jax.decoupled import DecoupledDiLoCo
from diloco_jax.delayed_nesterov_outer import delayed_nesterov
from diloco_jax.halos import HALoS
from diloco_jax.heloco_outer import heloco
from diloco_jax.lm.tokenizer import parse_spec
from diloco_jax.method import DiLoCo, method_from_options
from diloco_jax.optimizers import muon_inner_optimizer
from diloco_jax.schedule import check_schedule

SHARDINGS = ("iid", "non_iid")
OUTER_OPTIMIZERS = (
    "nesterov",
    "heavy_ball",
    "sgd",
    "adam",
    "delayed_nesterov",
    "cgad",
    "adam_decay",
    "heloco",
)
INNER_OPTIMIZERS = ("adamw", "muon")
ALGOS = ("diloco", "sync", "async")
# Compute and parameter dtypes the CLI offers (the model also takes float16, on GPUs only and
# without loss scaling, so it is left to library users).
DTYPES = ("float32", "bfloat16")
# The outer learning rate each outer optimizer gets unless one is given: the paper's
# Nesterov(0.7, 0.9); plain SGD at 1.0 is parameter averaging (FedAvg); Adam rescales the
# delta per coordinate, so it wants a step of the inner learning rate's order.
DEFAULT_OUTER_LR = {
    "nesterov": 0.7,
    "heavy_ball": 0.7,
    "sgd": 1.0,
    "adam": 1e-3,
    "delayed_nesterov": 0.7,
    "cgad": 1e-3,
    "adam_decay": 1e-3,
    "heloco": 0.7,
}
# Outer rules that scale each delta by its age's gate (diloco_jax.cgad_outer): age_decay, and for
# cgad age_cutoff, set the gate.
AGE_GATED_OPTIMIZERS = ("cgad", "adam_decay")


def _tuple_of(kind: type) -> Any:
    """A parser of "a/b/c" as (kind(a), kind(b), kind(c)) (ValueError when one isn't)."""
    return lambda text: tuple(kind(x) for x in text.split("/"))


def _number_or_tuple(text: str) -> float | tuple[float, ...]:
    """ "x" as a float, "a/b" as a tuple of floats (HALoS.region_seconds: one or per region)."""
    return _tuple_of(float)(text) if "/" in text else float(text)


# `RunConfig.server`'s parts (train_async's server=), each field by the parser of its value;
# a tuple's values are separated by "/" (HALoS's global_optimizer stays its default).
SERVERS: dict[str, tuple[type, dict[str, Any]]] = {
    "decoupled": (
        DecoupledDiLoCo,
        {
            "quorum": int,
            "grace_seconds": float,
            "adaptive_grace": float,
            "overlap_steps": int,
            "fragments": int,
            "merge": str,
            "average_leaves": _tuple_of(str),
            "tokens_per_step": _tuple_of(float),
        },
    ),
    "halos": (
        HALoS,
        {
            "regions": _tuple_of(int),
            "local_updates": int,
            "merge_weight": float,
            "worker_seconds": float,
            "region_seconds": _number_or_tuple,
        },
    ),
}
MOMENTUM_OPTIMIZERS = ("nesterov", "heavy_ball", "delayed_nesterov", "heloco")  # outer_momentum
# The mesh axis (`RunConfig.mesh`, --mesh) that holds the DiLoCo workers; every other axis
# partitions each worker (`diloco_jax.lm.model.param_specs` names "fsdp" and "tensor").
WORKER_AXIS = "workers"


class ConfigError(ValueError):
    """A user mistake in a run configuration (the CLI prints it as one line, exit code 2)."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One LM experiment. Steps per worker = inner_steps x rounds for every algorithm."""

    model: str = "tiny"  # a diloco_jax.lm.model preset
    # "bundled" (the package's 4 MB of Python source) | "stdlib" (the running Python's) |
    # "text:PATH" | "hf:NAME[:CONFIG[:SPLIT]]"
    data: str = "bundled"
    tokenizer: str = "bytes"  # "bytes" | "bpe:VOCAB" (diloco_jax.lm.tokenizer); sets the vocab
    max_bytes: int | None = 4_000_000  # read at most this many bytes of the source
    val_fraction: float = 0.05  # documents held out for evaluation
    sharding: str = "iid"  # "iid" | "non_iid"
    workers: int = 4  # M
    inner_steps: int = 25  # H
    rounds: int = 16  # R
    batch_size: int = 16  # sequences per worker per step
    seq_len: int = 128
    dtype: str = "float32"  # compute dtype: activations and matmuls (diloco_jax.lm.model)
    param_dtype: str = "float32"  # master weights, gradients, optimizer and DiLoCo state
    attention: str = "auto"  # "auto" | "xla" | "cudnn" (model.attention_implementation)
    embedding: str = "auto"  # "auto" | "gather" | "onehot" (model.embedding_implementation)
    # what a device holds, not what the model computes (model.ModelConfig's fields)
    remat: bool = False  # recompute each block's activations in the backward pass
    shard_activations: bool = False  # under --mesh: the residual's batch split over fsdp
    # every run starts from one shared checkpoint trained this many steps by a single worker,
    # as the paper starts from a 24k-step pretrained model; 0 starts from random init
    pretrain_steps: int = 500
    inner_lr: float = 3e-3  # AdamW peak, warmup then cosine decay over H x R steps
    warmup_steps: int = 20
    weight_decay: float = 0.1
    # "muon": MuLoCo's Muon (peak muon_lr, same schedule) on the hidden matrices; the
    # embedding and the norms keep AdamW at inner_lr
    inner_optimizer: str = "adamw"
    muon_lr: float = 0.02
    outer_optimizer: str = "nesterov"
    # of nesterov / heavy_ball / delayed_nesterov (MuLoCo's recipe: 0.6; NoLoCo's: heavy_ball
    # with 0.5)
    outer_momentum: float = 0.9
    outer_lr: float | None = None  # None: DEFAULT_OUTER_LR[outer_optimizer]
    eval_batches: int = 8
    compression: str = "none"  # how DiLoCo's deltas travel (diloco_jax.compression)
    drop_probability: float | None = None  # simulated communication drops (DiLoCo only)
    outer_delay: int = 0  # apply each round's mean d rounds late (diloco_jax.delay)
    eager: bool = False  # eager outer updates (needs outer_delay >= 1)
    outer_clip: float | None = None  # EDiT: clip the mean delta's norm (outer.clip_outer_norm)
    outer_state_dtype: str | None = None  # e.g. "bfloat16": the outer momentum stored in it
    weighting: str = "uniform"  # "uniform" | "norm_softmax" (EDiT; diloco_jax.faults)
    temperature: float = 1.0  # of weighting "norm_softmax": weights exp(-norm / temperature)
    anomaly_skip: bool = False  # EDiT's EWMA z-score skip of outlier workers
    state_sync: str | None = None  # DES-LOC, e.g. "mu=75,nu=150" (diloco_jax.state_sync)
    # NoLoCo: each worker averages with a random group of this many (diloco_jax.noloco)
    gossip_group_size: int | None = None
    # GASLoC instead of NoLoCo (diloco_jax.gasloc), e.g. "alpha=1,gamma=0.5": its gossip step
    # and momentum, in groups of gossip_group_size (2 when unset)
    gasloc: str | None = None
    fragments: int | None = None  # Streaming DiLoCo's P (diloco_jax.schedule); None: off
    overlap_steps: int = 0  # its tau
    merge_alpha: float = 0.0  # its alpha
    # async only: simulated seconds per inner step of each worker (None: 1.0 for every one),
    # and dynamic local updates (DyLU: fewer steps per job for slower workers)
    step_seconds: tuple[float, ...] | None = None
    dynamic_steps: bool = False
    # outer_optimizer "delayed_nesterov": its buffer N (None: the number of workers) and c
    dn_buffer: int | None = None
    dn_c: float = 0.0
    # outer_optimizer "cgad" / "adam_decay": the age gate's decay (both, >= 0) and cutoff
    # (cgad's, > 0), in outer updates (diloco_jax.cgad_outer)
    age_decay: float | None = None
    age_cutoff: float | None = None
    # async only: train_async's server part as "NAME[,field=value...]" (`server_of`), e.g.
    # "decoupled,quorum=2,grace_seconds=12.5" or "halos,regions=0/0/1/1,local_updates=2";
    # None: the one server
    server: str | None = None
    seed: int = 0
    backend: str = "auto"
    # a device mesh, ((axis name, size), ...) as --mesh workers=2,fsdp=2,tensor=2 writes it:
    # the "workers" axis (size `workers`) holds the DiLoCo / data-parallel workers and every
    # other axis partitions each of them (model.param_specs); None: the backend places them
    mesh: tuple[tuple[str, int], ...] | None = None
    # DiLoCo's θ and outer state: split over the workers (ZeRO-1), or in pinned host memory
    # between syncs (`train_diloco`'s options of the same names)
    shard_outer_over_workers: bool = False
    outer_state_memory: str = "device"

    @property
    def total_steps(self) -> int:
        return self.inner_steps * self.rounds

    @property
    def resolved_outer_lr(self) -> float:
        return DEFAULT_OUTER_LR[self.outer_optimizer] if self.outer_lr is None else self.outer_lr


# One H200 (141 GB) holding M = 4 workers in bf16 compute with float32 master weights:
# per-worker batches read from compiled memory (benchmarks/memory.py, "Accelerator settings"
# in benchmarks/README.md); the running Python's whole standard library (12 MB on 3.11, more
# than the bundled 4 MB) so eval batches of 1024-byte windows fit. 150m differs only in its
# model and batch. Not yet run on a GPU.
_H200_60M = RunConfig(
    model="60m",
    data="stdlib",
    max_bytes=None,
    workers=4,
    inner_steps=50,
    rounds=10,
    batch_size=32,
    seq_len=1024,
    dtype="bfloat16",
    pretrain_steps=200,
    inner_lr=4e-4,
    warmup_steps=50,
    eval_batches=4,
)

PRESETS: dict[str, RunConfig] = {
    # seconds: for tests and smoke runs
    "micro": RunConfig(
        model="micro",
        max_bytes=200_000,
        workers=2,
        inner_steps=4,
        rounds=2,
        batch_size=4,
        seq_len=32,
        pretrain_steps=2,
        warmup_steps=2,
        eval_batches=2,
    ),
    # under 3 minutes for `compare` on 2 CPU cores
    "quick": RunConfig(
        model="mini",
        max_bytes=2_000_000,
        workers=4,
        inner_steps=25,
        rounds=12,
        batch_size=16,
        seq_len=64,
        pretrain_steps=300,
        warmup_steps=10,
        eval_batches=8,
    ),
    # the README's main job: under 15 minutes for `compare` on 2 CPU cores
    "default": RunConfig(),
    "h200_60m": _H200_60M,
    "h200_150m": dataclasses.replace(_H200_60M, model="150m", batch_size=16),
    # The 1b model (1.0B parameters) with M = 2 workers on one H200, sized by arithmetic, not
    # yet measured: per worker 16 GB of float32 params, gradients and AdamW moments, and
    # about 11 GB of bf16 activations at batch 8 x 1024; 8 GB of outer params and momentum.
    # On 8 GPUs, `--mesh workers=2,fsdp=4` shards each worker over 4 of them.
    "h200_1b": dataclasses.replace(_H200_60M, model="1b", workers=2, batch_size=8, inner_lr=3e-4),
}


def make_config(preset: str = "default", **overrides: Any) -> RunConfig:
    """The preset with `overrides` (None values are ignored), validated. Raises ConfigError."""
    if preset not in PRESETS:
        raise ConfigError(f"--preset must be one of {sorted(PRESETS)}, got {preset!r}")
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = set(overrides) - fields
    if unknown:
        raise ConfigError(f"unknown config fields: {sorted(unknown)}")
    cfg = dataclasses.replace(
        PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}
    )
    validate(cfg)
    return cfg


def _check_types(cfg: RunConfig) -> None:
    """Every field has its declared type (bool is not a number here; ints pass as floats)."""
    for field in dataclasses.fields(RunConfig):
        value = getattr(cfg, field.name)
        declared = field.type.__name__ if isinstance(field.type, type) else str(field.type)
        if value is None and "None" in declared:
            continue
        if declared == "bool":
            ok = isinstance(value, bool)
        elif isinstance(value, bool):
            ok = False
        elif declared.startswith("tuple[tuple[str, int]"):
            ok = isinstance(value, tuple) and all(
                isinstance(pair, tuple)
                and len(pair) == 2
                and isinstance(pair[0], str)
                and isinstance(pair[1], int)
                and not isinstance(pair[1], bool)
                for pair in value
            )
        elif declared.startswith("tuple[float"):
            ok = isinstance(value, tuple) and all(
                isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
                for x in value
            )
        elif declared.startswith("int"):
            ok = isinstance(value, int)
        elif declared.startswith("float"):
            ok = isinstance(value, int | float) and math.isfinite(value)
        else:
            ok = isinstance(value, str)
        if not ok:
            raise ConfigError(
                f"{field.name} must be {declared.replace(' | ', ' or ')}, got {value!r}"
            )


def validate(cfg: RunConfig) -> None:
    """Raises ConfigError naming the first bad field."""
    _check_types(cfg)
    _check_counts(cfg)
    _check_model(cfg)
    _check_optimizers(cfg)
    _check_method(cfg)


def _at_least(cfg: RunConfig, name: str, minimum: int) -> None:
    if getattr(cfg, name) < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {getattr(cfg, name)!r}")


def _check_counts(cfg: RunConfig) -> None:
    """The sizes and counts: each at its least, and within what holds it."""
    for name in ("workers", "inner_steps", "rounds", "batch_size", "seq_len", "eval_batches"):
        _at_least(cfg, name, 1)
    for name in ("warmup_steps", "pretrain_steps", "seed"):
        _at_least(cfg, name, 0)
    if cfg.max_bytes is not None:
        _at_least(cfg, "max_bytes", 1)
    _check_bounds(cfg)


def _check_model(cfg: RunConfig) -> None:
    """The model preset, its context, dtypes and kernels, and the tokenizer."""
    from diloco_jax.lm.model import ATTENTIONS, EMBEDDINGS
    from diloco_jax.lm.model import PRESETS as MODELS

    if cfg.model not in MODELS:
        raise ConfigError(f"model must be one of {sorted(MODELS)}, got {cfg.model!r}")
    if cfg.seq_len > MODELS[cfg.model].seq_len:
        raise ConfigError(
            f"seq_len={cfg.seq_len} exceeds model {cfg.model!r} context {MODELS[cfg.model].seq_len}"
        )
    for name, choices in (
        ("dtype", DTYPES),
        ("param_dtype", DTYPES),
        ("attention", ATTENTIONS),
        ("embedding", EMBEDDINGS),
    ):
        if getattr(cfg, name) not in choices:
            raise ConfigError(f"{name} must be one of {choices}, got {getattr(cfg, name)!r}")
    try:
        parse_spec(cfg.tokenizer)
        model_config(cfg)
    except ValueError as e:  # combinations the model refuses, e.g. cudnn with float32
        raise ConfigError(str(e)) from None


def _check_optimizers(cfg: RunConfig) -> None:
    """The data regime, the backend, the inner and outer optimizers and their options, the
    simulated clock's step times, and the server part."""
    from diloco_jax.workers import BACKENDS

    if cfg.sharding not in SHARDINGS:
        raise ConfigError(f"sharding must be one of {SHARDINGS}, got {cfg.sharding!r}")
    if cfg.outer_optimizer not in OUTER_OPTIMIZERS:
        raise ConfigError(
            f"outer_optimizer must be one of {OUTER_OPTIMIZERS}, got {cfg.outer_optimizer!r}"
        )
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {cfg.backend!r}")
    if not cfg.inner_lr > 0:
        raise ConfigError(f"inner_lr must be a finite number > 0, got {cfg.inner_lr!r}")
    if cfg.inner_optimizer not in INNER_OPTIMIZERS:
        raise ConfigError(
            f"inner_optimizer must be one of {INNER_OPTIMIZERS}, got {cfg.inner_optimizer!r}"
        )
    if not cfg.muon_lr > 0:
        raise ConfigError(f"muon_lr must be a finite number > 0, got {cfg.muon_lr!r}")
    if cfg.weight_decay < 0:
        raise ConfigError(f"weight_decay must be a finite number >= 0, got {cfg.weight_decay!r}")
    if not cfg.resolved_outer_lr > 0:
        raise ConfigError(f"outer_lr must be a finite number > 0, got {cfg.outer_lr!r}")
    if not 0 < cfg.val_fraction < 1:
        raise ConfigError(f"val_fraction must be in (0, 1), got {cfg.val_fraction!r}")
    if cfg.step_seconds is not None and (
        len(cfg.step_seconds) != cfg.workers or not all(s > 0 for s in cfg.step_seconds)
    ):
        raise ConfigError(
            f"step_seconds must be {cfg.workers} numbers > 0 (one per worker), "
            f"got {cfg.step_seconds!r}"
        )
    if cfg.dn_buffer is not None:
        _at_least(cfg, "dn_buffer", 1)
    if cfg.dn_c < 0:
        raise ConfigError(f"dn_c must be a finite number >= 0, got {cfg.dn_c!r}")
    if (cfg.dn_buffer is not None or cfg.dn_c) and cfg.outer_optimizer != "delayed_nesterov":
        raise ConfigError("dn_buffer and dn_c apply to outer_optimizer 'delayed_nesterov' only")
    _check_age_gate(cfg)
    if cfg.server is not None:
        _check_server(cfg)
    if not 0 <= cfg.outer_momentum < 1:
        raise ConfigError(f"outer_momentum must be in [0, 1), got {cfg.outer_momentum!r}")
    if cfg.outer_momentum != 0.9 and cfg.outer_optimizer not in MOMENTUM_OPTIMIZERS:
        raise ConfigError(
            "outer_momentum applies to outer_optimizer 'nesterov', 'heavy_ball', "
            f"'delayed_nesterov' or 'heloco' only, got {cfg.outer_optimizer!r}"
        )


def _check_method(cfg: RunConfig) -> None:
    """The method's parts, by the library's own spec, and the mesh."""
    if cfg.state_sync is not None:
        state_sync_of(cfg)
        if cfg.inner_optimizer != "adamw":
            raise ConfigError("state_sync averages AdamW's moments: it needs inner_optimizer adamw")
    if cfg.weighting not in ("uniform", "norm_softmax"):
        raise ConfigError(f"weighting must be 'uniform' or 'norm_softmax', got {cfg.weighting!r}")
    if not isinstance(cfg.shard_outer_over_workers, bool):
        raise ConfigError(
            f"shard_outer_over_workers must be True or False, got {cfg.shard_outer_over_workers!r}"
        )
    try:  # the method's own rules, from the library's spec (checked once, there)
        offload.check_memory(cfg.outer_state_memory)
        spec = method(cfg)
        if spec.schedule is not None:
            check_schedule(cfg.fragments, cfg.inner_steps, cfg.overlap_steps)
        if spec.gossip is not None:  # its groups need M a power of 2
            spec.gossip.check_run(None, cfg.workers, cfg.inner_steps, None)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.mesh is not None:
        _validate_mesh(cfg)
    elif cfg.shard_activations:
        raise ConfigError(
            "--shard-activations splits the batch over a --mesh's fsdp axis: give one"
        )


# The largest value of each integer field: what the arrays and counters it ends up in hold
# (int32 step counters and token ids, a 32-bit PRNG seed, a read size in a C ssize_t).
_INT_FIELD_MAX = {
    "seed": limits.SEED_MAX,
    "max_bytes": sys.maxsize,
}


def _check_bounds(cfg: RunConfig) -> None:
    """Every integer field within what it is stored in (`_INT_FIELD_MAX`, else int32), the
    steps of a run (H x R) and the tokens of a batch (B x L) within an int32."""
    for field in dataclasses.fields(RunConfig):
        value = getattr(cfg, field.name)
        if isinstance(value, int) and not isinstance(value, bool):
            maximum = _INT_FIELD_MAX.get(field.name, limits.INT32_MAX)
            if value > maximum:
                raise ConfigError(f"{field.name} must be at most {maximum:,}, got {value!r}")
    for name, (a, b) in {
        "inner_steps x rounds": (cfg.inner_steps, cfg.rounds),
        "batch_size x seq_len": (cfg.batch_size, cfg.seq_len),
    }.items():
        if a * b > limits.INT32_MAX:
            raise ConfigError(
                f"{name} must be at most {limits.INT32_MAX:,} (an int32 counts them), got "
                f"{a:,} x {b:,}"
            )
    if cfg.mesh is not None:
        for name, size in cfg.mesh:
            if size > limits.INT32_MAX:
                raise ConfigError(f"--mesh axis {name} must be at most {limits.INT32_MAX:,}")


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
    """--mesh "workers=2,fsdp=2,tensor=2" -> (("workers", 2), ("fsdp", 2), ("tensor", 2)), the
    axes in the order given (the mesh's device order: later axes vary fastest). ConfigError
    naming --mesh when malformed; the sizes and axes are checked by `validate`."""
    axes = []
    for part in text.split(","):
        name, equals, size = (x.strip() for x in part.partition("="))
        if not (name.isidentifier() and equals and size.isascii() and size.isdigit()):
            raise ConfigError(
                f"--mesh must look like 'workers=2,fsdp=2,tensor=2' (NAME=SIZE, comma-separated),"
                f" got {text!r}"
            )
        axes.append((name, int(size)))
    return tuple(axes)


def format_mesh(mesh: tuple[tuple[str, int], ...]) -> str:
    """The inverse of `parse_mesh`: "workers=2,fsdp=2,tensor=2"."""
    return ",".join(f"{name}={size}" for name, size in mesh)


def mesh_axes(cfg: RunConfig, num_workers: int | None = None) -> tuple[tuple[str, int], ...]:
    """cfg.mesh with the workers axis resized to `num_workers` (default cfg.workers): the mesh
    of a run of that many workers (a 1-worker baseline or the warm start keeps the other axes,
    so each worker is partitioned the same way)."""
    if cfg.mesh is None:
        raise ValueError("cfg.mesh is None")
    count = cfg.workers if num_workers is None else num_workers
    return tuple((name, count if name == WORKER_AXIS else size) for name, size in cfg.mesh)


def _validate_mesh(cfg: RunConfig) -> None:
    """--mesh: distinct axis names, sizes >= 1, a "workers" axis of size `workers`, every
    worker's batch divisible over the other axes, and the backend left to the mesh."""
    shown = format_mesh(cfg.mesh)
    names = [name for name, _ in cfg.mesh]
    if not cfg.mesh or not all(name.isidentifier() for name in names):
        raise ConfigError(f"--mesh must name its axes NAME=SIZE, got {shown!r}")
    if len(set(names)) != len(names):
        raise ConfigError(f"--mesh names an axis twice: {shown!r}")
    for name, size in cfg.mesh:
        if size < 1:
            raise ConfigError(f"--mesh axis {name} must have a size >= 1, got {shown!r}")
    if WORKER_AXIS not in names:
        raise ConfigError(
            f"--mesh needs a {WORKER_AXIS!r} axis (the DiLoCo workers), got {shown!r}"
        )
    workers = dict(cfg.mesh)[WORKER_AXIS]
    if workers != cfg.workers:
        raise ConfigError(
            f"--mesh {shown}: the {WORKER_AXIS} axis must have the run's {cfg.workers} workers "
            f"(--workers), got {workers}"
        )
    per_worker = math.prod(size for name, size in cfg.mesh if name != WORKER_AXIS)
    if cfg.batch_size % per_worker:
        raise ConfigError(
            f"--mesh {shown} splits each worker's batch over {per_worker} devices: batch_size "
            f"must be a multiple of {per_worker}, got {cfg.batch_size}"
        )
    if cfg.backend != "auto":
        raise ConfigError(
            f"--mesh places the workers on its devices itself: it needs --backend auto, "
            f"got {cfg.backend!r}"
        )
    from diloco_jax.lm.model import ACTIVATION_BATCH_AXES, axes_beside_activation_batch

    batch_axes = [n for n, size in cfg.mesh if n in ACTIVATION_BATCH_AXES and size > 1]
    others = axes_beside_activation_batch({n: s for n, s in cfg.mesh if n != WORKER_AXIS})
    if cfg.shard_activations and (others or not batch_axes):
        why = (
            f"also partitions each worker over {', '.join(others)} (not supported: XLA's "
            "partitioner aborts beside a tensor axis)"
            if others
            else f"has no {'/'.join(ACTIVATION_BATCH_AXES)} axis of size > 1"
        )
        raise ConfigError(
            f"--shard-activations splits the batch over {'/'.join(ACTIVATION_BATCH_AXES)} "
            f"only: --mesh {shown} {why}"
        )


def _check_age_gate(cfg: RunConfig) -> None:
    """age_decay / age_cutoff: given exactly when the outer rule has them, and in range."""
    name = cfg.outer_optimizer
    wants = {"age_decay": name in AGE_GATED_OPTIMIZERS, "age_cutoff": name == "cgad"}
    for field, wanted in wants.items():
        value = getattr(cfg, field)
        if wanted and value is None:
            raise ConfigError(f"outer_optimizer {name!r} needs {field} (its age gate's)")
        if not wanted and value is not None:
            only = "'cgad' or 'adam_decay'" if field == "age_decay" else "'cgad'"
            raise ConfigError(f"{field} applies to outer_optimizer {only} only, got {name!r}")
    try:
        if cfg.age_decay is not None:
            check_number("age_decay", cfg.age_decay, lambda x: x >= 0, ">= 0")
        if cfg.age_cutoff is not None:
            check_number("age_cutoff", cfg.age_cutoff, lambda x: x > 0, "> 0")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def server_of(cfg: RunConfig) -> DecoupledDiLoCo | HALoS | None:
    """`cfg.server` ("NAME[,field=value...]", NAME a key of SERVERS) as its train_async
    part, e.g. "halos,regions=0/0/1/1,local_updates=2" -> HALoS(regions=(0, 0, 1, 1),
    local_updates=2); None for the one server. ConfigError naming `server` when malformed,
    or the part's field when the part refuses it."""
    if cfg.server is None:
        return None
    name, *items = cfg.server.split(",")
    if name.strip() not in SERVERS:
        raise ConfigError(f"server must start with one of {tuple(SERVERS)}, got {cfg.server!r}")
    part, parsers = SERVERS[name.strip()]
    fields: dict[str, Any] = {}
    for item in items:
        key, equals, text = (x.strip() for x in item.partition("="))
        if not equals or key not in parsers or not text:
            raise ConfigError(
                f"server {name.strip()} takes field=value items with fields {tuple(parsers)}, "
                f"got {item.strip()!r}"
            )
        if key in fields:
            raise ConfigError(f"server names {key!r} twice: {cfg.server!r}")
        try:
            fields[key] = parsers[key](text)
        except ValueError:
            raise ConfigError(f"server field {key}: can't read {text!r}") from None
    try:
        return part(**fields)
    except TypeError:  # a required field left out (HALoS's regions)
        raise ConfigError(
            f"server {name.strip()} needs regions=R0/R1/..., one per worker"
        ) from None
    except ValueError as e:
        raise ConfigError(f"server: {e}") from None


def _check_server(cfg: RunConfig) -> None:
    """The server part fits the run: M, H, a mesh only where it takes one, DyLU only for the
    jobs it has."""
    spec = server_of(cfg)
    try:
        spec.checked(cfg.workers, cfg.inner_steps)
    except ValueError as e:
        raise ConfigError(f"server: {e}") from None
    kind = type(spec).__name__
    if cfg.mesh is not None and not getattr(spec, "takes_mesh", False):
        raise ConfigError(f"server {kind} runs on one device: it takes no mesh")
    if cfg.dynamic_steps and isinstance(spec, DecoupledDiLoCo):
        raise ConfigError(
            "dynamic_steps is for jobs of H steps; a decoupled server's learners never stop"
        )


def method(cfg: RunConfig) -> DiLoCo:
    """The run's DiLoCo spec, built from the config by the library's keyword shorthand (so
    its parts check every rule; `ValueError` names the part and field)."""
    # temperature 1.0 is the field's default: given to the spec only with its weighting, or
    # when set, so that a temperature without norm_softmax is the library's refusal.
    softmax = cfg.weighting == "norm_softmax"
    return method_from_options(
        None,
        dict(
            inner_optimizer=inner_optimizer(cfg),
            outer_optimizer=outer_optimizer(cfg),
            outer_clip=cfg.outer_clip,
            outer_state_dtype=cfg.outer_state_dtype,
            compression=cfg.compression,
            drop_probability=cfg.drop_probability,
            drop_seed=cfg.seed,
            outer_delay=cfg.outer_delay,
            eager=cfg.eager,
            weighting=cfg.weighting,
            temperature=cfg.temperature if softmax or cfg.temperature != 1.0 else None,
            anomaly=cfg.anomaly_skip or None,
            state_sync=state_sync_of(cfg),
            gossip_group_size=cfg.gossip_group_size,
            gasloc=gasloc_of(cfg),
            fragments=cfg.fragments,
            overlap_steps=cfg.overlap_steps,
            merge_alpha=cfg.merge_alpha,
        ),
        caller="RunConfig",
    )


def gasloc_of(cfg: RunConfig) -> dict[str, float] | None:
    """`cfg.gasloc` ("alpha=A,gamma=G", either or neither) as GASLoC's fields, the run's seed
    its groups'; ConfigError when malformed."""
    if cfg.gasloc is None:
        return None
    out: dict[str, Any] = {"seed": cfg.seed}
    for part in filter(None, cfg.gasloc.split(",")):
        name, _, value = part.partition("=")
        if name.strip() not in ("alpha", "gamma"):
            raise ConfigError(f"gasloc takes alpha=A and gamma=G, got {part!r} in {cfg.gasloc!r}")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"gasloc: {name.strip()} must be a number, got {value!r}") from None
    return out


def state_sync_of(cfg: RunConfig) -> dict[str, int] | None:
    """`cfg.state_sync` ("field=K,field=K") as {field: K}; ConfigError when malformed."""
    if cfg.state_sync is None:
        return None
    out = {}
    for part in cfg.state_sync.split(","):
        name, _, every = part.partition("=")
        # The LM's inner optimizer is AdamW: its moments are the fields there are to average.
        if name.strip() not in ("mu", "nu") or not every.strip().isdigit() or int(every) < 1:
            raise ConfigError(f"state_sync must look like 'mu=75,nu=150', got {cfg.state_sync!r}")
        if name.strip() in out:
            raise ConfigError(f"state_sync names {name.strip()!r} twice: {cfg.state_sync!r}")
        out[name.strip()] = int(every)
    return out


def model_config(cfg: RunConfig):
    """The ModelConfig of cfg.model with the run's vocabulary (the tokenizer's), dtypes,
    attention, embedding, remat and activation sharding."""
    from diloco_jax.lm.model import get_config

    return get_config(
        cfg.model,
        vocab_size=parse_spec(cfg.tokenizer).vocab_size,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        attention=cfg.attention,
        embedding=cfg.embedding,
        remat=cfg.remat,
        shard_activations=cfg.shard_activations,
    )


def inner_schedule(cfg: RunConfig, peak: float) -> optax.Schedule:
    """Linear warmup from 0 to `peak`, then cosine decay to peak / 10 over H x R steps."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=min(cfg.warmup_steps, cfg.total_steps - 1),
        decay_steps=cfg.total_steps,
        end_value=peak / 10,
    )


def inner_optimizer(cfg: RunConfig) -> optax.GradientTransformation:
    """AdamW(b1 0.9, b2 0.95) at `inner_schedule(cfg, cfg.inner_lr)`; with inner_optimizer
    "muon", MuLoCo's Muon (diloco_jax.optimizers) on the hidden matrices at
    `inner_schedule(cfg, cfg.muon_lr)` (weight decay 0.01, the authors') and that same AdamW on
    the embedding and the norms."""
    schedule = inner_schedule(cfg, cfg.inner_lr)
    if cfg.inner_optimizer == "muon":
        return muon_inner_optimizer(
            inner_schedule(cfg, cfg.muon_lr),
            adamw_learning_rate=schedule,
            adamw_weight_decay=cfg.weight_decay,
        )
    return optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay)


def pretrain_optimizer(cfg: RunConfig) -> optax.GradientTransformation:
    """The warm start's AdamW: linear warmup to the peak learning rate, then constant."""
    schedule = optax.warmup_constant_schedule(0.0, cfg.inner_lr, cfg.warmup_steps)
    return optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay)


def outer_optimizer(cfg: RunConfig) -> optax.GradientTransformation:
    """The outer optimizer: Nesterov SGD (momentum cfg.outer_momentum, 0.9), heavy-ball SGD
    (the same momentum, NoLoCo's rule), plain SGD, Adam (b2 0.95), CGAD or Adam-Decay (that
    Adam on deltas gated by their age: age_decay, age_cutoff), Delayed Nesterov (momentum
    cfg.outer_momentum, buffer dn_buffer or the number of workers, c = dn_c), or HeLoCo
    (momentum cfg.outer_momentum, ρ = 1/sqrt(M) as the paper suggests, the authors'
    correction defaults, jobs from θ̄)."""
    lr = cfg.resolved_outer_lr
    if cfg.outer_optimizer == "delayed_nesterov":
        return delayed_nesterov(
            lr, cfg.outer_momentum, buffer_size=cfg.dn_buffer or cfg.workers, c=cfg.dn_c
        )
    if cfg.outer_optimizer == "nesterov":
        return optax.sgd(lr, momentum=cfg.outer_momentum, nesterov=True)
    if cfg.outer_optimizer == "heavy_ball":
        return optax.sgd(lr, momentum=cfg.outer_momentum)
    if cfg.outer_optimizer == "sgd":
        return optax.sgd(lr)
    if cfg.outer_optimizer == "cgad":
        return cgad(lr, cfg.age_decay, cfg.age_cutoff, b1=0.9, b2=0.95)
    if cfg.outer_optimizer == "adam_decay":
        return adam_decay(lr, cfg.age_decay, b1=0.9, b2=0.95)
    if cfg.outer_optimizer == "heloco":  # ρ = 1 / sqrt(K), K = M concurrent workers
        return heloco(lr, cfg.outer_momentum, rho=1.0 / math.sqrt(cfg.workers))
    return optax.adam(lr, b1=0.9, b2=0.95)

"""Run configurations for the language-model experiments: presets and validation.

A config is a frozen dataclass; `make_config(preset, **overrides)` returns a checked one.
"""

import dataclasses
import math
from typing import Any

import optax

from diloco_jax import delay
from diloco_jax.compression import parse_compression
from diloco_jax.optimizers import muon_inner_optimizer

SHARDINGS = ("iid", "non_iid")
OUTER_OPTIMIZERS = ("nesterov", "sgd", "adam")
INNER_OPTIMIZERS = ("adamw", "muon")
ALGOS = ("diloco", "sync")
# The outer learning rate each outer optimizer gets unless one is given: the paper's
# Nesterov(0.7, 0.9); plain SGD at 1.0 is parameter averaging (FedAvg); Adam rescales the
# delta per coordinate, so it wants a step of the inner learning rate's order.
DEFAULT_OUTER_LR = {"nesterov": 0.7, "sgd": 1.0, "adam": 1e-3}


class ConfigError(ValueError):
    """A user mistake in a run configuration (the CLI prints it as one line, exit code 2)."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One LM experiment. Steps per worker = inner_steps x rounds for every algorithm."""

    model: str = "tiny"  # a diloco_jax.lm.model preset
    data: str = "stdlib"  # "stdlib" | "text:PATH" | "hf:NAME[:CONFIG[:SPLIT]]"
    max_bytes: int | None = 4_000_000  # read at most this many bytes of the source
    val_fraction: float = 0.05  # documents held out for evaluation
    sharding: str = "iid"  # "iid" | "non_iid"
    workers: int = 4  # M
    inner_steps: int = 25  # H
    rounds: int = 16  # R
    batch_size: int = 16  # sequences per worker per step
    seq_len: int = 128
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
    outer_lr: float | None = None  # None: DEFAULT_OUTER_LR[outer_optimizer]
    eval_batches: int = 8
    compression: str = "none"  # how DiLoCo's deltas travel (diloco_jax.compression)
    drop_probability: float | None = None  # simulated communication drops (DiLoCo only)
    outer_delay: int = 0  # apply each round's mean d rounds late (diloco_jax.delay)
    eager: bool = False  # eager outer updates (needs outer_delay >= 1)
    seed: int = 0
    backend: str = "auto"

    @property
    def total_steps(self) -> int:
        return self.inner_steps * self.rounds

    @property
    def resolved_outer_lr(self) -> float:
        return DEFAULT_OUTER_LR[self.outer_optimizer] if self.outer_lr is None else self.outer_lr


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
    from diloco_jax.lm.model import PRESETS as MODELS
    from diloco_jax.workers import BACKENDS

    _check_types(cfg)

    def at_least(name: str, minimum: int) -> None:
        if getattr(cfg, name) < minimum:
            raise ConfigError(f"{name} must be an integer >= {minimum}, got {getattr(cfg, name)!r}")

    for name in ("workers", "inner_steps", "rounds", "batch_size", "seq_len", "eval_batches"):
        at_least(name, 1)
    for name in ("warmup_steps", "pretrain_steps", "seed"):
        at_least(name, 0)
    if cfg.max_bytes is not None:
        at_least("max_bytes", 1)
    if cfg.model not in MODELS:
        raise ConfigError(f"model must be one of {sorted(MODELS)}, got {cfg.model!r}")
    if cfg.seq_len > MODELS[cfg.model].seq_len:
        raise ConfigError(
            f"seq_len={cfg.seq_len} exceeds model {cfg.model!r} context {MODELS[cfg.model].seq_len}"
        )
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
    if cfg.drop_probability is not None and not 0 <= cfg.drop_probability <= 1:
        raise ConfigError(f"drop_probability must be in [0, 1], got {cfg.drop_probability!r}")
    try:
        parse_compression(cfg.compression)
        delay.check(cfg.outer_delay, cfg.eager)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.eager and cfg.drop_probability is not None:
        raise ConfigError("eager can't be combined with drop_probability (see diloco_jax.delay)")


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
    """The outer optimizer: Nesterov SGD (momentum 0.9), plain SGD, or Adam (b2 0.95)."""
    lr = cfg.resolved_outer_lr
    if cfg.outer_optimizer == "nesterov":
        return optax.sgd(lr, momentum=0.9, nesterov=True)
    if cfg.outer_optimizer == "sgd":
        return optax.sgd(lr)
    return optax.adam(lr, b1=0.9, b2=0.95)

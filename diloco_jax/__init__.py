"""diloco-jax: DiLoCo (Douglas et al. 2023, arXiv 2311.08105) in JAX."""

from diloco_jax import checkpoint
from diloco_jax.async_train import (
    AsyncEvent,
    AsyncResult,
    AsyncSchedule,
    AsyncState,
    async_schedule,
    dynamic_local_steps,
    train_async,
)
from diloco_jax.comm import payload_bytes, round_bytes
from diloco_jax.compression import Compression, parse_compression
from diloco_jax.delay import Delayed, Eager
from diloco_jax.delayed_nesterov import DelayedNesterovState, delayed_nesterov
from diloco_jax.donation import jit_round, restored_fields
from diloco_jax.faults import AnomalySkip, NormSoftmax, Weights
from diloco_jax.inner import StepInfo, inner_loop, inner_step, step_key, worker_key
from diloco_jax.layout import sync_steps, worker_rounds
from diloco_jax.method import (
    DiLoCo,
    default_inner_optimizer,
    default_outer_optimizer,
    method_from_options,
)
from diloco_jax.momentum_restart import restart_momentum
from diloco_jax.nnx_model import NNXModelFns, nnx_model_fns
from diloco_jax.optimizers import (
    DION_NS_COEFFS,
    default_is_hidden_matrix,
    muon_inner_optimizer,
    muon_labels,
    ns_coefficients,
    scale_by_fan_ratio,
)
from diloco_jax.outer import (
    cast_state,
    clip_outer_norm,
    delta_dtype,
    outer_init,
    outer_step,
    outer_update,
    worker_delta,
)
from diloco_jax.outer_sharding import OuterShards, outer_shards
from diloco_jax.round import DiLoCoState, diloco_round, init_state
from diloco_jax.sampler import Sampler, place_sampler
from diloco_jax.schedule import Streaming
from diloco_jax.state_sync import StateSync
from diloco_jax.sync import SyncState, init_sync_state, sync_step
from diloco_jax.train import TrainResult, train_diloco, train_diloco_step, train_sync
from diloco_jax.workers import WORKER_AXIS, Backend, make_backend

__all__ = [
    "NNXModelFns",
    "StepInfo",
    "checkpoint",
    "WORKER_AXIS",
    "AnomalySkip",
    "AsyncEvent",
    "AsyncResult",
    "AsyncSchedule",
    "AsyncState",
    "DION_NS_COEFFS",
    "Backend",
    "Compression",
    "DelayedNesterovState",
    "Delayed",
    "DiLoCo",
    "DiLoCoState",
    "Eager",
    "NormSoftmax",
    "StateSync",
    "Streaming",
    "Weights",
    "Sampler",
    "place_sampler",
    "cast_state",
    "clip_outer_norm",
    "SyncState",
    "TrainResult",
    "async_schedule",
    "default_inner_optimizer",
    "default_is_hidden_matrix",
    "default_outer_optimizer",
    "delayed_nesterov",
    "delta_dtype",
    "diloco_round",
    "dynamic_local_steps",
    "init_state",
    "init_sync_state",
    "inner_loop",
    "inner_step",
    "jit_round",
    "make_backend",
    "method_from_options",
    "restart_momentum",
    "restored_fields",
    "muon_inner_optimizer",
    "nnx_model_fns",
    "muon_labels",
    "ns_coefficients",
    "OuterShards",
    "outer_init",
    "outer_shards",
    "outer_step",
    "outer_update",
    "parse_compression",
    "payload_bytes",
    "round_bytes",
    "scale_by_fan_ratio",
    "step_key",
    "sync_steps",
    "sync_step",
    "train_async",
    "train_diloco",
    "train_diloco_step",
    "train_sync",
    "worker_delta",
    "worker_key",
    "worker_rounds",
]

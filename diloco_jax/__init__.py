"""diloco-jax: DiLoCo (Douglas et al. 2023, arXiv 2311.08105) in JAX."""

from diloco_jax import checkpoint
from diloco_jax.comm import payload_bytes, round_bytes
from diloco_jax.compression import Compression, parse_compression
from diloco_jax.inner import inner_loop, inner_step
from diloco_jax.optimizers import (
    DION_NS_COEFFS,
    default_is_hidden_matrix,
    muon_inner_optimizer,
    muon_labels,
    ns_coefficients,
    scale_by_fan_ratio,
)
from diloco_jax.outer import delta_dtype, outer_init, outer_step, outer_update, worker_delta
from diloco_jax.round import (
    DiLoCoState,
    default_inner_optimizer,
    default_outer_optimizer,
    diloco_round,
    init_state,
)
from diloco_jax.sampler import Sampler
from diloco_jax.sync import SyncState, init_sync_state, sync_step
from diloco_jax.train import TrainResult, train_diloco, train_sync
from diloco_jax.workers import WORKER_AXIS, Backend, make_backend

__all__ = [
    "checkpoint",
    "WORKER_AXIS",
    "DION_NS_COEFFS",
    "Backend",
    "Compression",
    "DiLoCoState",
    "Sampler",
    "SyncState",
    "TrainResult",
    "default_inner_optimizer",
    "default_is_hidden_matrix",
    "default_outer_optimizer",
    "delta_dtype",
    "diloco_round",
    "init_state",
    "init_sync_state",
    "inner_loop",
    "inner_step",
    "make_backend",
    "muon_inner_optimizer",
    "muon_labels",
    "ns_coefficients",
    "outer_init",
    "outer_step",
    "outer_update",
    "parse_compression",
    "payload_bytes",
    "round_bytes",
    "scale_by_fan_ratio",
    "sync_step",
    "train_diloco",
    "train_sync",
    "worker_delta",
]

"""diloco-jax: DiLoCo (Douglas et al. 2023, arXiv 2311.08105) in JAX.

`dj.` holds what a run is made of: the trainers and their results, the method spec and its
parts, the outer and inner rules, the state and the round for your own loop, and your own
model's adapter. The building blocks live in named submodules (docs/api.md lists them):
`diloco_jax.outer` (deltas, outer updates), `diloco_jax.inner` (inner steps and keys),
`diloco_jax.comm` (bytes), `diloco_jax.sync` (the data-parallel step), `diloco_jax.workers`
(backends), `diloco_jax.checkpoint`, `diloco_jax.optimizers`, and the rest.
"""

from diloco_jax.async_train import AsyncResult, async_schedule, dynamic_local_steps, train_async
from diloco_jax.cgad_outer import adam_decay, cgad
from diloco_jax.compression import Compression
from diloco_jax.decoupled import DecoupledDiLoCo
from diloco_jax.delay import Delayed, Eager
from diloco_jax.delayed_nesterov_outer import delayed_nesterov
from diloco_jax.donation import jit_round
from diloco_jax.faults import AnomalySkip, NormSoftmax, Weights
from diloco_jax.gasloc import GASLoC
from diloco_jax.halos import HALoS
from diloco_jax.heloco_outer import heloco
from diloco_jax.inner import StepInfo
from diloco_jax.layout import sync_steps, worker_rounds
from diloco_jax.method import DiLoCo, default_inner_optimizer, default_outer_optimizer
from diloco_jax.momentum_restart import restart_momentum
from diloco_jax.nnx_model import nnx_model_fns
from diloco_jax.noloco import NoLoCo
from diloco_jax.one_worker import DiLoCoOptimizerState, diloco_optimizer
from diloco_jax.optimizers import muon_inner_optimizer
from diloco_jax.outer import clip_outer_norm
from diloco_jax.round import DiLoCoState, diloco_round, init_state
from diloco_jax.sampler import Sampler
from diloco_jax.schedule import Streaming
from diloco_jax.state_sync import StateSync
from diloco_jax.train import TrainResult, train_diloco, train_diloco_step, train_sync
from diloco_jax.workers import make_backend

__all__ = [
    # trainers and their results
    "train_diloco",
    "train_diloco_step",
    "train_sync",
    "train_async",
    "TrainResult",
    "AsyncResult",
    "async_schedule",
    "dynamic_local_steps",
    # the servers train_async may talk to instead of its one server
    "DecoupledDiLoCo",
    "HALoS",
    # the method and its parts
    "DiLoCo",
    "Streaming",
    "Compression",
    "Weights",
    "NormSoftmax",
    "AnomalySkip",
    "Delayed",
    "Eager",
    "StateSync",
    "NoLoCo",
    "GASLoC",
    # outer and inner rules (optax transformations)
    "default_inner_optimizer",
    "default_outer_optimizer",
    "clip_outer_norm",
    "restart_momentum",
    "delayed_nesterov",
    "cgad",
    "heloco",
    "adam_decay",
    "muon_inner_optimizer",
    # DiLoCo with one worker as an optax optimizer, for any training loop
    "diloco_optimizer",
    "DiLoCoOptimizerState",
    # the state and the round, for your own loop
    "DiLoCoState",
    "init_state",
    "diloco_round",
    "jit_round",
    "make_backend",
    "Sampler",
    "worker_rounds",
    "sync_steps",
    # your own model
    "StepInfo",
    "nnx_model_fns",
]

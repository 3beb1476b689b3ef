"""The elastic benchmarks' task (`diloco_jax.elastic`): benchmarks/common.py's decoder LM
preset, `batch_size` sequences a step, random tokens keyed by (worker, position), AdamW inner
steps and the paper's Nesterov outer step. Sized by the environment, so the benchmark and its
processes build the same task: ELASTIC_PRESET (default tiny), ELASTIC_BATCH (8),
ELASTIC_WORKERS (M, 4), ELASTIC_INNER_STEPS (H, 25), ELASTIC_ROUNDS (R, 30). ELASTIC_DATA=corpus
draws the windows from the LM app's default corpus (the embedded text, byte tokens) instead,
so the loss curve means something: each worker reads its own contiguous shard.
ELASTIC_ALGO=async makes it asynchronous DiLoCo with Delayed Nesterov (lr 0.7, momentum 0.9,
buffer M) at the syncer, and DyLU unless ELASTIC_DYLU=0. ELASTIC_ALGO=decoupled makes it
Decoupled DiLoCo's learners and syncer: a quorum of M - 1, ELASTIC_GRACE seconds of grace
(default 0.5), 2 fragments, R merges. ELASTIC_ALGO=halos makes it HALoS: the first half of
the workers in region 0, the rest in region 1, Delayed Nesterov (0.7, 0.9, buffer 2) at each
region's syncer, a push every 2 region updates, merges of weight 0.5, the authors' global rule;
R global updates."""

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import diloco_jax as dj  # noqa: E402
from diloco_jax.elastic import ElasticTask  # noqa: E402
from diloco_jax.lm import data as data_lib  # noqa: E402


def task() -> ElasticTask:
    preset = os.environ.get("ELASTIC_PRESET", "tiny")
    batch_size = int(os.environ.get("ELASTIC_BATCH", "8"))
    steps = int(os.environ.get("ELASTIC_INNER_STEPS", "25"))
    workers = int(os.environ.get("ELASTIC_WORKERS", "4"))
    workload = common.lm_workload(preset, batch_size)
    seq_len = workload.tokens_per_example
    shards = _corpus_shards(workers) if os.environ.get("ELASTIC_DATA") == "corpus" else None

    def batches(worker: int, position: int) -> dict:
        rng = np.random.default_rng([worker, position])
        shape = (steps, batch_size, seq_len + 1)
        if shards is None:
            windows = rng.integers(1, data_lib.VOCAB_SIZE, size=shape, dtype=np.int32)
        else:
            shard = shards[worker]
            starts = rng.integers(0, len(shard) - seq_len - 1, size=shape[:2])
            windows = shard[starts[..., None] + np.arange(seq_len + 1)]
        return {"inputs": windows[..., :-1], "targets": windows[..., 1:]}

    algo = os.environ.get("ELASTIC_ALGO", "diloco")
    asynchronous = {}
    if algo == "decoupled":
        grace = float(os.environ.get("ELASTIC_GRACE", "0.5"))
        server = dj.DecoupledDiLoCo(quorum=workers - 1, grace_seconds=grace, fragments=2)
        asynchronous = dict(algo="async", server=server)
    if algo == "halos":
        regions = tuple(m * 2 // workers for m in range(workers))
        server = dj.HALoS(regions=regions, local_updates=2, merge_weight=0.5)
        outer = dj.delayed_nesterov(0.7, 0.9, buffer_size=2)
        asynchronous = dict(algo="async", method=dj.DiLoCo(outer=outer), server=server)
    if algo == "async":
        outer = dj.delayed_nesterov(0.7, 0.9, buffer_size=workers)
        asynchronous = dict(algo="async", method=dj.DiLoCo(outer=outer),
                            dynamic_steps=os.environ.get("ELASTIC_DYLU", "1") == "1")  # fmt: skip
    return ElasticTask(
        loss_fn=workload.loss_fn,
        params=workload.params,
        batches=batches,
        num_workers=workers,
        inner_steps=steps,
        num_rounds=int(os.environ.get("ELASTIC_ROUNDS", "30")),
        **asynchronous,
    )


def _corpus_shards(workers: int) -> list[np.ndarray]:
    """The LM app's default train tokens, cut into `workers` contiguous shards."""
    from diloco_jax.lm import experiment
    from diloco_jax.lm.config import RunConfig

    tokens = experiment.load_corpus(RunConfig()).train_tokens
    return [s.astype(np.int32) for s in np.array_split(tokens, workers)]

"""The elastic tests' task: tests/reference.py's linear model, AdamW inner steps and the
paper's Nesterov outer step, with each worker's data a function of (worker, position) only.
Sized by environment variables, so the test and its worker processes build the same task:
ELASTIC_WORKERS (M, default 4), ELASTIC_ROUNDS (R, default 10) and ELASTIC_PHASE_SECONDS
(a sleep in each phase's batches, so a test can act inside a phase; default 0). A test holds
every worker at a position by writing it to the file ELASTIC_HOLD names: a phase at that
position or later waits in its batches (heartbeating) while the file says so."""

import dataclasses
import os
import time

import numpy as np
import optax
from reference import linear_loss

import diloco_jax as dj
from diloco_jax.elastic import ElasticTask

INNER_STEPS = 3
PARAMS = {"w": np.asarray([0.3, -0.2, 0.1], np.float32), "b": np.float32(0.5)}
METHOD = dj.DiLoCo(
    inner=optax.adamw(0.02, weight_decay=0.1),
    outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
)


def batch(worker, position, steps=INNER_STEPS):
    """Worker `worker`'s batch of its `position`-th inner phase: {"x": [steps, 4, 3], "y":
    [steps, 4]}."""
    rng = np.random.default_rng([worker, position])
    x = rng.normal(size=(steps, 4, 3)).astype(np.float32)
    y = (x @ np.asarray([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)
    return {"x": x, "y": y + 0.1 * rng.normal(size=y.shape).astype(np.float32)}


def wait_while_held(position):
    """Waits while the file ELASTIC_HOLD names holds a position at or before `position`."""

    def held():
        try:
            with open(os.environ.get("ELASTIC_HOLD")) as f:
                return position >= int(f.read())
        except (OSError, ValueError, TypeError):
            return False

    while held():
        time.sleep(0.02)


def make_task():
    seconds = float(os.environ.get("ELASTIC_PHASE_SECONDS", "0"))

    def batches(worker, position):
        wait_while_held(position)
        time.sleep(seconds)
        return batch(worker, position)

    return ElasticTask(
        loss_fn=linear_loss,
        params=PARAMS,
        batches=batches,
        num_workers=int(os.environ.get("ELASTIC_WORKERS", "4")),
        inner_steps=INNER_STEPS,
        num_rounds=int(os.environ.get("ELASTIC_ROUNDS", "10")),
        method=METHOD,
    )


def make_sharded_task():
    """make_task's task with each step's batch of 4 split over the worker's first 2 devices
    (its gradients reduced there), θ replicated on them."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(jax.devices()[:2], ("data",))
    task = make_task()
    return dataclasses.replace(
        task,
        param_sharding=NamedSharding(mesh, P()),
        batch_sharding=NamedSharding(mesh, P(None, "data")),
    )


def make_compressed_task():
    """make_task's task with its deltas compressed as ELASTIC_COMPRESSION says (a
    `dj.DiLoCo` compression spec, default "int8,ef=1")."""
    compression = os.environ.get("ELASTIC_COMPRESSION", "int8,ef=1")
    method = dj.DiLoCo(inner=METHOD.inner, outer=METHOD.outer, compression=compression)
    return dataclasses.replace(make_task(), method=method)


def make_async_task():
    """make_task's task as asynchronous DiLoCo with DyLU: ELASTIC_OUTER names the server's
    rule, "dn" (Delayed Nesterov 0.6, momentum 0.5, every 2 updates), "cgad" (CGAD, lr 0.05,
    decay 0.1, cutoff 8; both read each delta's age) or "heloco" (HeLoCo 0.6, momentum 0.5,
    ρ 0.5: jobs start from θ̄)."""
    outers = {
        "dn": lambda: dj.delayed_nesterov(0.6, 0.5, buffer_size=2),
        "cgad": lambda: dj.cgad(0.05, 0.1, 8),
        "heloco": lambda: dj.heloco(0.6, 0.5, rho=0.5),
    }
    outer = outers[os.environ.get("ELASTIC_OUTER", "dn")]()
    return dataclasses.replace(make_task(), method=dj.DiLoCo(inner=METHOD.inner, outer=outer),
                               algo="async", dynamic_steps=True)  # fmt: skip


HALOS = dj.HALoS(regions=(0, 0, 1, 1), local_updates=2, merge_weight=0.5,
                 global_optimizer=optax.sgd(0.8, momentum=0.4))  # fmt: skip


def make_halos_task():
    """make_async_task's task ("dn": Delayed Nesterov at each region's syncer, DyLU) as HALoS
    (`HALOS`): workers 0, 1 in region 0 and 2, 3 in region 1, a push every 2 local updates,
    merges of weight 0.5, a global heavy-ball step; ELASTIC_ROUNDS global updates."""
    local = dj.delayed_nesterov(0.6, 0.5, buffer_size=2)
    return dataclasses.replace(make_task(), method=dj.DiLoCo(inner=METHOD.inner, outer=local),
                               algo="async", dynamic_steps=True, server=HALOS)  # fmt: skip


def make_gossip_task():
    """make_task's task with no global θ: ELASTIC_GOSSIP names the gossip part, "noloco"
    (NoLoCo, pairs, its default heavy-ball outer step) or "gasloc" (GASLoC, pairs, α 0.8,
    γ 0.3, SGD 0.7), each with seed 5."""
    parts = {
        "noloco": lambda: dj.NoLoCo(group_size=2, seed=5),
        "gasloc": lambda: dj.GASLoC(group_size=2, alpha=0.8, gamma=0.3, seed=5),
    }
    gossip = parts[os.environ.get("ELASTIC_GOSSIP", "noloco")]()
    return dataclasses.replace(make_task(), method=dj.DiLoCo(inner=METHOD.inner, gossip=gossip))


DECOUPLED_STEPS = 4
DECOUPLED = dj.DecoupledDiLoCo(quorum=2, grace_seconds=0.3, fragments=2, merge="rda",
                               average_leaves=("b",))  # fmt: skip


ADAPTIVE = dataclasses.replace(DECOUPLED, grace_seconds=0.0, adaptive_grace=0.5, overlap_steps=1)


def make_decoupled_task():
    """Decoupled DiLoCo's learners (H = 4 steps of `batch(m, round, 4)`) and syncer
    (`DECOUPLED`: a quorum of 2 with 0.3 s of grace, 2 fragments, RDA but for "b"; with
    ELASTIC_GRACE=adaptive, `ADAPTIVE`'s window of 0.5 x (a step of the quorum's learner less
    the quorum's wait)), AdamW inner steps and the paper's Nesterov outer step;
    ELASTIC_ROUNDS merges."""

    def batches(worker, position):
        wait_while_held(position)
        return batch(worker, position, DECOUPLED_STEPS)

    server = ADAPTIVE if os.environ.get("ELASTIC_GRACE") == "adaptive" else DECOUPLED
    return dataclasses.replace(make_task(), batches=batches, inner_steps=DECOUPLED_STEPS,
                               algo="async", server=server)  # fmt: skip

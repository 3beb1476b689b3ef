"""Decoupled DiLoCo on real processes (`ElasticTask(algo="async", server=DecoupledDiLoCo(...))`):
a syncer and four learner processes of unequal speeds that never wait, a quorum of 2 with
grace, 2 fragments and RDA, one learner SIGKILLed and restarted (from its checkpoint) and one
SIGSTOPped past the heartbeat timeout (removed, then back); and the syncer SIGKILLed and
restarted from its checkpoint, its grace the adaptive one on the learners' step times. Θ at
the end must equal `train_async` with the same server replaying the run's merges, where each
learner applied them and where each learner process started, within 1e-6 relative."""

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from elastic_linear import (
    ADAPTIVE,
    DECOUPLED,
    DECOUPLED_STEPS,
    METHOD,
    PARAMS,
    batch,
    make_decoupled_task,
)
from reference import linear_loss
from test_elastic import Cluster, _wait

import diloco_jax as dj
from diloco_jax.decoupled import replay_rounds
from diloco_jax.elastic import arrivals, final_params, history

MERGES = 48
# Seconds per inner step added to each learner: learner 3 the slowest.
SLOW = ("0.08", "0.1", "0.08", "0.2")


def _jsonl(path):
    return (
        [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    )


def _replay(merges, server=DECOUPLED):
    rounds = [
        jax.tree.map(lambda *x: np.stack(x), *(batch(m, r, DECOUPLED_STEPS) for m in range(4)))
        for r in range(replay_rounds(merges, DECOUPLED_STEPS))
    ]
    return dj.train_async(
        linear_loss, PARAMS, rounds, num_workers=4, inner_steps=DECOUPLED_STEPS,
        num_updates=MERGES, server=server, arrivals=merges, inner_optimizer=METHOD.inner,
        outer_optimizer=METHOD.outer,
    )  # fmt: skip


@pytest.mark.slow
def test_a_killed_and_a_stopped_learner_reproduce_the_replay(tmp_path):
    env = {"ELASTIC_ROUNDS": str(MERGES), "ELASTIC_PHASE_SECONDS": "0"}
    cluster = Cluster(tmp_path, task="elastic_linear:make_decoupled_task", env=env,
                      min_workers=1)  # fmt: skip
    cluster.start(**{str(m): {"DILOCO_JAX_SLOW_STEP": s} for m, s in enumerate(SLOW)})
    syncer_dir = tmp_path / "syncer"
    _wait(lambda: len(cluster.syncs()) >= 4, 120, "4 merges", cluster)
    # Learner 1 killed, and restarted faster: it resumes at its checkpoint's step from Θ of
    # then, catches up and is merged again. Every learner waits at its data position 8 (step
    # 32) until it has caught up there: on a loaded machine its restart can take longer than
    # the rest of the run.
    cluster.hold(8)
    cluster.processes["worker-1"].kill()
    cluster.processes["worker-1"].wait()
    cluster.worker(1, DILOCO_JAX_SLOW_STEP="0")
    stopped = cluster.processes["worker-2"]
    os.kill(stopped.pid, signal.SIGSTOP)
    _wait(lambda: "learner 2 removed" in cluster.log("syncer"), 60, "learner 2 removed", cluster)
    time.sleep(0.5)
    os.kill(stopped.pid, signal.SIGCONT)
    metrics = tmp_path / "workers" / "worker-1" / "metrics.jsonl"
    caught_up = lambda: any(x["step"] >= 32 for x in _jsonl(metrics))  # noqa: E731
    _wait(caught_up, 120, "learner 1 at step 32", cluster)
    cluster.hold(None)
    cluster.finish()
    merges = arrivals(syncer_dir)
    assert [x.update for x in merges] == list(range(MERGES))
    real = final_params(syncer_dir, make_decoupled_task())
    replay = _replay(merges)
    for name in ("w", "b"):
        assert np.all(np.isfinite(real[name]))
        np.testing.assert_allclose(real[name], replay.params[name], rtol=1e-6, atol=1e-7)
    assert [e["merged"] for e in replay.history] == [list(x.merged) for x in merges]
    # The run was what the test made it. Learner 1's new process resumed from its checkpoint
    # and was merged again after; learner 2 was left out while stopped and joined again
    # during the run (its pushes behind the others', late: a learner never catches up on its
    # own steps, and under load the run can end before another of them is heard).
    restarted = next(i for i, x in enumerate(merges) if any(r[0] == 1 for r in x.restarts)
                     and i > 0)  # fmt: skip
    [(_, step, saved)] = [r for r in merges[restarted].restarts if r[0] == 1]
    assert saved and step > 0
    assert "resuming at step" in cluster.log("worker-1")
    assert any(1 in x.merged for x in merges[restarted:])
    lines = history(syncer_dir)
    assert any(2 not in x["merged"] for x in lines[4:])
    assert "joining again" in cluster.log("worker-2")
    assert cluster.log("syncer").count("learner 2 joined") == 2
    assert all(any(b >= 0 for b in x.boundaries) for x in merges[: MERGES // 2])
    # Control: the same merges replayed as if every learner's push had made each of them
    # land elsewhere (the merged sets matter), and so does learner 1's restart.
    everyone = [x._replace(merged=(0, 1, 2, 3)) for x in merges]
    assert not np.allclose(real["w"], _replay(everyone).params["w"], rtol=1e-4)
    never = [x._replace(restarts=tuple(r for r in x.restarts if r[0] != 1 or i == 0), origins=())
             for i, x in enumerate(merges)]  # fmt: skip
    assert not np.allclose(real["w"], _replay(never).params["w"], rtol=1e-4)


@pytest.mark.slow
def test_a_killed_syncer_resumes_and_the_run_reproduces_the_replay(tmp_path):
    env = {"ELASTIC_ROUNDS": str(MERGES), "ELASTIC_PHASE_SECONDS": "0", "ELASTIC_GRACE": "adaptive"}
    cluster = Cluster(tmp_path, task="elastic_linear:make_decoupled_task", env=env,
                      min_workers=1)  # fmt: skip
    # Learner 0 the fastest by far, so that even on a loaded machine it catches up after its
    # stop and is merged again: the others sleep 0.15 s or more a step, it none.
    speeds = ("0", "0.15", "0.2", "0.3")
    cluster.start(**{str(m): {"DILOCO_JAX_SLOW_STEP": s} for m, s in enumerate(speeds)})
    syncer_dir = tmp_path / "syncer"
    _wait(lambda: len(cluster.syncs()) >= 6, 120, "6 merges", cluster)
    # Learner 0 stopped across two merges and the syncer's restart: it holds a version older
    # than the restarted syncer keeps, so it takes Θ whole when it goes on.
    stopped = cluster.processes["worker-0"]
    os.kill(stopped.pid, signal.SIGSTOP)
    state = lambda: Path(f"/proc/{stopped.pid}/stat").read_text().split(") ")[1][0]  # noqa: E731
    _wait(lambda: state() == "T", 10, "learner 0 stopped", cluster)
    held = len(cluster.syncs())  # merges from here on are after its stop
    _wait(lambda: len(cluster.syncs()) >= held + 2, 120, "2 merges more", cluster)
    cluster.processes["syncer"].kill()
    cluster.processes["syncer"].wait()
    killed_at = len(cluster.syncs())
    cluster.syncer()  # at the same port, from its checkpoint
    rejoined = lambda: cluster.log("syncer").count("learner 1 joined") >= 2  # noqa: E731
    _wait(rejoined, 120, "learner 1 joined again", cluster)
    os.kill(stopped.pid, signal.SIGCONT)
    cluster.finish()
    assert "resumed after merge" in cluster.log("syncer")
    merges = arrivals(syncer_dir)
    assert [x.update for x in merges] == list(range(MERGES))
    real = final_params(syncer_dir, make_decoupled_task())
    replay = _replay(merges, ADAPTIVE)
    for name in ("w", "b"):
        np.testing.assert_allclose(real[name], replay.params[name], rtol=1e-6, atol=1e-7)
    # Learners behind the restarted syncer took Θ whole where they were, their state kept:
    # learner 0 among them, merged again after.
    resyncs = [(i, r) for i, x in enumerate(merges) for r in x.restarts if i >= killed_at - 1]
    assert any(r[0] == 0 for _, r in resyncs) and all(r[2] and r[1] > 0 for _, r in resyncs)
    first = min(i for i, r in resyncs if r[0] == 0)
    assert any(0 in x.merged for x in merges[first:])


def test_a_decoupled_task_refuses_what_its_learners_cannot_run():
    task = make_decoupled_task()
    refusals = {
        "needs algo='async'": {"algo": "diloco"},
        "simulate latencies: on processes the hops are the network's": {
            "server": dj.HALoS(regions=(0, 0, 1, 1), worker_seconds=0.1)
        },
        "an LPS merges θ_G itself": {
            "server": dj.HALoS(regions=(0, 0, 1, 1), global_optimizer=dj.heloco(0.6, 0.5))
        },
        "must be None, dj.DecoupledDiLoCo": {"server": "decoupled"},
        "quorum must be at most num_workers": {"server": dj.DecoupledDiLoCo(quorum=9)},
    }
    for words, changes in refusals.items():
        with pytest.raises(ValueError, match=words):
            dataclasses.replace(task, **changes)


def test_the_decoupled_syncer_refuses_a_bad_call(tmp_path):
    from diloco_jax.decoupled_syncer import DecoupledSyncer
    from diloco_jax.elastic_task import Elastic

    syncer = DecoupledSyncer(make_decoupled_task(), Elastic(), tmp_path)
    with pytest.raises(ValueError, match=r"start must be an integer step >= 0, got -1"):
        syncer.join(0, None, start=-1)
    with pytest.raises(ValueError, match=r"worker must be in \[0, 4\), got 4"):
        syncer.join(4, None)
    me = syncer.join(0, None)["incarnation"]
    leaves = [np.float32(0.0)]  # fragment 0's one leaf, "b" (leaf i of b, w: fragment i % 2)
    # H = 4, P = 2: a learner pushes after its steps 2, 4, 6, ...; step 3 is none of them.
    with pytest.raises(ValueError, match="a push follows a step k H \\+ \\(p \\+ 1\\) H / P"):
        syncer.push(0, me, 3, leaves, 1.0)
    with pytest.raises(ValueError, match="Elastic.min_workers does not apply"):
        DecoupledSyncer(make_decoupled_task(), Elastic(min_workers=2), tmp_path)


def test_the_real_syncers_adaptive_grace_is_budgeted_on_the_step_times_its_learners_send(
    tmp_path, monkeypatch
):
    # gamma = 0.5, tau = 1: the window after the K-th push is 0.5 x max(0, s_K - (t_K - t_1)),
    # s_K the K-th pusher's seconds per step as it measured them.
    from types import SimpleNamespace

    from diloco_jax import decoupled_syncer
    from diloco_jax.elastic_task import Elastic
    from diloco_jax.quorum import Due

    now = [100.0]
    wall = SimpleNamespace(time=lambda: 1e9 + now[0])  # the history's wall times
    monkeypatch.setattr(decoupled_syncer, "time", wall)
    spec = dataclasses.replace(DECOUPLED, grace_seconds=0.0, adaptive_grace=0.5, overlap_steps=1)
    task = dataclasses.replace(make_decoupled_task(), server=spec)
    syncer = decoupled_syncer.DecoupledSyncer(task, Elastic(), tmp_path, clock=lambda: now[0])
    me = [syncer.join(m, None)["incarnation"] for m in range(4)]
    b = [np.float32(0.0)]  # fragment 0's one leaf: "b"
    # Fragment 0's sync 0 follows step H / P = 2: learner 3 first, at 0.9 s per step (its two
    # steps took 1.8 s); learner 1 makes the quorum of 2 0.25 s later, at 0.6 s per step.
    assert syncer.push(3, me[3], 2, b, 1.0, steps_s=1.8, timed_steps=2, c_steps=2)["status"] == "ok"
    now[0] = 100.25
    assert syncer.push(1, me[1], 2, b, 1.0, steps_s=1.2, timed_steps=2, c_steps=2)["status"] == "ok"
    assert syncer.rule.next_due() == Due(pytest.approx(100.25 + 0.5 * (0.6 - 0.25)), 0, 0)
    now[0] = 100.4  # inside the window: learner 0's push is taken
    assert syncer.push(0, me[0], 2, b, 1.0, steps_s=0.8, timed_steps=2, c_steps=2)["status"] == "ok"
    syncer.tick()
    assert syncer.update == 0
    now[0] = 100.5  # past it: merged, learner 2 not in
    syncer.tick()
    assert syncer.update == 1
    assert _jsonl(tmp_path / "history.jsonl")[0]["merged"] == [0, 1, 3]
    assert (
        syncer.push(2, me[2], 2, b, 1.0, steps_s=2.0, timed_steps=2, c_steps=2)["status"] == "late"
    )
    # Fragment 1's sync 0 (after step 4): learner 2's late push still timed it (1 s per
    # step); its quorum gathers at one instant, so the window is 0.5 x 1 s.
    leaves_1 = [np.zeros(3, np.float32)]  # fragment 1's one leaf: "w"
    syncer.push(0, me[0], 4, leaves_1, 1.0, c_steps=4)
    syncer.push(2, me[2], 4, leaves_1, 1.0, c_steps=4)
    assert syncer.rule.next_due() == Due(100.5 + 0.5 * (1.0 - 0.0), 1, 0)

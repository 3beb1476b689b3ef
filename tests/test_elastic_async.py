"""Asynchronous DiLoCo on real processes (`ElasticTask(algo="async")`): a syncer and four
worker processes of unequal speeds (DyLU from their measured steps), one worker SIGKILLed and
restarted and one SIGSTOPped past the heartbeat timeout, with Delayed Nesterov, CGAD or
HeLoCo (jobs from its look-ahead θ̄) at the syncer. The final θ must equal `train_async`
replaying the run's arrival log on the simulated clock, within 1e-6 relative."""

import signal
import time

import jax
import numpy as np
import pytest
from elastic_linear import INNER_STEPS, METHOD, PARAMS, batch, make_async_task
from reference import linear_loss
from test_elastic import Cluster, _wait

import diloco_jax as dj
from diloco_jax.elastic import arrivals, final_params

pytestmark = pytest.mark.slow

UPDATES = 24
# Seconds per inner step added to each worker: DyLU gives worker 0 and 2 about H steps, worker
# 1 about H/2, worker 3 about H/3.
SLOW = ("0.05", "0.1", "0.05", "0.15")


def _replay(events, outer):
    jobs = 1 + max(e.job for e in events)
    rounds = [
        jax.tree.map(lambda *x: np.stack(x), *(batch(m, j) for m in range(4))) for j in range(jobs)
    ]
    return dj.train_async(
        linear_loss, PARAMS, rounds, num_workers=4, inner_steps=INNER_STEPS,
        num_updates=len(events), arrivals=events, inner_optimizer=METHOD.inner,
        outer_optimizer=outer,
    )  # fmt: skip


def _equals_its_replay(syncer_dir):
    """(events, task, θ) of a finished run, after checking θ is finite and equals
    `train_async` replaying its arrival log of UPDATES updates."""
    events = arrivals(syncer_dir)
    assert [e.update for e in events] == list(range(UPDATES))
    task = make_async_task()
    real = final_params(syncer_dir, task)
    replay = _replay(events, task.method.outer)
    for name in ("w", "b"):
        assert np.all(np.isfinite(real[name]))
        np.testing.assert_allclose(real[name], replay.params[name], rtol=1e-6, atol=1e-7)
    return events, task, real


@pytest.mark.parametrize("outer", ["dn", "cgad", "heloco"])
def test_a_killed_and_a_stopped_worker_reproduce_the_replay(tmp_path, outer, monkeypatch):
    monkeypatch.setenv("ELASTIC_OUTER", outer)  # the task here as in the processes
    env = {"ELASTIC_ROUNDS": str(UPDATES), "ELASTIC_PHASE_SECONDS": "0", "ELASTIC_OUTER": outer}
    cluster = Cluster(tmp_path, task="elastic_linear:make_async_task", env=env)
    cluster.hold(2)  # every worker waits at its position 2
    cluster.start(**{str(m): {"DILOCO_JAX_SLOW_STEP": s} for m, s in enumerate(SLOW)})
    cluster.wait_for_syncs(8)
    cluster.processes["worker-2"].kill()
    stopped = cluster.processes["worker-3"]
    stopped.send_signal(signal.SIGSTOP)
    cluster.hold(4)  # workers 0 and 1 run on
    removed = ("worker 2 removed: silent", "worker 3 removed: silent")
    _wait(lambda: all(x in cluster.log("syncer") for x in removed), 60, "removals", cluster)
    cluster.wait_for_syncs(12)
    cluster.worker(2)
    stopped.send_signal(signal.SIGCONT)
    cluster.wait_for_join(2, 2)
    cluster.wait_for_join(3, 2)
    # Workers 0 and 1 go one position on, no further, until workers 2 and 3 have each had
    # their position 2 applied again: on a loaded machine a restart can take longer than
    # the rest of the run.
    cluster.hold(5)
    again = lambda: {(2, 2), (3, 2)} <= {(x["worker"], x["position"]) for x in cluster.syncs()}  # noqa: E731
    _wait(again, 120, "workers 2 and 3 at position 2 again", cluster)
    cluster.hold(None)
    cluster.finish()
    events, task, real = _equals_its_replay(tmp_path / "syncer")
    # The faults are in the log: workers 2 and 3 each ran position 2 again after rejoining;
    # DyLU gave the slowest worker fewer than H steps once timed (its first job compiled).
    assert [e.job for e in events if e.worker == 2][:3] == [0, 1, 2]
    assert "joining again" in cluster.log("worker-3")
    later = {e.steps for e in events if e.worker == 3 and e.job > 1}
    assert later and max(later) < INNER_STEPS
    # Control: the fault-free simulated clock at the workers' step times lands elsewhere.
    seconds = [float(s) for s in SLOW]
    clean = dj.train_async(
        linear_loss, PARAMS, _rounds_for(UPDATES), num_workers=4, inner_steps=INNER_STEPS,
        num_updates=UPDATES, step_seconds=seconds, dynamic_steps=True,
        inner_optimizer=METHOD.inner, outer_optimizer=task.method.outer,
    )  # fmt: skip
    assert not np.allclose(real["w"], clean.params["w"], rtol=1e-4)


def _rounds_for(updates):
    return [
        jax.tree.map(lambda *x: np.stack(x), *(batch(m, j) for m in range(4)))
        for j in range(updates)
    ]


def test_a_worker_in_the_middle_of_a_job_at_the_end_hears_it_and_exits(tmp_path):
    # Worker 1 takes 3 x 2 s a job; worker 0 makes the 4 updates long before: worker 1 is in
    # its phase when the run ends, hears the end in a heartbeat and exits 0 after its phase
    # (it used to push to a syncer already gone and fail after syncer_timeout).
    env = {"ELASTIC_WORKERS": "2", "ELASTIC_ROUNDS": "4", "ELASTIC_PHASE_SECONDS": "0"}
    cluster = Cluster(tmp_path, task="elastic_linear:make_async_task", env=env)
    cluster.syncer()
    cluster.worker(0)
    cluster.worker(1, DILOCO_JAX_SLOW_STEP="2.0")
    started = time.monotonic()
    cluster.finish(timeout=60)
    assert time.monotonic() - started < 30
    assert {e.worker for e in arrivals(tmp_path / "syncer")} == {0}


def test_a_killed_syncer_and_worker_at_random_moments_reproduce_the_replay(tmp_path):
    """The syncer SIGKILLed twice and a worker once at random moments of the run, each
    restarted: the syncer resumes from its newest checkpoint (the jobs it handed out before
    it taken back), and θ equals the replay of the arrival log it kept."""
    rng = np.random.default_rng(int(time.time()))
    env = {"ELASTIC_ROUNDS": str(UPDATES), "ELASTIC_PHASE_SECONDS": "0"}
    cluster = Cluster(tmp_path, task="elastic_linear:make_async_task", env=env)
    cluster.start(**{str(m): {"DILOCO_JAX_SLOW_STEP": s} for m, s in enumerate(SLOW)})
    for name, at in sorted([("syncer", rng.integers(2, 8)), ("worker-1", rng.integers(8, 12)),
                            ("syncer", rng.integers(13, 19))], key=lambda x: x[1]):  # fmt: skip
        cluster.wait_for_syncs(int(at))
        time.sleep(rng.uniform(0, 0.3))
        cluster.processes[name].kill()
        cluster.processes[name].wait()
        cluster.syncer() if name == "syncer" else cluster.worker(1)
    cluster.finish()
    assert cluster.log("syncer").count("resumed from") == 2
    _equals_its_replay(tmp_path / "syncer")

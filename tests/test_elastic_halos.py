"""HALoS on real processes (`ElasticTask(algo="async", server=dj.HALoS(...))`): a global
syncer, a syncer per region (each its own process) and four workers of unequal speeds in two
regions, one worker SIGKILLed and restarted and one SIGSTOPped past the heartbeat timeout.
θ_G must equal `train_async(server=...)` replaying the run's record (each region's arrivals
and merges, the global syncer's pushes) within 1e-6 relative."""

import signal
import time

import jax
import numpy as np
import pytest
from elastic_linear import HALOS, INNER_STEPS, METHOD, PARAMS, batch, make_halos_task
from reference import linear_loss
from test_elastic import HEARTBEAT_TIMEOUT, Cluster, _wait

import diloco_jax as dj
from diloco_jax.elastic import arrivals, final_params, history

GLOBAL_UPDATES = 12
# Seconds per inner step added to each worker: DyLU gives region 0's workers H steps and
# region 1's slower ones fewer (each region times its own).
SLOW = ("0.05", "0.1", "0.05", "0.15")


class HALoSCluster(Cluster):
    """The global syncer at `port`, region r's at port + 1 + r, workers at their region's."""

    def __init__(self, out, **kwargs):
        super().__init__(out, task="elastic_linear:make_halos_task", min_workers=1, **kwargs)
        self.region_ports = [_port() for _ in range(2)]

    def region(self, r):
        argv = ["syncer", "--task", self.task, "--dir", str(self.out / "syncer" / f"region-{r}"),
                "--port", str(self.region_ports[r]), "--region", str(r), "--global-syncer",
                f"127.0.0.1:{self.port}", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
                *self.options]  # fmt: skip
        return self._start(f"region-{r}", argv)

    def worker(self, m, **env):
        r = HALOS.regions[m]
        address = f"127.0.0.1:{self.region_ports[r]}"
        argv = ["worker", "--task", self.task, "--worker", str(m), "--syncer", address,
                "--dir", str(self.out / "workers")]  # fmt: skip
        return self._start(f"worker-{m}", argv, **env)

    def start(self, **worker_env):
        self.syncer()
        for r in range(2):
            self.region(r)
        for m in range(4):
            self.worker(m, **worker_env.get(str(m), {}))

    def updates(self, r):
        folder = self.out / "syncer" / f"region-{r}"
        return history(folder) if (folder / "history.jsonl").exists() else []


def _port():
    from test_elastic import _free_port

    return _free_port()


def _replay(record):
    jobs = 1 + max(a.job for a in record.arrivals)
    rounds = [
        jax.tree.map(lambda *x: np.stack(x), *(batch(m, j) for m in range(4))) for j in range(jobs)
    ]
    task = make_halos_task()
    return dj.train_async(
        linear_loss, PARAMS, rounds, num_workers=4, inner_steps=INNER_STEPS,
        num_updates=len(record.arrivals), arrivals=record, inner_optimizer=METHOD.inner,
        outer_optimizer=task.method.outer, server=HALOS,
    )  # fmt: skip


def _equals_its_replay(syncer_dir, updates):
    """(record, θ_G) of a finished run of `updates` global updates, after checking θ_G is
    finite and equals the replay of its record."""
    record = arrivals(syncer_dir)
    assert len(record.pushes) == updates
    real = final_params(syncer_dir, make_halos_task())
    replay = _replay(record)
    for name in ("w", "b"):
        assert np.all(np.isfinite(real[name]))
        np.testing.assert_allclose(real[name], replay.params[name], rtol=1e-6, atol=1e-7)
    return record, real


@pytest.mark.slow
def test_a_killed_and_a_stopped_worker_reproduce_the_replay(tmp_path):
    env = {"ELASTIC_ROUNDS": str(GLOBAL_UPDATES), "ELASTIC_PHASE_SECONDS": "0"}
    cluster = HALoSCluster(tmp_path, env=env)
    cluster.hold(2)  # every worker waits at its position 2
    cluster.start(**{str(m): {"DILOCO_JAX_SLOW_STEP": s} for m, s in enumerate(SLOW)})
    _wait(lambda: len(cluster.updates(0)) >= 4 and len(cluster.updates(1)) >= 4, 120,
          "4 updates in each region", cluster)  # fmt: skip
    cluster.processes["worker-1"].kill()
    stopped = cluster.processes["worker-3"]
    stopped.send_signal(signal.SIGSTOP)
    cluster.hold(4)  # workers 0 and 2 run on
    removed = (("region-0", "worker 1 removed: silent"), ("region-1", "worker 3 removed: silent"))
    _wait(lambda: all(x in cluster.log(r) for r, x in removed), 60, "removals", cluster)
    _wait(lambda: len(cluster.updates(0)) >= 6 and len(cluster.updates(1)) >= 6, 120,
          "6 updates in each region", cluster)  # fmt: skip
    cluster.worker(1)
    stopped.send_signal(signal.SIGCONT)
    for m, r in ((1, 0), (3, 1)):  # both back in their regions before the run goes on
        _wait(lambda m=m, r=r: cluster.log(f"region-{r}").count(f"worker {m} joined") >= 2, 120,
              f"worker {m} joining again", cluster)  # fmt: skip
    cluster.hold(None)
    cluster.finish()
    record, real = _equals_its_replay(tmp_path / "syncer", GLOBAL_UPDATES)
    assert record.merges
    task = make_halos_task()
    # The faults are in the record: worker 1's jobs 2.. ran after its restart, worker 3 was
    # heard again after its stall.
    assert "joining again" in cluster.log("worker-3")
    assert [a.job for a in record.arrivals if a.worker == 1][:3] == [0, 1, 2]
    # Control: the fault-free simulated clock at the workers' step times lands elsewhere.
    count = len(record.arrivals)
    rounds = [jax.tree.map(lambda *x: np.stack(x), *(batch(m, j) for m in range(4)))
              for j in range(count)]  # fmt: skip
    clean = dj.train_async(
        linear_loss, PARAMS, rounds, num_workers=4, inner_steps=INNER_STEPS, num_updates=count,
        step_seconds=[float(s) for s in SLOW], dynamic_steps=True, inner_optimizer=METHOD.inner,
        outer_optimizer=task.method.outer, server=HALOS,
    )  # fmt: skip
    assert not np.allclose(real["w"], clean.params["w"], rtol=1e-4)


@pytest.mark.slow
def test_a_global_syncer_killed_twice_resumes_and_the_run_reproduces_the_replay(tmp_path):
    """The global syncer SIGKILLed at two random moments and restarted each time: it resumes
    from its checkpoint (every θ_G a region merged is in it), the regions' pushes it lost are
    sent again, and θ_G equals the replay of the record."""
    rng = np.random.default_rng(int(time.time()))
    updates = 30  # the kills come within the first 10 or so: the run is still on
    env = {"ELASTIC_ROUNDS": str(updates), "ELASTIC_PHASE_SECONDS": "0"}
    cluster = HALoSCluster(tmp_path, env=env)
    cluster.start(**{str(m): {"DILOCO_JAX_SLOW_STEP": s} for m, s in enumerate(SLOW)})
    for kill in range(2):  # each 1 to 3 updates after the syncer (re)started serving
        _wait(lambda k=kill: cluster.log("syncer").count("resumed from") == k, 60,
              "the global syncer serving again", cluster)  # fmt: skip
        cluster.wait_for_syncs(len(cluster.syncs()) + int(rng.integers(1, 4)))
        time.sleep(rng.uniform(0, 0.3))
        cluster.processes["syncer"].kill()
        cluster.processes["syncer"].wait()
        cluster.syncer()
    cluster.finish()
    assert cluster.log("syncer").count("resumed from") == 2
    _equals_its_replay(tmp_path / "syncer", updates)


@pytest.mark.slow
def test_a_region_syncer_killed_resumes_and_the_run_reproduces_the_replay(tmp_path):
    """Region 1's syncer SIGKILLed at a random moment and restarted at its address: it resumes
    from its checkpoint (a push in flight, its merges), its workers' jobs after it run again,
    no push is applied twice, and θ_G equals the replay of the record."""
    rng = np.random.default_rng(int(time.time()))
    updates = 30
    env = {"ELASTIC_ROUNDS": str(updates), "ELASTIC_PHASE_SECONDS": "0"}
    cluster = HALoSCluster(tmp_path, env=env)
    # Every worker waits at its position 10 until region 1 is back: region 0 alone can't end
    # the run meanwhile (at most 20 of its updates, 10 global ones, of 30).
    cluster.hold(10)
    cluster.start(**{str(m): {"DILOCO_JAX_SLOW_STEP": s} for m, s in enumerate(SLOW)})
    at = int(rng.integers(3, 12))
    _wait(lambda: len(cluster.updates(1)) >= at, 120, f"{at} updates in region 1", cluster)
    time.sleep(rng.uniform(0, 0.3))
    cluster.processes["region-1"].kill()
    cluster.processes["region-1"].wait()
    cluster.region(1)
    _wait(lambda: "resumed from" in cluster.log("region-1"), 60, "region 1 back", cluster)
    cluster.hold(None)
    cluster.finish()
    assert "resumed from" in cluster.log("region-1")
    _equals_its_replay(tmp_path / "syncer", updates)


def test_a_region_syncer_refuses_another_regions_worker(tmp_path):
    from diloco_jax.elastic_task import Elastic
    from diloco_jax.halos_syncer import RegionSyncer

    syncer = RegionSyncer(make_halos_task(), Elastic(), tmp_path, 0, "127.0.0.1:1", b"secret")
    syncer.join(1, None)  # worker 1 is region 0's
    with pytest.raises(ValueError, match="worker 2 is in region 1, not this syncer's region 0"):
        syncer.join(2, None)


@pytest.mark.parametrize(
    ("task", "flags", "message"),
    [
        ("make_task", ["--region", "0", "--global-syncer", "127.0.0.1:1"],
         "--region and --global-syncer are a HALoS task's"),
        ("make_halos_task", ["--region", "0"], "--region and --global-syncer go together"),
        ("make_halos_task", ["--region", "2", "--global-syncer", "127.0.0.1:1"],
         r"--region must be in [0, 2), got 2"),
        ("make_halos_task", ["--region", "0", "--global-syncer", "127.0.0.1:70000"],
         "--global-syncer's port must be in [0, 65535]"),
    ],
)  # fmt: skip
def test_a_bad_region_syncer_command_is_one_line_exit_2_and_makes_no_folder(
    tmp_path, capsys, monkeypatch, task, flags, message
):
    from diloco_jax.elastic import main

    monkeypatch.setenv("DILOCO_JAX_SECRET", "a secret of the run")
    folder = tmp_path / "region"
    argv = ["syncer", "--task", f"elastic_linear:{task}", "--dir", str(folder), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("diloco-jax elastic:") and message in err, err
    assert not folder.exists()

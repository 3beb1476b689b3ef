"""NoLoCo and GASLoC on real processes (`ElasticTask` with `DiLoCo(gossip=...)`): four worker
processes that exchange with their groups straight from each other (`diloco_jax.peer`), a
syncer that keeps the membership alone. Each worker's θ_m after the run must equal
`train_diloco`'s θ_m with the same method, within 1e-6 relative, also when a worker is
SIGKILLed after it published a sync's values but before it saved that sync, its partner is
SIGSTOPped past the heartbeat timeout, and the syncer is SIGKILLed and restarted."""

import dataclasses
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import jax
import numpy as np
import pytest
from elastic_linear import INNER_STEPS, PARAMS, batch, make_gossip_task
from reference import linear_loss
from test_elastic import Cluster, _env, _wait

import diloco_jax as dj
from diloco_jax import noloco, peer
from diloco_jax.elastic import worker_metrics, worker_params
from diloco_jax.elastic_task import Elastic
from diloco_jax.gossip_syncer import GossipSyncer

ROUNDS = 8
SECRET = b"the run's secret for these tests"


def _compiled(method) -> list:
    """train_diloco's θ_m of each worker after ROUNDS rounds (worker m's data at round r: its
    batch of position r)."""
    data = [
        jax.tree.map(lambda *x: np.stack(x), *(batch(m, r) for m in range(4)))
        for r in range(ROUNDS)
    ]
    result = dj.train_diloco(
        linear_loss, PARAMS, data, num_rounds=ROUNDS, num_workers=4, inner_steps=INNER_STEPS,
        method=method, backend="sequential",
    )  # fmt: skip
    own = next(s for s in result.state.parts.values() if getattr(s, "OWNS_THETA", False))
    return [jax.tree.map(lambda x, m=m: np.asarray(x[m]), own.theta) for m in range(4)]


def _assert_equals_train_diloco(cluster: Cluster, gossip: str, monkeypatch) -> dj.DiLoCo:
    monkeypatch.setenv("ELASTIC_GOSSIP", gossip)  # the task here as in the processes
    task = make_gossip_task()
    expected = _compiled(task.method)
    for m in range(4):
        real = worker_params(cluster.out / "workers", task, m)
        for name in ("w", "b"):
            assert np.all(np.isfinite(real[name]))
            np.testing.assert_allclose(real[name], expected[m][name], rtol=1e-6, atol=1e-7)
    # Control: the groups matter (another seed's groups land elsewhere), and the workers
    # did not all end at one θ (each holds its own).
    reseeded = dataclasses.replace(task.method.gossip, seed=6)
    other = dj.DiLoCo(inner=task.method.inner, outer=task.method.outer, gossip=reseeded)
    assert not np.allclose(real["w"], _compiled(other)[3]["w"], rtol=1e-4)
    assert not np.allclose(expected[0]["w"], expected[1]["w"], rtol=1e-4)
    return task


def _cluster(tmp_path, gossip: str, **env: str) -> Cluster:
    env = {"ELASTIC_ROUNDS": str(ROUNDS), "ELASTIC_GOSSIP": gossip, **env}
    return Cluster(tmp_path, task="elastic_linear:make_gossip_task", env=env, min_workers=4)


@pytest.mark.slow
@pytest.mark.parametrize("gossip", ["noloco", "gasloc"])
def test_a_gossip_run_equals_train_diloco(tmp_path, gossip, monkeypatch):
    cluster = _cluster(tmp_path, gossip, ELASTIC_PHASE_SECONDS="0")
    cluster.start()
    cluster.finish()
    _assert_equals_train_diloco(cluster, gossip, monkeypatch)
    for m in range(4):
        assert [x["round"] for x in worker_metrics(tmp_path / "workers", m)] == list(range(ROUNDS))
        # Done: every worker saved every sync, so no value is kept for anyone to ask.
        assert not list((tmp_path / "workers" / f"worker-{m}").glob("values-*"))


@pytest.mark.slow
@pytest.mark.parametrize("gossip", ["noloco", "gasloc"])
def test_a_killed_worker_a_stopped_partner_and_a_restarted_syncer_change_nothing(
    tmp_path, gossip, monkeypatch
):
    cluster = _cluster(tmp_path, gossip, ELASTIC_PHASE_SECONDS="0")
    folders = [tmp_path / "workers" / f"worker-{m}" for m in range(4)]
    cluster.hold(3)
    cluster.start()
    # Every worker saved 3 syncs and waits at its position 3.
    _wait(lambda: all((f / "gossip-00000003.state").exists() for f in folders), 120,
          "3 syncs saved", cluster)  # fmt: skip
    monkeypatch.setenv("ELASTIC_GOSSIP", gossip)
    group = next(g for g in noloco.groups(make_gossip_task().method.gossip.seed, 3, 4, 2) if 1 in g)
    partner = int(group[group != 1][0])  # worker 1's partner at sync 3
    # The syncer killed and restarted at the same port: every worker joins it again.
    cluster.processes["syncer"].kill()
    cluster.processes["syncer"].wait()
    cluster.syncer()
    for m in range(4):
        cluster.wait_for_join(m, 2)
    stopped = cluster.processes[f"worker-{partner}"]
    os.kill(stopped.pid, signal.SIGSTOP)
    cluster.hold(None)
    # Worker 1 publishes its values of sync 3 and waits for its stopped partner's: killed
    # there, it has published sync 3 but saved only 3 syncs.
    _wait(lambda: (folders[1] / "values-00000003-0.msgpack").exists(), 120,
          "worker 1's values of sync 3", cluster)  # fmt: skip
    cluster.processes["worker-1"].kill()
    cluster.processes["worker-1"].wait()
    assert not (folders[1] / "gossip-00000004.state").exists()
    cluster.worker(1)
    silent = f"worker {partner} silent"
    _wait(lambda: silent in cluster.log("syncer"), 120, silent, cluster)
    os.kill(stopped.pid, signal.SIGCONT)
    cluster.finish()
    _assert_equals_train_diloco(cluster, gossip, monkeypatch)
    assert "resuming after sync 3" in cluster.log("worker-1")
    assert f"worker {partner} silent" in cluster.log("syncer")
    # Worker 1 ended each sync once: its first process was killed inside sync 3.
    rounds = [x["round"] for x in worker_metrics(tmp_path / "workers", 1)]
    assert rounds == list(range(ROUNDS))  # its first process died before it ended sync 3


@pytest.mark.slow
def test_the_launcher_runs_a_gossip_task_and_refuses_what_it_cannot_honor(tmp_path, monkeypatch):
    env = _env(tmp_path / "hold", ELASTIC_ROUNDS="4", ELASTIC_GOSSIP="noloco",
               ELASTIC_PHASE_SECONDS="0")  # fmt: skip
    base = [sys.executable, "-m", "diloco_jax.elastic", "run", "--task",
            "elastic_linear:make_gossip_task"]  # fmt: skip
    for flags, word in [
        (["--processes-per-worker", "2"], "--processes-per-worker must be 1 for a gossip"),
        (["--min-workers", "3"], "Elastic.min_workers must be 4 (or left at 1)"),
        (["--grace-seconds", "1"], "Elastic.grace_seconds does not apply to a gossip run"),
        (["--inner-state", "fresh"], "Elastic.inner_state must be 'checkpoint'"),
    ]:
        out = tmp_path / f"refused{len(flags[0])}{flags[1]}"
        done = subprocess.run([*base, "--out", str(out), *flags], env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and word in done.stderr, done.stderr
        assert not out.exists()  # refused before anything was made
    out = tmp_path / "run"
    done = subprocess.run([*base, "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    monkeypatch.setenv("ELASTIC_ROUNDS", "4")
    task = make_gossip_task()
    thetas = [worker_params(out / "workers", task, m)["w"] for m in range(4)]
    assert all(np.all(np.isfinite(t)) for t in thetas)


def test_a_peer_serves_its_values_to_the_runs_members_only(tmp_path, caplog):
    offered = peer.Offered(tmp_path)
    server, port = peer.serve(offered, "127.0.0.1", SECRET)
    leaves = [np.arange(6, dtype=np.float32).reshape(2, 3), np.float32(2.5)]
    try:
        offered.put(7, 1, leaves)
        member = peer.PeerClient(f"127.0.0.1:{port}", SECRET)
        got = member.fetch(7, 1, timeout=1.0)
        assert [bytes(x) for x in got] == [x.tobytes() for x in leaves]
        assert member.fetch(7, 0, timeout=0.2) is None  # not published: "pending"
        outsider = peer.PeerClient(f"127.0.0.1:{port}", b"another secret of the run length")
        assert outsider.fetch(7, 1, timeout=1.0) is None  # taken for a restarted peer once,
        with pytest.raises(grpc.RpcError) as refused:  # then refused for what it is
            outsider.fetch(7, 1, timeout=1.0)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "refused ipv4:127.0.0.1:" in caplog.text
        member.close()
        outsider.close()
    finally:
        server.stop(grace=None).wait()
    # A restarted worker serves what it published before from its folder.
    again = peer.Offered(tmp_path)
    assert [bytes(x) for x in again.get(7, 1, timeout=0.0)] == [x.tobytes() for x in leaves]
    offered.put(9, 0, leaves)
    again.prune(8)  # no worker can ask below sync 8 again
    assert [p.name for p in sorted(tmp_path.glob("values-*"))] == ["values-00000009-0.msgpack"]


def test_a_gossip_task_refuses_what_its_workers_cannot_run(monkeypatch):
    task = make_gossip_task()
    mesh = jax.sharding.Mesh(jax.devices()[:2], ("data",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    refusals = {
        "ElasticTask.param_sharding and batch_sharding are not taken with NoLoCo": {
            "param_sharding": sharded
        },
        "NoLoCo needs num_workers a power of 2": {"num_workers": 3},
        "ElasticTask with algo='async'": {"algo": "async"},
    }
    for words, changes in refusals.items():
        with pytest.raises(ValueError, match=re.escape(words)):
            dataclasses.replace(task, **changes)
    with pytest.raises(ValueError, match="Elastic.round_timeout does not apply to a gossip"):
        GossipSyncer(task, Elastic(round_timeout=5.0), Path("unused"))


def test_the_gossip_syncer_tells_peers_and_floor_and_ends_when_all_saved(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_ROUNDS", "10")
    task = make_gossip_task()
    rounds = task.num_rounds
    syncer = GossipSyncer(task, Elastic(heartbeat_timeout=1.0, quorum_timeout=1.0), tmp_path)
    joined = [syncer.join(m, None, f"127.0.0.1:{5000 + m}") for m in range(4)]
    assert joined[3]["peers"] == {str(m): f"127.0.0.1:{5000 + m}" for m in range(4)}
    me = [j["incarnation"] for j in joined]
    assert joined[3]["floor"] == 0
    floors = [syncer.heartbeat(m, me[m], saved)["floor"] for m, saved in enumerate([3, 5, 4, 6])]
    assert floors == [0, 0, 0, 3]  # the least over all 4 once each has said
    assert syncer.heartbeat(1, me[1], 2)["floor"] == 3  # a report never goes back
    assert syncer.heartbeat(1, "another incarnation", 5) == {"status": "rejoin"}
    with pytest.raises(ValueError, match=rf"saved must be in \[0, {rounds}\], got {rounds + 1}"):
        syncer.heartbeat(0, me[0], rounds + 1)
    with pytest.raises(ValueError, match="peer address HOST:PORT"):
        syncer.join(2, None, "nowhere")
    for m in range(3):
        assert syncer.heartbeat(m, me[m], rounds)["status"] == "ok"
    assert syncer.heartbeat(3, me[3], rounds)["status"] == "done"
    assert syncer.done == "finished" and syncer.all_told() is False
    assert all(syncer.heartbeat(m, me[m], rounds)["status"] == "done" for m in range(3))
    assert syncer.all_told()
    # A worker silent past heartbeat_timeout + quorum_timeout ends a run with its number.
    syncer = GossipSyncer(task, Elastic(heartbeat_timeout=1.0, quorum_timeout=1.0), tmp_path)
    for m in range(4):
        syncer.join(m, None, f"127.0.0.1:{5000 + m}")
    syncer.heard[2] -= 2.2
    syncer.tick()
    assert syncer.done.startswith("worker 2 was absent for 2 s")

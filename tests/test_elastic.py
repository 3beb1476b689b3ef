"""Elastic runs with real processes on localhost (`diloco_jax.elastic`): a syncer and four
worker processes, with workers SIGKILLed in their inner phase or inside their push,
SIGSTOPped past the heartbeat timeout, and the syncer itself SIGKILLed and restarted. Each run
must end, and its final θ must equal `train_diloco`'s with the simulated membership
(`Weights(membership=...)`) that the run's history records, within 1e-6 relative: real faults
reproduce the simulation. The membership each test forces is checked in that history too."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from elastic_linear import INNER_STEPS, METHOD, PARAMS, batch, make_task
from reference import linear_loss

import diloco_jax as dj
from diloco_jax import faults
from diloco_jax.elastic import final_params, history, worker_metrics

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent
HEARTBEAT_TIMEOUT = 2.0
SECRET = "the run's secret for these tests"
ROUNDS = 12


def _env(hold: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    # One CPU device per worker: each is its own JAX program.
    flags = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    env["XLA_FLAGS"] = flags.strip()
    if not env["XLA_FLAGS"]:
        del env["XLA_FLAGS"]
    env.update(ELASTIC_WORKERS="4", ELASTIC_ROUNDS=str(ROUNDS), ELASTIC_PHASE_SECONDS="0.5",
               ELASTIC_HOLD=str(hold), DILOCO_JAX_SECRET=SECRET)  # fmt: skip
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A syncer and its workers as separate processes, each logging to its own file."""

    def __init__(self, out: Path, task: str = "elastic_linear:make_task", env=None, **options):
        self.out, self.port, self.task, self.env = out, _free_port(), task, env or {}
        self.options = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
        self.processes: dict[str, subprocess.Popen] = {}
        self.hold_file = out / "hold"

    def hold(self, position: int | None) -> None:
        """Every worker's phases from `position` on wait until it changes (None: none wait)."""
        tmp = self.out / "hold.tmp"
        tmp.write_text("" if position is None else str(position))
        tmp.replace(self.hold_file)

    def wait_for_join(self, m: int, times: int) -> None:
        """Until the syncer has logged worker m joining `times` times."""
        text = f"worker {m} joined"
        _wait(lambda: self.log("syncer").count(text) >= times, 120, f"{text} x{times}", self)

    def _start(self, name: str, argv: list[str], **env: str) -> subprocess.Popen:
        log = open(self.out / f"{name}.log", "ab")  # noqa: SIM115 (the process keeps it)
        process = subprocess.Popen(
            [sys.executable, "-m", "diloco_jax.elastic", *argv],
            stdout=log, stderr=subprocess.STDOUT, env=_env(self.hold_file, **self.env, **env),
        )  # fmt: skip
        self.processes[name] = process
        return process

    def syncer(self) -> subprocess.Popen:
        argv = ["syncer", "--task", self.task, "--dir", str(self.out / "syncer"),
                "--port", str(self.port), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
                "--min-workers", "2", *self.options]  # fmt: skip
        return self._start("syncer", argv)

    def worker(self, m: int, **env: str) -> subprocess.Popen:
        address = f"127.0.0.1:{self.port}"
        argv = ["worker", "--task", self.task, "--worker", str(m),
                "--syncer", address, "--dir", str(self.out / "workers")]  # fmt: skip
        return self._start(f"worker-{m}", argv, **env)

    def start(self, **worker_env: dict) -> None:
        self.syncer()
        for m in range(4):
            self.worker(m, **worker_env.get(str(m), {}))

    def syncs(self) -> list[dict]:
        path = self.out / "syncer" / "history.jsonl"
        return history(self.out / "syncer") if path.exists() else []

    def wait_for_syncs(self, count: int, timeout: float = 120.0) -> None:
        _wait(lambda: len(self.syncs()) >= count, timeout, f"{count} syncs", self)

    def log(self, name: str) -> str:
        return (self.out / f"{name}.log").read_text(errors="replace")

    def finish(self, timeout: float = 120.0) -> None:
        """Waits for every process; all must exit 0."""
        try:
            for name, p in self.processes.items():
                code = p.wait(timeout)
                assert code == 0, f"{name} exited with {code}:\n{self.log(name)[-3000:]}"
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.processes.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def _wait(predicate, timeout: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        failed = [n for n, p in cluster.processes.items() if p.poll() not in (None, 0, -9)]
        if failed or time.monotonic() > deadline:
            cluster.kill()
            logs = "\n".join(f"== {n}\n{cluster.log(n)[-1500:]}" for n in cluster.processes)
            why = f"{failed} failed" if failed else "timed out"
            raise AssertionError(f"{why} waiting for {what}\n{logs}")
        time.sleep(0.02)


def _simulated(rows: tuple, compression: str | None = None) -> dict:
    """train_diloco's θ after ROUNDS rounds with `rows` as its membership (and `compression`):
    each worker's data at each round is the batch of its position then (its phases that
    entered a sync before)."""
    rounds, workers = ROUNDS, len(rows[0])
    positions = faults.data_positions(rows, rounds)
    data = [
        jax.tree.map(
            lambda *x: np.stack(x), *(batch(m, int(positions[r, m])) for m in range(workers))
        )
        for r in range(rounds)
    ]
    method = dj.DiLoCo(inner=METHOD.inner, outer=METHOD.outer, compression=compression,
                       weights=dj.Weights(membership=rows))  # fmt: skip
    result = dj.train_diloco(
        linear_loss, PARAMS, data, num_rounds=rounds, num_workers=workers,
        inner_steps=INNER_STEPS, method=method, backend="sequential",
    )  # fmt: skip
    return result.params


def _assert_reproduces_the_simulation(
    cluster: Cluster, compression: str | None = None
) -> list[dict]:
    syncs = cluster.syncs()
    assert [s["round"] for s in syncs] == list(range(ROUNDS))
    rows = tuple(tuple(m in s["included"] for m in range(4)) for s in syncs)
    real = final_params(cluster.out / "syncer", make_task())
    expected = _simulated(rows, compression)
    for name in ("w", "b"):
        assert np.all(np.isfinite(real[name]))
        np.testing.assert_allclose(real[name], expected[name], rtol=1e-6, atol=1e-7)
    # Control: the same run with every worker in every sync lands elsewhere.
    if not all(all(row) for row in rows):
        everyone = _simulated(((True,) * 4,) * ROUNDS, compression)
        assert not np.allclose(real["w"], everyone["w"], rtol=1e-4)
    # Each worker's position: the syncs it entered.
    assert syncs[-1]["positions"] == [sum(row[m] for row in rows) for m in range(4)]
    return syncs


def test_a_run_without_faults_equals_train_diloco(tmp_path):
    cluster = Cluster(tmp_path)
    cluster.start()
    cluster.finish()
    syncs = _assert_reproduces_the_simulation(cluster)
    assert all(s["included"] == [0, 1, 2, 3] for s in syncs)
    # Each worker's own metrics: a line per phase; the syncs' losses are their means.
    metrics = [worker_metrics(tmp_path / "workers", m) for m in range(4)]
    for m in range(4):
        assert [x["round"] for x in metrics[m]] == list(range(ROUNDS))
        assert [x["position"] for x in metrics[m]] == list(range(ROUNDS))
        assert all(x["compute_s"] >= 0.5 for x in metrics[m])  # the phase's sleep
    for r, s in enumerate(syncs):
        assert s["loss"] == pytest.approx(np.mean([metrics[m][r]["loss"] for m in range(4)]))


def test_workers_over_two_devices_each_equal_train_diloco(tmp_path):
    flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    cluster = Cluster(tmp_path, task="elastic_linear:make_sharded_task", env=flags)
    cluster.start()
    cluster.finish()
    _assert_reproduces_the_simulation(cluster)
    assert "its inner phase runs on 2 device(s)" in cluster.log("worker-0")


def test_a_worker_killed_in_its_inner_phase_and_restarted_heals(tmp_path):
    cluster = Cluster(tmp_path)
    cluster.hold(3)
    cluster.start()
    cluster.wait_for_syncs(3)  # round 3 is open: every worker waits in its inner phase
    cluster.processes["worker-2"].kill()
    killed_at = time.time()
    cluster.hold(5)
    cluster.wait_for_syncs(5)  # round 5 open
    cluster.worker(2)
    cluster.wait_for_join(2, 2)  # during round 5: it takes part from round 6
    cluster.hold(None)
    cluster.finish()
    syncs = _assert_reproduces_the_simulation(cluster)
    assert [2 in s["included"] for s in syncs] == [True] * 3 + [False] * 3 + [True] * 6
    # The survivors' first sync after the death: within the detection timeout plus 2 s.
    assert syncs[3]["time"] - killed_at < HEARTBEAT_TIMEOUT + 2.0
    assert "inner state of position 3 from" in cluster.log("worker-2")


@pytest.mark.parametrize("spec", ["int4,ef=1", "int8,ef=1", "topk:0.5,ef=1"])
def test_a_compressed_run_with_a_killed_and_a_stopped_worker_equals_train_diloco(tmp_path, spec):
    """A compression with error feedback on the wire: each worker pushes its payload (int4 /
    int8 codes and scales, top-k values and indices) and keeps its residual beside its inner
    state of each position. Worker 2 SIGKILLed in its inner phase and restarted (its
    residual of position 3 from its folder), worker 3 SIGSTOPped past the heartbeat timeout:
    θ equals train_diloco with the same compression and the recorded membership; the same
    membership without compression lands elsewhere."""
    cluster = Cluster(tmp_path, task="elastic_linear:make_compressed_task",
                      env={"ELASTIC_COMPRESSION": spec})  # fmt: skip
    cluster.hold(3)
    cluster.start()
    cluster.wait_for_syncs(3)  # round 3 is open: every worker waits in its inner phase
    cluster.processes["worker-2"].kill()
    stopped = cluster.processes["worker-3"]
    stopped.send_signal(signal.SIGSTOP)
    cluster.hold(5)
    cluster.wait_for_syncs(5)
    stopped.send_signal(signal.SIGCONT)
    cluster.worker(2)
    cluster.wait_for_join(2, 2)
    cluster.wait_for_join(3, 2)
    cluster.hold(None)
    cluster.finish()
    syncs = _assert_reproduces_the_simulation(cluster, spec)
    assert [2 in s["included"] for s in syncs][:5] == [True] * 3 + [False] * 2
    assert [3 in s["included"] for s in syncs][:5] == [True] * 3 + [False] * 2
    assert "inner state of position 3 from" in cluster.log("worker-2")
    # What came back: the dense kinds' codes of the mean, the worker taking the outer step
    # itself; θ_0 is the task's own (held); θ and the outer state whole only after it was
    # left out. Top-k sends θ whole.
    for m in range(4):
        came = [x["theta_from"] for x in worker_metrics(tmp_path / "workers", m)]
        if spec.startswith("topk"):
            assert set(came) == {"whole"}, (m, came)
        elif m < 2:
            assert came == ["held"] + ["reply"] * (ROUNDS - 1), (m, came)
        else:  # back after it was left out (worker 3 ends its phase of round 3 first)
            assert came[:3] == ["held", "reply", "reply"] and "whole" in came[3:5], (m, came)
    assert "differs from the syncer's" not in cluster.log("worker-0")
    rows = tuple(tuple(m in s["included"] for m in range(4)) for s in syncs)
    real = final_params(cluster.out / "syncer", make_task())
    assert not np.allclose(real["w"], _simulated(rows)["w"], rtol=1e-4)


def test_a_worker_killed_inside_its_push_is_left_out_of_that_sync(tmp_path):
    cluster = Cluster(tmp_path)
    cluster.hold(5)
    cluster.start(**{"1": {"DILOCO_JAX_PAUSE_PUSH": "3"}})
    _wait(
        lambda: "pausing inside its push of round 3" in cluster.log("worker-1"),
        120, "worker 1's pause", cluster,
    )  # fmt: skip
    assert len(cluster.syncs()) == 3  # sync 3 waits on worker 1, half sent
    cluster.processes["worker-1"].kill()
    cluster.wait_for_syncs(5)
    cluster.worker(1)
    cluster.wait_for_join(1, 2)
    cluster.hold(None)
    cluster.finish()
    syncs = _assert_reproduces_the_simulation(cluster)
    assert [1 in s["included"] for s in syncs] == [True] * 3 + [False] * 3 + [True] * 6


def test_a_stopped_worker_is_left_out_and_rejoins_after_sigcont(tmp_path):
    cluster = Cluster(tmp_path)
    cluster.hold(2)
    cluster.start()
    cluster.wait_for_syncs(2)  # every worker waits in round 2's phase
    stopped = cluster.processes["worker-3"]
    stopped.send_signal(signal.SIGSTOP)
    cluster.hold(5)
    cluster.wait_for_syncs(5)
    stopped.send_signal(signal.SIGCONT)
    cluster.wait_for_join(3, 2)
    cluster.hold(None)
    cluster.finish()
    syncs = _assert_reproduces_the_simulation(cluster)
    assert [3 in s["included"] for s in syncs] == [True] * 2 + [False] * 4 + [True] * 6
    assert "joining again" in cluster.log("worker-3")
    assert "worker 3 removed: silent" in cluster.log("syncer")


def test_a_killed_syncer_resumes_from_its_checkpoint_and_loses_nothing(tmp_path):
    cluster = Cluster(tmp_path)
    cluster.start()
    cluster.wait_for_syncs(4)
    cluster.processes["syncer"].kill()
    cluster.processes["syncer"].wait()
    time.sleep(1.0)  # the workers retry meanwhile
    cluster.syncer()
    cluster.finish()
    syncs = _assert_reproduces_the_simulation(cluster)
    assert all(s["included"] == [0, 1, 2, 3] for s in syncs)
    assert "resumed from sync-" in cluster.log("syncer")


def test_a_whole_cluster_restart_resumes_and_loses_nothing(tmp_path):
    cluster = Cluster(tmp_path)
    cluster.start()
    cluster.wait_for_syncs(4)
    for p in cluster.processes.values():  # every process at once, mid-run
        p.kill()
    for p in cluster.processes.values():
        p.wait()
    recorded = len(cluster.syncs())
    cluster.start()
    cluster.finish()
    syncs = _assert_reproduces_the_simulation(cluster)
    # The resumed syncer waited for every worker of its last sync: none left out, ever.
    assert all(s["included"] == [0, 1, 2, 3] for s in syncs)
    # It resumed from its newest checkpoint: the last recorded sync, or the one before where
    # the kill fell between a sync's history line and its checkpoint (the resume cuts the line).
    resumed = re.search(r"resumed from sync-\d+\.ckpt \(round (\d+)\)", cluster.log("syncer"))
    assert resumed is not None and int(resumed[1]) in (recorded - 1, recorded)
    # The workers took their inner states of the resumed position from their own folders.
    for m in range(4):
        assert f"inner state of position {resumed[1]} from" in cluster.log(f"worker-{m}")


def _pids_of(out: Path) -> list[int]:
    """The processes whose command line names the folder `out`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(out) in cmdline:
                pids.append(int(proc.name))
    return pids


def _launch(
    out: Path, *flags: str, task: str = "elastic_linear:make_task", **env: str
) -> subprocess.Popen:
    argv = [sys.executable, "-m", "diloco_jax.elastic", "run", "--task", task, "--out",
            str(out), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--min-workers", "2",
            *flags]  # fmt: skip
    env = _env(out / "hold", **env)
    del env["DILOCO_JAX_SECRET"]  # the launcher makes the run's own (OUT/secret)
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            text=True)  # fmt: skip


def _wait_syncs(out: Path, count: int, launcher: subprocess.Popen) -> None:
    path = out / "syncer" / "history.jsonl"
    deadline = time.monotonic() + 120
    while not (path.exists() and len(path.read_text().splitlines()) >= count):
        assert launcher.poll() is None, launcher.stdout.read()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_launcher_restarts_a_dead_worker_and_the_run_reproduces_the_simulation(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "hold").write_text("3")
    launcher = _launch(out, "--restart-workers")
    _wait_syncs(out, 3, launcher)
    victim = next(p for p in _pids_of(out) if "--worker 1 " in _cmdline(p))
    os.kill(victim, signal.SIGKILL)
    (out / "hold").write_text("5")
    _wait_syncs(out, 5, launcher)
    text = "worker 1 joined"
    deadline = time.monotonic() + 120
    while (out / "logs" / "syncer.log").read_text().count(text) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    (out / "hold").write_text("")
    assert launcher.wait(120) == 0
    printed = launcher.stdout.read()
    assert "worker 1 exited with -9; restarting it" in printed
    secret = out / "secret"  # made by the launcher, readable by its user only
    assert len(secret.read_bytes().strip()) == 64 and secret.stat().st_mode & 0o777 == 0o600
    syncs = history(out / "syncer")
    # Restarted at once, it joins within round 3 or 4 and takes part from the next one.
    assert [1 in s["included"] for s in syncs][:4] == [True] * 3 + [False]
    assert 1 in syncs[-1]["included"]
    rows = tuple(tuple(m in s["included"] for m in range(4)) for s in syncs)
    real = final_params(out / "syncer", make_task())
    np.testing.assert_allclose(real["w"], _simulated(rows)["w"], rtol=1e-6, atol=1e-7)
    assert not _pids_of(out)


def _wait_for_text(path: Path, text: str, times: int, launcher: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not path.exists() or path.read_text(errors="replace").count(text) < times:
        assert launcher.poll() is None, launcher.stdout.read()
        assert time.monotonic() < deadline, f"timed out waiting for {text!r} x{times}"
        time.sleep(0.02)


def test_workers_of_two_processes_each_heal_as_a_group(tmp_path):
    """Two workers, each a JAX cluster of 2 processes of one device each (the batch split over
    both, its gradients all-reduced between the processes through gloo). SIGKILL worker 1's
    second process in its inner phase: the launcher ends the rest of that group and starts it
    again; the run reproduces the simulation with worker 1 left out while it was down."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "hold").write_text("3")
    launcher = _launch(
        out, "--restart-workers", "--processes-per-worker", "2", "--min-workers", "1",
        task="elastic_linear:make_sharded_task", ELASTIC_WORKERS="2",
    )  # fmt: skip
    _wait_syncs(out, 3, launcher)
    victim = next(
        p
        for p in _pids_of(out)
        if "--worker 1 " in _cmdline(p) and "--process-id 1 " in _cmdline(p)
    )
    os.kill(victim, signal.SIGKILL)
    # As if it was killed while writing its copy of the state of position 3 (the kill can
    # land there: its leader pushed once its own copy was written).
    (out / "workers" / "worker-1" / "process-1" / "inner-00000003.state").unlink(missing_ok=True)
    (out / "hold").write_text("5")
    _wait_syncs(out, 5, launcher)
    _wait_for_text(out / "logs" / "syncer.log", "worker 1 joined", 2, launcher)
    (out / "hold").write_text("")
    assert launcher.wait(120) == 0, launcher.stdout.read()
    assert "worker 1 exited with -9; restarting it" in launcher.stdout.read()
    syncs = history(out / "syncer")
    assert [1 in s["included"] for s in syncs][:4] == [True] * 3 + [False]
    assert 1 in syncs[-1]["included"]
    rows = tuple(tuple(m in s["included"] for m in range(2)) for s in syncs)
    real = final_params(out / "syncer", make_task())
    expected = _simulated(rows)
    for name in ("w", "b"):
        np.testing.assert_allclose(real[name], expected[name], rtol=1e-6, atol=1e-7)
    assert "runs on 2 device(s) of 2 processes" in (out / "logs" / "worker-0.0.log").read_text()
    # Both processes of the restarted group (one host) read the leader's copy of the state: a
    # process killed while writing its own copy starts from its leader's state all the same.
    leader_copy = out / "workers" / "worker-1" / "process-0" / "inner-00000003.state"
    for i in range(2):
        log = (out / "logs" / f"worker-1.{i}.log").read_text()
        assert f"inner state of position 3 from {leader_copy}" in log
    assert not _pids_of(out)


def test_the_launcher_ends_the_run_with_one_line_when_the_quorum_is_lost(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "hold").write_text("2")
    launcher = _launch(out, "--min-workers", "4", "--quorum-timeout", "2")
    _wait_syncs(out, 2, launcher)
    victim = next(p for p in _pids_of(out) if "--worker 3 " in _cmdline(p))
    os.kill(victim, signal.SIGKILL)
    assert launcher.wait(60) == 1
    printed = launcher.stdout.read().splitlines()
    assert printed[-1] == (
        "diloco-jax elastic: fewer than min_workers=4 workers for 2 s (3 live workers); the run "
        "ends at round 2, checkpointed"
    )
    assert not _pids_of(out)  # the three live workers ended with it
    assert len(history(out / "syncer")) == 2
    assert sorted(p.name for p in (out / "syncer").glob("sync-*.ckpt")) == [
        "sync-00000001.ckpt", "sync-00000002.ckpt"
    ]  # fmt: skip


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() + " "
    except OSError:
        return ""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])  # SIGINT: Ctrl-C
def test_sigterm_to_the_launcher_ends_every_process_and_frees_the_port(tmp_path, signum):
    out = tmp_path / "run"
    out.mkdir()
    (out / "hold").write_text("2")  # the run can't end before the signal
    launcher = _launch(out)
    _wait_syncs(out, 2, launcher)
    address = (out / "syncer" / "syncer.address").read_text().strip()
    assert len(_pids_of(out)) == 6  # the launcher, the syncer and 4 workers
    launcher.send_signal(signum)
    assert launcher.wait(20) == 130
    assert not _pids_of(out)
    with socket.socket() as s:  # the syncer's port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", int(address.rsplit(":", 1)[1])))

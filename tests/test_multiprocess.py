"""Two processes on JAX's distributed runtime (gloo CPU collectives, 2 fake CPU devices each)
train DiLoCo and sync on a 4-device global mesh; both must end with the same params as each
other and as a single-process run on 4 of this process's 8 fake devices."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from diloco_jax import distributed

HERE = Path(__file__).parent
TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: Path, num_processes: int = 2, *extra: str, devices: int = 2) -> list[str]:
    """Runs multiprocess_main.py in `num_processes` processes of `devices` fake CPU devices
    each; returns their logs."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]),
    }
    coordinator = f"127.0.0.1:{_free_port()}"
    script = [sys.executable, str(HERE / "multiprocess_main.py"), coordinator]
    return _run_cluster(
        [[*script, str(num_processes), str(i), str(out), *extra] for i in range(num_processes)],
        env,
    )


def _run_cluster(argvs: list[list[str]], env: dict[str, str], timeout: float = TIMEOUT_S):
    """Runs a process per command line at once; returns their logs, once every one has
    exited 0 (each is killed after `timeout` seconds)."""
    procs = [
        subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )  # fmt: skip
        for argv in argvs
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    return logs


CACHED_PROGRAM = """
import sys
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from diloco_jax import distributed
distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), platform="cpu")
mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
x = jax.make_array_from_process_local_data(
    NamedSharding(mesh, P("x")), np.arange(3, dtype=np.float32) + 3 * jax.process_index())
total = jax.jit(lambda a: jnp.sum(a * a), out_shardings=NamedSharding(mesh, P()))(x)
print("total", float(total))
"""


@pytest.mark.slow
def test_a_second_cluster_runs_a_program_the_first_compiled(tmp_path):
    """Two clusters of two processes, one after the other, share a persistent compilation
    cache (as a restarted worker group does): the second must not hang in the program's
    cross-process sum (JAX 0.12 does, with the cache on)."""
    script = tmp_path / "program.py"
    script.write_text(CACHED_PROGRAM)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "",
           "PYTHONPATH": str(HERE.parent), "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # fmt: skip
    for _ in range(2):
        coordinator = f"127.0.0.1:{_free_port()}"
        argvs = [[sys.executable, str(script), coordinator, str(i)] for i in range(2)]
        for log in _run_cluster(argvs, env, timeout=60):
            assert "total 55.0" in log  # 0² + 1² + ... + 5², the two processes' 3 numbers each


def _load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.slow
def test_two_processes_match_each_other_and_one_process(tmp_path):
    sys.path.insert(0, str(HERE))
    from multiprocess_main import train_both

    ckpt = tmp_path / "ckpt"
    _launch(tmp_path, 2, str(ckpt))
    p0, p1 = _load(tmp_path / "process-0.npz"), _load(tmp_path / "process-1.npz")
    local = train_both(devices=jax.devices()[:4])
    assert sorted(p0) == sorted(local)
    for key in local:
        if key == "history":
            continue
        np.testing.assert_array_equal(p0[key], p1[key], err_msg=key)
        np.testing.assert_allclose(p0[key], local[key], rtol=1e-6, atol=1e-7, err_msg=key)
    h0, h1, hl = (json.loads(str(x["history"])) for x in (p0, p1, local))
    assert h0 == h1
    for run0, runl in zip(h0, hl, strict=True):
        for e0, el in zip(run0, runl, strict=True):
            np.testing.assert_allclose(e0["worker_loss"], el["worker_loss"], rtol=1e-6)
            assert len(e0["worker_loss"]) == 4
    # The DiLoCo run checkpointed (both processes writing one Orbax checkpoint); a second
    # launch on the same directory resumes from its last step and returns the same params
    # (it runs only the DiLoCo run: the other two do not checkpoint).
    # (Process 0 writes the history file; the lock on the directory is gone with the run.)
    assert sorted(os.listdir(ckpt)) == ["1", "2", "3", "history.jsonl"]
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    _launch(resumed, 2, str(ckpt), "diloco")
    r0 = _load(resumed / "process-0.npz")
    for key in ("diloco_w", "diloco_b", "diloco_inner_mu_w"):
        np.testing.assert_array_equal(r0[key], p0[key], err_msg=key)
    assert json.loads(str(r0["history"]))[0] == h0[0]
    # That launch then saved in the background (multiprocess_main.save_in_background): each
    # process's `Saver` writes while both run all-reduces of their own; both steps restore
    # exactly, on each process.
    values = np.arange(32, dtype=np.float32).reshape(-1, 2)  # 8 rows per device, 4 devices
    for i in range(2):
        restored = _load(resumed / f"process-{i}.npz")
        np.testing.assert_array_equal(restored["step1"], values)
        np.testing.assert_array_equal(restored["step2"], values + 1)


@pytest.mark.slow
def test_a_mesh_over_two_processes_resumes_and_equals_one_process(tmp_path):
    """(workers=2, fsdp=4) over 2 processes of 4 devices (one worker a process, its matrix
    split over that process's 4 devices): 2 checkpointed rounds, then a resume that runs the
    third, equal to 3 rounds on this process's 8 devices in one go; and the same 3 rounds
    with `process_local_data=True`, each process passing only its own worker's batches (host
    batches, or a Sampler holding that worker's rounds); and with the outer state split over
    the two processes' workers (ZeRO-1)."""
    sys.path.insert(0, str(HERE))
    from multiprocess_main import train_on_mesh

    _launch(tmp_path, 2, str(tmp_path / "ckpt"), "mesh", devices=4)
    p0, p1 = _load(tmp_path / "process-0.npz"), _load(tmp_path / "process-1.npz")
    local = train_on_mesh(jax.devices())
    assert sorted(p0) == sorted(local) == [
        "history", "local_b", "local_w", "mesh_b", "mesh_inner_trace_w", "mesh_start_round",
        "mesh_w", "sampled_b", "sampled_w", "split_b", "split_w",
    ]  # fmt: skip
    # The second launch call resumed: its data started at round 2, from checkpoint 2.
    assert list(p0["mesh_start_round"]) == [2] and list(local["mesh_start_round"]) == [0]
    assert "2" in os.listdir(tmp_path / "ckpt")
    assert local["mesh_inner_trace_w"].shape == (2, 8, 4)
    for key in ("mesh_w", "mesh_b", "mesh_inner_trace_w", "local_w", "local_b", "split_w",
                "split_b", "sampled_w", "sampled_b"):  # fmt: skip
        np.testing.assert_array_equal(p0[key], p1[key], err_msg=key)
        np.testing.assert_allclose(p0[key], local[key], rtol=1e-6, atol=1e-7, err_msg=key)
    # Fed per process (each its own worker's batches), the run is the one fed whole; with the
    # outer state split over the processes' workers, the same to float rounding.
    for key in ("w", "b"):
        np.testing.assert_array_equal(p0[f"local_{key}"], p0[f"mesh_{key}"], err_msg=key)
        np.testing.assert_allclose(p0[f"split_{key}"], p0[f"mesh_{key}"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(p0[f"sampled_{key}"], p0[f"mesh_{key}"], rtol=1e-6, atol=1e-7)
    h0, hl = json.loads(str(p0["history"])), json.loads(str(local["history"]))
    assert [e["round"] for e in h0] == [e["round"] for e in hl] == [0, 1, 2]
    for e0, el in zip(h0, hl, strict=True):
        np.testing.assert_allclose(e0["worker_loss"], el["worker_loss"], rtol=1e-6)
        assert e0["wire_bytes_per_device"] == el["wire_bytes_per_device"]


def test_initialize_rejects_partial_or_bad_arguments(monkeypatch):
    for var in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv(distributed.ENV_PROCESS_ID, raising=False)
    with pytest.raises(ValueError, match="missing"):
        distributed.initialize("localhost:1234")
    with pytest.raises(ValueError, match="HOST:PORT"):
        distributed.initialize("localhost", 2, 0)
    with pytest.raises(ValueError, match="process_id"):
        distributed.initialize("localhost:1234", 2, 2)
    with pytest.raises(ValueError, match="num_processes"):
        distributed.initialize("localhost:1234", 0, 0)
    for beat in (0, 2.5, True):
        with pytest.raises(ValueError, match="heartbeat_timeout"):
            distributed.initialize("localhost:1234", 2, 0, heartbeat_timeout=beat)
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
    with pytest.raises(ValueError, match="DILOCO_NUM_PROCESSES"):
        distributed.initialize("localhost:1234", process_id=0)
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    with pytest.raises(ValueError, match="process_id"):
        distributed.initialize("localhost:1234", process_id=5)


def test_to_host_reads_local_arrays():
    tree = {"a": jax.numpy.arange(3.0), "b": np.float32(2)}
    out = distributed.to_host(tree)
    np.testing.assert_array_equal(out["a"], [0, 1, 2])
    assert not distributed.is_multiprocess()

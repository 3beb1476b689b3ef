"""Checkpoint and exact resume: an interrupted run resumed from its checkpoint_dir ends
bit-identical to an uninterrupted one."""

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import linear_loss, make_data

import diloco_jax as dj

PARAMS = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.float32(0.5)}


def _assert_same(a, b):
    jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
    jax.tree.map(np.testing.assert_array_equal, a.state, b.state)
    assert a.history == b.history


class Stop(Exception):
    pass


def _stop_after(rounds):
    def callback(entry):
        if entry.get("round", entry.get("step")) + 1 == rounds:
            raise Stop

    return callback


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_diloco_stopped_after_2_of_4_rounds_resumes_bit_identical(backend, tmp_path):
    data = make_data(np.random.default_rng(0), num_rounds=4, num_workers=4, inner_steps=3)
    kw = dict(num_rounds=4, num_workers=4, inner_steps=3, backend=backend)
    full = dj.train_diloco(linear_loss, PARAMS, data, **kw)
    ckpt = tmp_path / "ckpt"
    # A run killed while round 3 runs: rounds 1 and 2 were checkpointed.
    with pytest.raises(Stop):
        dj.train_diloco(
            linear_loss, PARAMS, data, checkpoint_dir=ckpt, callback=_stop_after(3), **kw
        )
    assert dj.checkpoint.latest_step(ckpt) == 2
    seen = []
    resumed = dj.train_diloco(
        linear_loss, PARAMS, data, checkpoint_dir=ckpt, callback=seen.append, **kw
    )
    _assert_same(resumed, full)
    assert [e["round"] for e in seen] == [2, 3]  # only the rounds it ran itself
    assert dj.checkpoint.latest_step(ckpt) == 4
    # Calling again with everything done trains nothing and returns the same result.
    _assert_same(dj.train_diloco(linear_loss, PARAMS, data, checkpoint_dir=ckpt, **kw), full)


def test_sampler_and_checkpoint_every_2(tmp_path):
    table = make_data(np.random.default_rng(1), num_rounds=5, num_workers=2, inner_steps=2)
    stacked = {k: jnp.stack([r[k] for r in table]) for k in table[0]}
    sampler = dj.Sampler(stacked, lambda a, r, m, h: {k: v[r, m, h] for k, v in a.items()})
    kw = dict(num_rounds=5, num_workers=2, inner_steps=2, backend="vmap", checkpoint_every=2)
    full = dj.train_diloco(linear_loss, PARAMS, sampler, **kw)
    with pytest.raises(Stop):
        dj.train_diloco(
            linear_loss, PARAMS, sampler, checkpoint_dir=tmp_path, callback=_stop_after(4), **kw
        )
    assert dj.checkpoint.latest_step(tmp_path) == 2  # every 2 rounds: round 4's save never ran
    _assert_same(dj.train_diloco(linear_loss, PARAMS, sampler, checkpoint_dir=tmp_path, **kw), full)
    assert dj.checkpoint.all_steps(tmp_path) == [2, 4, 5]


def test_train_sync_resumes_bit_identical(tmp_path):
    steps = [
        {k: v[:, 0] for k, v in r.items()} for r in make_data(np.random.default_rng(2), 5, 2, 1)
    ]
    kw = dict(num_steps=5, num_workers=2, backend="shard_map")
    full = dj.train_sync(linear_loss, PARAMS, steps, **kw)
    with pytest.raises(Stop):
        dj.train_sync(
            linear_loss, PARAMS, steps, checkpoint_dir=tmp_path, callback=_stop_after(3), **kw
        )
    _assert_same(dj.train_sync(linear_loss, PARAMS, steps, checkpoint_dir=tmp_path, **kw), full)


def test_checkpoint_of_another_configuration_is_refused(tmp_path):
    data = make_data(np.random.default_rng(3), num_rounds=2, num_workers=2, inner_steps=2)
    dj.train_diloco(
        linear_loss,
        PARAMS,
        data,
        num_rounds=1,
        num_workers=2,
        inner_steps=2,
        backend="vmap",
        checkpoint_dir=tmp_path,
    )
    data4 = make_data(np.random.default_rng(3), num_rounds=2, num_workers=4, inner_steps=2)
    with pytest.raises(ValueError, match="num_workers: 2 != 4"):
        dj.train_diloco(
            linear_loss,
            PARAMS,
            data4,
            num_rounds=2,
            num_workers=4,
            inner_steps=2,
            checkpoint_dir=tmp_path,
        )
    data3 = make_data(np.random.default_rng(3), num_rounds=2, num_workers=2, inner_steps=3)
    with pytest.raises(ValueError, match="inner_steps: 2 != 3"):
        dj.train_diloco(
            linear_loss,
            PARAMS,
            data3,
            num_rounds=2,
            num_workers=2,
            inner_steps=3,
            checkpoint_dir=tmp_path,
        )
    wide = {"w": jnp.zeros(4), "b": jnp.float32(0)}
    with pytest.raises(ValueError, match="shapes"):
        dj.train_diloco(
            lambda p, b: jnp.sum(p["w"]) + p["b"],
            wide,
            data,
            num_rounds=2,
            num_workers=2,
            inner_steps=2,
            checkpoint_dir=tmp_path,
        )
    bf16 = {"w": PARAMS["w"].astype(jnp.bfloat16), "b": PARAMS["b"]}
    with pytest.raises(ValueError, match="dtypes"):
        dj.train_diloco(
            linear_loss,
            bf16,
            data,
            num_rounds=2,
            num_workers=2,
            inner_steps=2,
            checkpoint_dir=tmp_path,
        )
    with pytest.raises(ValueError, match="algorithm"):
        dj.train_sync(linear_loss, PARAMS, [], num_steps=0, num_workers=2, checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="more than the num_rounds = 0"):
        dj.train_diloco(
            linear_loss,
            PARAMS,
            data,
            num_rounds=0,
            num_workers=2,
            inner_steps=2,
            checkpoint_dir=tmp_path,
        )
    with pytest.raises(ValueError, match="checkpoint_every"):
        dj.train_diloco(
            linear_loss,
            PARAMS,
            data,
            num_rounds=2,
            num_workers=2,
            inner_steps=2,
            checkpoint_dir=tmp_path,
            checkpoint_every=0,
        )


def test_damaged_latest_checkpoint_falls_back_with_a_warning(tmp_path):
    data = make_data(np.random.default_rng(4), num_rounds=3, num_workers=2, inner_steps=2)
    kw = dict(num_rounds=3, num_workers=2, inner_steps=2, backend="vmap")
    full = dj.train_diloco(linear_loss, PARAMS, data, **kw)
    dj.train_diloco(linear_loss, PARAMS, data, checkpoint_dir=tmp_path, **dict(kw, num_rounds=2))
    # Damage every data file of the newest checkpoint (step 2).
    for f in (tmp_path / "2").rglob("*"):
        if f.is_file() and f.stat().st_size > 64 and "d" in f.parent.name:
            f.write_bytes(b"\0" * f.stat().st_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = dj.train_diloco(linear_loss, PARAMS, data, checkpoint_dir=tmp_path, **kw)
    assert any("step 2" in str(w.message) for w in caught)
    _assert_same(resumed, full)


CLI_ROUNDS = 20  # the kill lands after round 6: rounds enough left that it lands mid-run
CLI = [
    sys.executable,
    "-m",
    "diloco_jax",
    "train",
    "--preset",
    "micro",
    "--rounds",
    str(CLI_ROUNDS),
    "--inner-steps",
    "2",
    "--pretrain-steps",
    "2",
    "--checkpoint-every",
    "1",
    "--no-progress",
    "--backend",
    "vmap",
]


def _last_round(path: Path) -> int:
    if not path.exists():
        return -1
    rounds = [
        json.loads(line).get("round", -1)
        for line in path.read_text().splitlines()
        if line.endswith("}")
    ]
    return max(rounds, default=-1)


def _run_records(path: Path):
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        for timed in ("wall_seconds", "tokens_per_second", "mfu"):  # the clock's, not the run's
            r.pop(timed, None)
    return records


@pytest.mark.slow
def test_cli_killed_with_sigkill_resumes_bit_identical(tmp_path):
    from diloco_jax.lm import cli

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    # The uninterrupted run in this process: the processes below get its environment (8 fake
    # CPU devices, the same compiler flags), so they compile the same programs.
    assert cli.main([*CLI[3:], "--out", str(straight)]) == 0
    proc = subprocess.Popen(
        [*CLI, "--out", str(killed)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    run_dir = killed / "checkpoints" / "run"
    # The run logs round r's metrics only after checkpoint r is saved, so watch the log
    # rather than read the checkpoints while the writer is saving and pruning them.
    deadline = time.time() + 300
    while time.time() < deadline and _last_round(killed / "metrics.jsonl") < 6:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    interrupted_at = dj.checkpoint.latest_step(run_dir)
    assert interrupted_at is not None and 5 <= interrupted_at < CLI_ROUNDS
    assert not (killed / "summary.json").exists()
    subprocess.run(
        [*CLI, "--out", str(killed)], check=True, env=env, capture_output=True, timeout=600
    )
    assert _run_records(killed / "metrics.jsonl") == _run_records(straight / "metrics.jsonl")
    # Every leaf of the final state is bit-identical: the checkpoints' CRC-32s agree.
    crcs = [
        json.loads(
            (d / "checkpoints" / "run" / str(CLI_ROUNDS) / "checksums" / "metadata").read_text()
        )
        for d in (straight, killed)
    ]
    assert crcs[0] == crcs[1]


def test_the_callers_fingerprint_is_saved_in_the_checkpoint_and_compared(tmp_path):
    """Issue 40, finding 6: what the caller says makes its run (a learning rate its loss or
    optimizer closes over, say) is in every checkpoint, so a resume with another is refused
    whatever other files are gone."""
    data = make_data(np.random.default_rng(6), num_rounds=2, num_workers=2, inner_steps=1)
    kw = dict(num_workers=2, inner_steps=1, backend="vmap", checkpoint_dir=tmp_path)
    dj.train_diloco(linear_loss, PARAMS, data, num_rounds=1, checkpoint_fingerprint={"lr": 0.1},
                    **kw)  # fmt: skip
    saved = json.loads((tmp_path / "1" / "metadata" / "metadata").read_text())
    assert saved["run"] == {"lr": 0.1}
    with pytest.raises(ValueError, match=r"different run .* run\.lr: 0\.1 != 0\.2"):
        dj.train_diloco(linear_loss, PARAMS, data, num_rounds=2,
                        checkpoint_fingerprint={"lr": 0.2}, **kw)  # fmt: skip
    resumed = dj.train_diloco(linear_loss, PARAMS, data, num_rounds=2,
                              checkpoint_fingerprint={"lr": 0.1}, **kw)  # fmt: skip
    assert [h["round"] for h in resumed.history] == [0, 1]

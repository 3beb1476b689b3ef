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


CLI_ROUNDS = 24  # rounds enough that ten kills, half of them just after a save, land mid-run
KILLS = 10
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
    "1",
    "--pretrain-steps",
    "1",
    "--checkpoint-every",
    "1",
    "--no-progress",
    "--backend",
    "vmap",
]
CORPUS = "".join(
    f"Paragraph {i}: the quick brown fox jumps over the lazy dog.\n\n" for i in range(900)
)


def _steps_on_disk(run_dir: Path) -> int:
    """The newest finished step in a checkpoint directory another process is writing (its
    folder names only: nothing is opened that the writer may be pruning); -1 for none."""
    if not run_dir.is_dir():
        return -1
    return max((int(p.name) for p in run_dir.iterdir() if p.name.isdigit()), default=-1)


def _holder(out: Path) -> str:
    from diloco_jax import run_lock

    try:
        return (out / run_lock.LOCK_NAME).read_text().strip()
    except OSError:
        return ""


def _wait(condition, proc: subprocess.Popen, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, f"no {what} after {seconds} s"
        time.sleep(0.02)


def _run_records(path: Path):
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        for timed in ("wall_seconds", "tokens_per_second", "mfu"):  # the clock's, not the run's
            r.pop(timed, None)
    return records


@pytest.mark.slow
def test_cli_killed_ten_times_at_random_resumes_bit_identical_and_holds_its_out(tmp_path, capsys):
    """A checkpointing CLI run killed with SIGKILL at ten random moments, restarted each
    time, ends as the uninterrupted run, bit for bit. Every other kill lands a random time
    after the restarted run took its --out (restoring, the warm start, compiling, a round),
    the others a random time after its next save (a round, an evaluation, a background
    save). While the first one runs, a second run into its OUT is refused with one line
    before it touches anything (issue 40, finding 2: both ran into the same temporary
    directories, one never ended)."""
    from reference import assert_cli_refuses

    from diloco_jax.lm import cli

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    command = [*CLI, "--data", f"text:{corpus}"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    # The uninterrupted run in this process: the processes below get its environment (8 fake
    # CPU devices, the same compiler flags), so they compile the same programs.
    # One save, at the end (a run's results don't depend on how often it saves).
    once = [*command[3:], "--checkpoint-every", str(CLI_ROUNDS)]
    assert cli.main([*once, "--out", str(straight)]) == 0
    run_dir = killed / "checkpoints" / "run"
    rng = np.random.default_rng(40)
    for kill in range(KILLS):
        saved = _steps_on_disk(run_dir)
        proc = subprocess.Popen(
            [*command, "--out", str(killed)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _wait(lambda p=proc: _holder(killed) == str(p.pid), proc, "lock on --out")
            if kill == 0:
                assert_cli_refuses(
                    [*command[3:], "--out", str(killed)],
                    f"--out {killed} is in use by another run (process {proc.pid})",
                    capsys,
                )
                assert _holder(killed) == str(proc.pid)  # the first run's lock, as it was
            if kill % 2:
                _wait(lambda s=saved: _steps_on_disk(run_dir) > s, proc, "new checkpoint")
            # At most 2 s past the lock: the restore, the warm start and the compile, or the
            # first rounds (with a warm compile cache a restart can finish its last rounds
            # within a few seconds, and a kill must land while it runs).
            time.sleep(rng.uniform(0, 0.3 if kill % 2 else 2.0))
            assert proc.poll() is None, "the run ended before its kill: give it more rounds"
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
    assert KILLS // 2 <= _steps_on_disk(run_dir) < CLI_ROUNDS
    assert not (killed / "summary.json").exists()
    assert cli.main([*command[3:], "--out", str(killed)]) == 0  # the last restart, to the end
    assert _run_records(killed / "metrics.jsonl") == _run_records(straight / "metrics.jsonl")
    # Every leaf of the final state is bit-identical: the checkpoints' CRC-32s agree.
    crcs = [
        json.loads(
            (d / "checkpoints" / "run" / str(CLI_ROUNDS) / "checksums" / "metadata").read_text()
        )["crc32"]
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

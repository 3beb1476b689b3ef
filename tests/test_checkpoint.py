"""diloco_jax.checkpoint: bit-exact round trips (one device and a 4-device mesh), retention,
fingerprint checks, fallback from damaged checkpoints, unfinished saves."""

import functools
import gc
import json
import os
import pathlib
import shutil
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_jax import checkpoint as ckpt

M = 4  # workers


class State(NamedTuple):
    """Shaped like DiLoCoState, plus a PRNG key (as key data) the caller carries along."""

    params: Any
    outer_opt_state: Any
    inner_opt_state: Any
    round: jax.Array
    key: jax.Array


def host_state(seed: int) -> State:
    """A state of NumPy arrays whose float leaves include -0.0, inf and a NaN payload."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(16, 8)).astype(np.float32)
    w[0, :3] = [-0.0, np.inf, np.nan]
    params = {"w": w, "b": rng.normal(size=(8,)).astype(jnp.bfloat16)}
    return State(
        params=params,
        outer_opt_state={"trace": {k: v.astype(np.float32) * 2 for k, v in params.items()}},
        inner_opt_state={
            "count": np.full((M,), seed, np.int32),
            "mu": {k: np.stack([v * (m + 1) for m in range(M)]) for k, v in params.items()},
        },
        round=np.asarray(seed, np.int32),
        key=np.asarray(jax.random.key_data(jax.random.key(seed))),
    )


def on_device(state: State, device: jax.Device) -> State:
    return jax.device_put(state, device)


def on_mesh(state: State) -> State:
    mesh = Mesh(np.array(jax.devices()[:M]), ("workers",))
    shared, workers = NamedSharding(mesh, P()), NamedSharding(mesh, P("workers"))
    return State(
        jax.device_put(state.params, shared),
        jax.device_put(state.outer_opt_state, shared),
        jax.device_put(state.inner_opt_state, workers),
        jax.device_put(state.round, shared),
        jax.device_put(state.key, shared),
    )


def bits(x: Any) -> np.ndarray:
    """The raw bytes of an array, so NaN payloads and -0.0 count."""
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


def assert_bit_equal(restored: Any, saved: Any) -> None:
    assert jax.tree.structure(restored) == jax.tree.structure(saved)
    for r, s in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
        assert r.dtype == s.dtype and r.shape == s.shape
        np.testing.assert_array_equal(bits(r), bits(s))


def meta(params: Any, num_workers: int = M, inner_steps: int = 5, **extra: Any) -> dict:
    return ckpt.fingerprint(
        params, algorithm="diloco", num_workers=num_workers, inner_steps=inner_steps, **extra
    )


def largest_file(step_dir: pathlib.Path) -> pathlib.Path:
    """The biggest file of a checkpoint's state item: the one holding the array bytes."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def test_round_trip_one_device_is_bit_exact(tmp_path):
    device = jax.devices()[1]  # not the default device: placement must come from like_state
    saved = on_device(host_state(7), device)
    metadata = meta(saved.params, data_position=123)
    ckpt.save(tmp_path, 5, saved, metadata)

    like = on_device(host_state(0), device)
    restored, got_metadata, step = ckpt.restore(tmp_path, like, meta(saved.params))

    assert step == 5 and got_metadata == metadata and got_metadata["data_position"] == 123
    assert isinstance(restored, State)
    assert_bit_equal(restored, saved)
    for r in jax.tree.leaves(restored):
        assert r.sharding == jax.sharding.SingleDeviceSharding(device)
    key = jax.random.wrap_key_data(restored.key)
    assert jax.random.bits(key) == jax.random.bits(jax.random.key(7))


def test_round_trip_on_mesh_keeps_shardings(tmp_path):
    saved = on_mesh(host_state(3))
    ckpt.save(tmp_path, 1, saved, meta(saved.params))
    like = on_mesh(host_state(0))

    restored, _, step = ckpt.restore(tmp_path, like, meta(saved.params))

    assert step == 1
    assert_bit_equal(restored, saved)
    for r, want in zip(jax.tree.leaves(restored), jax.tree.leaves(like), strict=True):
        assert r.sharding == want.sharding
    assert restored.inner_opt_state["count"].sharding.spec == P("workers")
    assert len(restored.inner_opt_state["mu"]["w"].addressable_shards) == M


def test_keep_latest_step_and_all_steps(tmp_path):
    state = on_device(host_state(1), jax.devices()[0])
    assert ckpt.latest_step(tmp_path) is None
    for step in (10, 20, 30, 40):
        ckpt.save(tmp_path, step, state, meta(state.params, data_position=step), keep=2)
        assert ckpt.latest_step(tmp_path) == step

    assert ckpt.all_steps(tmp_path) == [30, 40]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["30", "40"]
    _, metadata, step = ckpt.restore(tmp_path, state, meta(state.params))
    assert (step, metadata["data_position"]) == (40, 40)


def test_save_rejects_old_steps_and_bad_metadata(tmp_path):
    state = on_device(host_state(1), jax.devices()[0])
    ckpt.save(tmp_path, 2, state, meta(state.params))
    with pytest.raises(ValueError, match="step 2 must be after the latest step 2"):
        ckpt.save(tmp_path, 2, state, meta(state.params))
    with pytest.raises(ValueError, match="JSON"):
        ckpt.save(tmp_path, 3, state, {"bad": object()})
    with pytest.raises(ValueError, match="keep"):
        ckpt.save(tmp_path, 3, state, {}, keep=0)
    assert ckpt.all_steps(tmp_path) == [2]


def test_fingerprint_describes_params():
    params = {"w": jnp.zeros((3, 2), jnp.bfloat16), "b": np.zeros((2,), np.float32)}
    got = ckpt.fingerprint(params, num_workers=2, optimizers=("adamw", "sgd"))
    assert got["shapes"] == {"['b']": [2], "['w']": [3, 2]}
    assert got["dtypes"] == {"['b']": "float32", "['w']": "bfloat16"}
    assert got["tree"] == str(jax.tree.structure(params))
    assert got["num_workers"] == 2 and got["optimizers"] == ["adamw", "sgd"]
    with pytest.raises(ValueError, match="reserved"):
        ckpt.fingerprint(params, shapes=1)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(num_workers=2), r"num_workers: 4 != 2"),
        (dict(inner_steps=50), r"inner_steps: 5 != 50"),
        (dict(shape=True), r"shapes\['w'\]: \[16, 8\] != \[16, 9\]"),
        (dict(dtype=True), r"dtypes\['b'\]: 'bfloat16' != 'float32'"),
    ],
)
def test_fingerprint_mismatch_names_dir_and_field(tmp_path, change, field):
    state = on_device(host_state(1), jax.devices()[0])
    ckpt.save(tmp_path, 1, state, meta(state.params, data_position=9))
    params = dict(state.params)
    if change.pop("shape", False):
        params["w"] = jnp.zeros((16, 9), jnp.float32)
    if change.pop("dtype", False):
        params["b"] = jnp.zeros((8,), jnp.float32)
    expected = meta(params, **{"num_workers": M, "inner_steps": 5, **change})

    with pytest.raises(ValueError, match=field) as error:
        ckpt.restore(tmp_path, state, expected)
    assert str(tmp_path) in str(error.value) and "step 1" in str(error.value)


def test_state_mismatch_names_leaf(tmp_path):
    state = on_device(host_state(1), jax.devices()[0])
    ckpt.save(tmp_path, 1, state, meta(state.params))
    like = state._replace(round=jnp.zeros((), jnp.float32))
    with pytest.raises(ValueError, match=r"round dtype: int32 != float32"):
        ckpt.restore(tmp_path, like, meta(state.params))
    like = state._replace(inner_opt_state={**state.inner_opt_state, "count": jnp.zeros((2,))})
    with pytest.raises(ValueError, match=r"inner_opt_state.count shape: \(4,\) != \(2,\)"):
        ckpt.restore(tmp_path, like, meta(state.params))


def _delete(path: pathlib.Path) -> None:
    path.unlink()


def _truncate(path: pathlib.Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _flip_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# When one of Orbax's concurrent reads fails, its sibling read coroutines are closed while
# suspended and raise from their cleanup; Python reports that as an "unraisable" exception
# when they are collected. Orbax's noise, not a failure: collect it here, inside these tests.
orbax_read_cleanup = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@orbax_read_cleanup
def test_a_state_restored_as_saved_falls_back_to_an_older_step_of_another_layout(tmp_path):
    """A layout that varies from step to step (`as_saved`): with the newest step damaged in
    its array bytes, the older step comes back in its own layout, bit for bit."""
    device = jax.devices()[0]
    older = {"a": jnp.arange(3.0), "pending": {"000000": jnp.ones(2)}}
    rng = np.random.default_rng(0)  # bytes that do not compress: the array file is the largest
    newer = {"a": jnp.arange(3.0) + 1,
             "pending": {f"{j:06d}": jnp.asarray(rng.normal(size=65536), jnp.float32)
                         for j in (0, 1)}}  # fmt: skip
    params = {"a": np.zeros(3, np.float32)}
    for step, state in ((1, older), (2, newer)):
        ckpt.save(tmp_path, step, jax.device_put(state, device), meta(params, data_position=step))
    _flip_byte(largest_file(tmp_path / "2"))
    target = functools.partial(ckpt.as_saved, sharding=jax.sharding.SingleDeviceSharding(device))
    with pytest.warns(RuntimeWarning, match="checkpoint step 2 .* damaged"):
        restored, metadata, step = ckpt.restore(tmp_path, target, meta(params))
    assert (step, metadata["data_position"]) == (1, 1)
    assert jax.tree.structure(restored) == jax.tree.structure(older)
    jax.tree.map(np.testing.assert_array_equal, restored, older)
    gc.collect()


@orbax_read_cleanup
@pytest.mark.parametrize("damage", [_delete, _truncate, _flip_byte])
def test_damaged_latest_falls_back_to_previous(tmp_path, damage):
    device = jax.devices()[0]
    states = {step: on_device(host_state(step), device) for step in (1, 2)}
    for step, state in states.items():
        ckpt.save(tmp_path, step, state, meta(state.params, data_position=step))
    damage(largest_file(tmp_path / "2"))

    with pytest.warns(RuntimeWarning, match="checkpoint step 2 .* damaged"):
        restored, metadata, step = ckpt.restore(tmp_path, states[2], meta(states[2].params))

    assert (step, metadata["data_position"]) == (1, 1)
    assert_bit_equal(restored, states[1])
    gc.collect()


@orbax_read_cleanup
def test_no_valid_checkpoint_raises(tmp_path):
    state = on_device(host_state(1), jax.devices()[0])
    ckpt.save(tmp_path, 1, state, meta(state.params))
    _delete(largest_file(tmp_path / "1"))
    with pytest.warns(RuntimeWarning, match="step 1"):
        with pytest.raises(ValueError, match="no valid checkpoint in checkpoint_dir"):
            ckpt.restore(tmp_path, state, meta(state.params))
    gc.collect()


def test_empty_or_missing_directory(tmp_path):
    state = on_device(host_state(1), jax.devices()[0])
    missing = tmp_path / "missing"
    assert ckpt.latest_step(missing) is None and ckpt.all_steps(missing) == []
    assert ckpt.restore(missing, state, meta(state.params)) is None
    assert not missing.exists()  # reading never creates the directory
    assert ckpt.latest_step(tmp_path) is None
    assert ckpt.restore(tmp_path, state, meta(state.params)) is None


def test_unfinished_save_is_ignored_and_cleaned_up(tmp_path):
    state = on_device(host_state(1), jax.devices()[0])
    ckpt.save(tmp_path, 1, state, meta(state.params, data_position=1))
    # Orbax writes step s under "<s>.orbax-checkpoint-tmp[-<timestamp>]" and renames it last.
    # A crash just before the rename leaves complete-looking contents under a temporary name.
    for name in ("2.orbax-checkpoint-tmp", "3.orbax-checkpoint-tmp-1712345678901234"):
        shutil.copytree(tmp_path / "1", tmp_path / name)
    (tmp_path / "4.orbax-checkpoint-tmp").mkdir()  # a save that died at once

    assert ckpt.latest_step(tmp_path) == 1 and ckpt.all_steps(tmp_path) == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to fall back from
        _, metadata, step = ckpt.restore(tmp_path, state, meta(state.params))
    assert (step, metadata["data_position"]) == (1, 1)

    ckpt.save(tmp_path, 2, state, meta(state.params, data_position=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]
    assert ckpt.latest_step(tmp_path) == 2


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_real_diloco_state_from_a_backend(tmp_path, backend):
    import optax

    from diloco_jax.round import DiLoCoState, init_state
    from diloco_jax.workers import make_backend

    placed = make_backend(backend, M)
    inner, outer = optax.adamw(1e-3), optax.sgd(0.7, momentum=0.9, nesterov=True)

    def placed_state(seed: int) -> DiLoCoState:
        params = {"w": jax.random.normal(jax.random.key(seed), (8, 4)), "b": jnp.zeros(4)}
        s = init_state(params, M, inner_optimizer=inner, outer_optimizer=outer)
        s = s._replace(inner_opt_state=jax.tree.map(lambda x: x + seed, s.inner_opt_state))
        return DiLoCoState(
            placed.place_shared(s.params),
            placed.place_shared(s.outer_opt_state),
            placed.place_workers(s.inner_opt_state),
            placed.place_shared(s.round + seed),
        )

    saved, like = placed_state(1), placed_state(0)
    ckpt.save(tmp_path, 3, saved, meta(saved.params))
    restored, _, _ = ckpt.restore(tmp_path, like, meta(saved.params))

    assert_bit_equal(restored, saved)
    for r, want in zip(jax.tree.leaves(restored), jax.tree.leaves(like), strict=True):
        assert r.sharding == want.sharding


def test_sync_state_and_relative_directory(tmp_path, monkeypatch):
    from diloco_jax.sync import SyncState

    monkeypatch.chdir(tmp_path)
    params = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3)}
    saved = SyncState(params, {"mu": params["w"] * 3}, jnp.int32(11))
    ckpt.save("ckpts", 11, saved, ckpt.fingerprint(params, algorithm="sync"))
    assert ckpt.latest_step(tmp_path / "ckpts") == 11

    like = jax.tree.map(jnp.zeros_like, saved)
    restored, _, step = ckpt.restore("ckpts", like, ckpt.fingerprint(params, algorithm="sync"))
    assert step == 11 and isinstance(restored, SyncState)
    assert_bit_equal(restored, saved)
    with pytest.raises(ValueError, match="algorithm: 'sync' != 'diloco'"):
        ckpt.restore("ckpts", like, ckpt.fingerprint(params, algorithm="diloco"))


def test_a_background_save_survives_the_state_being_donated(tmp_path):
    """`Saver.save` returns once the state is off the devices: the next step may donate (and
    overwrite) its buffers while the files are written, and the checkpoint still restores
    bit for bit."""
    saved = on_mesh(host_state(5))
    expected = jax.tree.map(np.asarray, saved)
    saver = ckpt.Saver(tmp_path, keep=2)
    saver.save(1, saved, meta(saved.params))
    overwrite = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 + 1, s), donate_argnums=0)
    after = overwrite(saved)
    jax.block_until_ready(after)
    saver.save(2, after, meta(saved.params))  # waits for step 1, starts step 2
    saver.close()
    assert ckpt.all_steps(tmp_path) == [1, 2]
    ckpt.discard_after(tmp_path, 1)
    restored, _, step = ckpt.restore(tmp_path, on_mesh(host_state(0)), meta(saved.params))
    assert step == 1
    assert_bit_equal(restored, expected)


def test_checksums_are_per_shard_for_a_leaf_over_devices(tmp_path):
    """A leaf over several devices gets one CRC-32 per distinct shard (keyed by its index
    range), each of that shard's bytes: what NumPy computes from the slices of the whole
    array; a leaf on one device one CRC of its bytes. A flipped shard CRC on disk makes the
    restore skip the step."""
    import json
    import zlib

    saved = on_mesh(host_state(2))
    sums = ckpt.leaf_checksums(saved)
    mu = np.asarray(saved.inner_opt_state["mu"]["w"])  # [M, 16, 8] over the 4 workers
    want = {f"{m}:{m + 1},:,:": zlib.crc32(np.ascontiguousarray(mu[m : m + 1]).tobytes())
            for m in range(M)}  # fmt: skip
    assert sums["inner_opt_state.mu.w"] == want
    w = np.asarray(saved.params["w"])  # replicated: one shard, the whole leaf
    assert sums["params.w"] == {":,:": zlib.crc32(np.ascontiguousarray(w).tobytes())}
    one = on_device(host_state(2), jax.devices()[0])
    assert ckpt.leaf_checksums(one)["params.w"] == zlib.crc32(w.tobytes())

    ckpt.save(tmp_path, 1, saved, meta(saved.params))
    ckpt.save(tmp_path, 2, saved, meta(saved.params))
    path = tmp_path / "2" / "checksums" / "metadata"
    stored = json.loads(path.read_text())
    stored["crc32"]["inner_opt_state.mu.w"]["2:3,:,:"] ^= 1
    path.write_text(json.dumps(stored))
    with pytest.warns(RuntimeWarning, match="step 2"):
        _, _, step = ckpt.restore(tmp_path, on_mesh(host_state(0)), meta(saved.params))
    assert step == 1


KILLED_MID_SAVE = """
import asyncio, os, pathlib, sys, time
sys.path.insert(0, {tests!r})
import numpy as np
from reference import linear_loss, make_data
import diloco_jax as dj
from diloco_jax import checkpoint
from orbax.checkpoint._src.path import async_path

rename = async_path.rename


async def slow_rename(src, dst):  # holds step 3's commit back: its write stays in flight
    if src.name.startswith("3."):
        await asyncio.sleep(60)
    return await rename(src, dst)


async_path.rename = slow_rename
start = checkpoint.Saver.save

def save(self, step, state, metadata):
    start(self, step, state, metadata)
    if step == 3:  # step 3's files are being written in the background: die once they're begun
        deadline = time.monotonic() + 60
        while not any(p.name.startswith("3.") for p in pathlib.Path(sys.argv[1]).iterdir()):
            if time.monotonic() > deadline:
                os._exit(4)
            time.sleep(0.01)
        os._exit(3)

checkpoint.Saver.save = save
rounds = make_data(np.random.default_rng(5), 5, 2, 3)
params = {{"w": np.zeros(3, np.float32), "b": np.float32(0)}}
dj.train_diloco(linear_loss, params, rounds, num_rounds=5, num_workers=2, inner_steps=3,
                checkpoint_dir=sys.argv[1])
"""


@pytest.mark.slow
def test_a_run_killed_while_a_save_is_in_flight_resumes_from_a_complete_one(tmp_path):
    """A process that dies while checkpoint 3's background write is in flight (its commit
    held back by a slow rename): on disk are checkpoints 1 and 2 and step 3's temporary
    directory; the rerun resumes from 2, ignores and clears the temporary one, and ends as
    the uninterrupted run, bit for bit."""
    import subprocess
    import sys

    from reference import linear_loss, make_data

    import diloco_jax as dj

    script = KILLED_MID_SAVE.format(tests=str(pathlib.Path(__file__).parent))
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr[-3000:]
    assert ckpt.all_steps(tmp_path) == [1, 2]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("3.")]  # in flight
    rounds = make_data(np.random.default_rng(5), 5, 2, 3)
    params = {"w": np.zeros(3, np.float32), "b": np.float32(0)}
    common = dict(num_rounds=5, num_workers=2, inner_steps=3)
    whole = dj.train_diloco(linear_loss, params, rounds, **common)
    resumed = dj.train_diloco(linear_loss, params, rounds, checkpoint_dir=tmp_path, **common)
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [e["loss"] for e in resumed.history] == [e["loss"] for e in whole.history]
    assert ckpt.all_steps(tmp_path)[-1] == 5
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("3.")]


# Issue 40: a damaged newest step falls back (finding 1, finding 5), saves cost the same
# whatever the round (finding 3), one run per directory (finding 2's API side).


def _save_three(directory: pathlib.Path) -> dict[int, State]:
    """Steps 1, 2, 3 of states 1, 2, 3, each with a history of one record per step so far."""
    device = jax.devices()[0]
    states = {step: on_device(host_state(step), device) for step in (1, 2, 3)}
    history = []
    for step, state in states.items():
        history.append({"round": step - 1, "loss": step / 8})
        metadata = meta(state.params, data_position=step) | {"history": list(history)}
        ckpt.save(directory, step, state, metadata)
    return states


def _restore_warning(directory: pathlib.Path, like: State) -> tuple[Any, dict, int, str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored, metadata, step = ckpt.restore(directory, like, meta(like.params))
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    return restored, metadata, step, messages[0]


def _remove_tree_metadata(step_dir: pathlib.Path) -> None:
    (step_dir / "state" / "_METADATA").unlink()


def _edit_metadata(step_dir: pathlib.Path) -> None:
    path = step_dir / "metadata" / "metadata"
    text = path.read_text()
    assert '"data_position": 3' in text
    path.write_text(text.replace('"data_position": 3', '"data_position": 30'))


def _remove_metadata(step_dir: pathlib.Path) -> None:
    (step_dir / "metadata" / "metadata").unlink()


@orbax_read_cleanup
@pytest.mark.parametrize(
    "damage, reason",
    [
        (_remove_tree_metadata, "the state's tree metadata lists 0 leaves, its checksums 9"),
        (_edit_metadata, "the metadata fails its CRC-32"),
        (_remove_metadata, "FileNotFoundError"),
    ],
)
def test_a_newest_step_damaged_anywhere_falls_back_with_one_warning(tmp_path, damage, reason):
    """Finding 1 (a missing _METADATA blamed another run) and finding 5 (an edited metadata
    restored silently): the newest step is damage, not another run's, so the restore warns
    once naming step 3 and why, and returns step 2 bit for bit with its own metadata."""
    states = _save_three(tmp_path)
    damage(tmp_path / "3")
    restored, metadata, step, message = _restore_warning(tmp_path, states[3])
    assert step == 2 and metadata["data_position"] == 2
    assert "checkpoint step 3" in message and reason in message, message
    assert_bit_equal(restored, states[2])
    assert metadata["history"] == [{"round": 0, "loss": 0.125}, {"round": 1, "loss": 0.25}]
    gc.collect()


@orbax_read_cleanup
def test_a_history_edited_or_cut_short_falls_back_to_the_step_it_still_covers(tmp_path):
    """Finding 5: the history lives in history.jsonl, each step holding the CRC-32 of its
    prefix. A record edited in place fails the steps that cover it (an earlier step whose
    prefix is intact restores); a file cut short fails the steps past its end."""
    states = _save_three(tmp_path)
    path = tmp_path / ckpt.HISTORY_FILE
    lines = path.read_text().splitlines(keepends=True)
    assert [json.loads(line)["round"] for line in lines] == [0, 1, 2]
    edited = lines[:2] + [lines[2].replace('"loss": 0.375', '"loss": 123.0')]
    assert edited != lines
    path.write_text("".join(edited))
    _, metadata, step, message = _restore_warning(tmp_path, states[3])
    assert step == 2 and "checkpoint step 3" in message and "CRC-32" in message
    assert [r["round"] for r in metadata["history"]] == [0, 1]

    path.write_text(lines[0] + lines[1][:5])  # the second record cut mid-line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, metadata, step = ckpt.restore(tmp_path, states[3], meta(states[3].params))
    assert step == 1 and metadata["history"] == [{"round": 0, "loss": 0.125}]
    assert [str(w.message).split(" in ")[0] for w in caught] == [
        "checkpoint step 3",
        "checkpoint step 2",
    ]
    gc.collect()


def test_an_intact_checkpoint_of_another_run_is_never_skipped(tmp_path):
    """'a different run' is said only of a checkpoint that is whole by its own record: the
    run's error, with no fallback to an older step that would hide it."""
    states = _save_three(tmp_path)
    like = states[3]._replace(round=jnp.zeros((), jnp.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"step 3\) holds a different state .* round dtype"):
            ckpt.restore(tmp_path, like, meta(like.params))


@pytest.mark.slow
def test_a_save_writes_as_much_at_step_200_as_at_step_10(tmp_path):
    """Finding 3: the history is appended (one line a save), not rewritten into every
    checkpoint's metadata, so a save's metadata is the same size at step 10 and step 200."""
    state = on_device(host_state(1), jax.devices()[0])
    saver = ckpt.Saver(tmp_path, keep=2, background=False)
    history, sizes, lengths = [], {}, {}
    record = {"loss": 0.5, "worker_loss": [0.25, 0.75], "wire_bytes": 1000}
    try:
        for step in range(1, 201):
            history.append({"round": step - 1, **record})
            saver.save(step, state, meta(state.params, data_position=step) | {"history": history})
            sizes[step] = (tmp_path / str(step) / "metadata" / "metadata").stat().st_size
            lengths[step] = sum(p.stat().st_size for p in tmp_path.glob("*.jsonl"))
    finally:
        saver.close()
    # The metadata holds where its history ends (more digits at step 200, nothing more).
    assert sizes[200] - sizes[10] <= 8, (sizes[10], sizes[200])
    line = len(json.dumps({"round": 100, **record}, sort_keys=True)) + 1
    assert lengths[101] - lengths[100] == line  # one record appended, nothing rewritten
    _, metadata, step = ckpt.restore(tmp_path, state, meta(state.params))
    assert step == 200 and metadata["history"] == history


def test_a_history_with_non_finite_losses_is_saved_and_restored(tmp_path):
    """A run whose workers went non-finite records NaN losses: its checkpoints hold them (the
    metadata refused them as JSON, so such a run could not checkpoint at all)."""
    state = on_device(host_state(1), jax.devices()[0])
    history = [{"round": 0, "loss": float("nan"), "worker_loss": [float("inf"), 0.5]}]
    ckpt.save(tmp_path, 1, state, meta(state.params) | {"history": history})
    _, metadata, _ = ckpt.restore(tmp_path, state, meta(state.params))
    (restored,) = metadata["history"]
    assert np.isnan(restored["loss"]) and restored["worker_loss"] == [float("inf"), 0.5]


def test_one_run_holds_a_checkpoint_directory(tmp_path):
    """Finding 2's API side: while a Saver holds a directory, a second one (another run's)
    is refused before it touches anything there; once the first closes, the next runs."""
    from diloco_jax import run_lock

    state = on_device(host_state(1), jax.devices()[0])
    first = ckpt.Saver(tmp_path, keep=2)
    try:
        first.save(1, state, meta(state.params))
        before = sorted(p.name for p in tmp_path.iterdir())
        with pytest.raises(run_lock.FolderInUse, match=f"checkpoint_dir {tmp_path} is in use"):
            ckpt.save(tmp_path, 2, state, meta(state.params))
        assert sorted(p.name for p in tmp_path.iterdir()) == before
    finally:
        first.close()
    ckpt.save(tmp_path, 2, state, meta(state.params))
    assert ckpt.all_steps(tmp_path) == [1, 2]
    assert not (tmp_path / run_lock.LOCK_NAME).exists()  # released and removed

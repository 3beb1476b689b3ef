"""`data` as a callable `start -> iterable`: a run resumed from a checkpoint asks only for the
rounds (steps) it still has to train, and equals the uninterrupted run. `process_local_data`
in one process (its multi-process run: tests/test_multiprocess.py)."""

import jax
import numpy as np
import pytest
from reference import linear_loss, make_data

import diloco_jax as dj

M, H, R = 2, 3, 4
PARAMS = {"w": np.zeros(3, np.float32), "b": np.float32(0)}


def test_a_resumed_run_draws_only_the_rounds_it_trains(tmp_path):
    rounds = make_data(np.random.default_rng(0), R, M, H)
    asked = []

    def data(start):
        asked.append(start)
        return iter(rounds[start:])

    common = dict(num_workers=M, inner_steps=H, checkpoint_dir=tmp_path)
    whole = dj.train_diloco(linear_loss, PARAMS, rounds, num_rounds=R, num_workers=M, inner_steps=H)
    dj.train_diloco(linear_loss, PARAMS, data, num_rounds=2, **common)
    resumed = dj.train_diloco(linear_loss, PARAMS, data, num_rounds=R, **common)
    assert asked == [0, 2]
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert resumed.history == whole.history


def test_train_sync_takes_a_callable_too(tmp_path):
    steps = [
        {k: v[:, h] for k, v in r.items()}
        for r in make_data(np.random.default_rng(0), 2, M, H)
        for h in range(H)
    ]
    asked = []

    def data(start):
        asked.append(start)
        return steps[start:]

    common = dict(num_workers=M, checkpoint_dir=tmp_path, checkpoint_every=2)
    dj.train_sync(linear_loss, PARAMS, data, num_steps=4, **common)
    resumed = dj.train_sync(linear_loss, PARAMS, data, num_steps=6, **common)
    whole = dj.train_sync(linear_loss, PARAMS, steps, num_steps=6, num_workers=M)
    assert asked == [0, 4]
    np.testing.assert_array_equal(resumed.params["w"], whole.params["w"])


def test_process_local_data_in_one_process_is_the_whole_batch():
    """One process owns every worker: its local data is the global batch, and the run is the
    default one bit for bit (train_diloco on shard_map, train_sync on vmap, a Sampler's
    worker_arrays); a non-bool and a wrong worker count are refused naming the option or the
    shape."""
    rounds = make_data(np.random.default_rng(0), 2, M, H)
    common = dict(num_rounds=2, num_workers=M, inner_steps=H, backend="shard_map")
    whole = dj.train_diloco(linear_loss, PARAMS, rounds, **common)
    local = dj.train_diloco(linear_loss, PARAMS, rounds, process_local_data=True, **common)
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(local.state), strict=True):
        np.testing.assert_array_equal(a, b)
    steps = [{k: v[:, 0] for k, v in r.items()} for r in rounds]
    sync = dict(num_steps=2, num_workers=M)
    a = dj.train_sync(linear_loss, PARAMS, steps, **sync)
    b = dj.train_sync(linear_loss, PARAMS, steps, process_local_data=True, **sync)
    np.testing.assert_array_equal(a.params["w"], b.params["w"])
    # A Sampler's worker_arrays are this process's workers' rows: here all M of them.
    table = {k: np.stack([r[k] for r in rounds], axis=1) for k in rounds[0]}  # [M, R, H, ...]
    draw = lambda a, r, m, h, mine: {k: v[r, h] for k, v in mine.items()}  # noqa: E731
    sampler = dj.Sampler({}, draw, worker_arrays=table)
    graph = dj.train_diloco(linear_loss, PARAMS, sampler, process_local_data=True, **common)
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(graph.state), strict=True):
        np.testing.assert_array_equal(a, b)
    half = dj.Sampler({}, draw, worker_arrays={k: v[:1] for k, v in table.items()})
    with pytest.raises(ValueError, match=r"leading dim this process's workers = 2, got shape"):
        dj.train_diloco(linear_loss, PARAMS, half, process_local_data=True, **common)
    with pytest.raises(ValueError, match="process_local_data must be True or False"):
        dj.train_diloco(linear_loss, PARAMS, rounds, process_local_data=1, **common)
    three = make_data(np.random.default_rng(0), 2, 3, H)
    with pytest.raises(ValueError, match=r"\[this process's workers, inner_steps\] = \(2, 3\)"):
        dj.train_diloco(linear_loss, PARAMS, three, process_local_data=True, **common)

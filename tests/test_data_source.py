"""`data` as a callable `start -> iterable`: a run resumed from a checkpoint asks only for the
rounds (steps) it still has to train, and equals the uninterrupted run."""

import jax
import numpy as np
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

"""`worker_rounds` / `sync_steps`: one dataset in DiLoCo's and data parallelism's layouts,
the same examples in the same order, checked by index bookkeeping and by feeding both
trainers."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diloco_jax as dj

N, M, H, B = 50, 2, 3, 4  # one epoch: 25 examples per worker, 2 rounds of 12


def _dataset():
    ids = np.arange(N)
    return {"id": ids, "x": np.stack([ids, -ids], axis=1).astype(np.float32)}


def test_rounds_have_the_layout_and_use_each_example_once_per_epoch():
    rounds = dj.worker_rounds(_dataset(), M, H, B, seed=3)
    assert len(rounds) == 2
    for r in rounds:
        assert r["id"].shape == (M, H, B) and r["x"].shape == (M, H, B, 2)
        np.testing.assert_array_equal(r["x"][..., 0], r["id"])  # leaves stay aligned
    used = np.concatenate([r["id"].ravel() for r in rounds])
    assert len(set(used.tolist())) == len(used) == 2 * M * H * B
    assert not np.array_equal(used, np.sort(used))  # shuffled
    again = dj.worker_rounds(_dataset(), M, H, B, seed=3)
    np.testing.assert_array_equal(again[1]["id"], rounds[1]["id"])
    other = dj.worker_rounds(_dataset(), M, H, B, seed=4)
    assert not np.array_equal(other[0]["id"], rounds[0]["id"])


def test_non_iid_gives_each_worker_its_own_shard():
    rounds = dj.worker_rounds(_dataset(), M, H, B, iid=False, num_rounds=2)
    shard = N // M
    for m in range(M):
        ids = np.concatenate([r["id"][m].ravel() for r in rounds])
        assert ids.min() >= m * shard and ids.max() < (m + 1) * shard


def test_more_rounds_than_an_epoch_reshuffle_the_next_epoch():
    rounds = dj.worker_rounds(_dataset(), M, H, B, num_rounds=5)
    assert len(rounds) == 5
    epoch0 = np.concatenate([r["id"].ravel() for r in rounds[:2]])
    epoch1 = np.concatenate([r["id"].ravel() for r in rounds[2:4]])
    assert len(set(epoch1.tolist())) == len(epoch1)
    assert not np.array_equal(epoch0, epoch1)


def test_sync_steps_hold_the_same_examples_in_the_same_order():
    rounds = dj.worker_rounds(_dataset(), M, H, B, seed=1)
    steps = dj.sync_steps(_dataset(), M, H, B, seed=1)
    assert len(steps) == len(rounds) * H
    for r, rnd in enumerate(rounds):
        for h in range(H):
            np.testing.assert_array_equal(steps[r * H + h]["id"], rnd["id"][:, h])


def _loss(params, batch):
    err = batch["x"] @ params["w"] - 1.0
    return 0.5 * jnp.mean(err**2), {"mean_id": jnp.mean(batch["id"].astype(jnp.float32))}


def test_both_trainers_see_the_same_examples():
    params = {"w": jnp.zeros(2)}
    rounds = dj.worker_rounds(_dataset(), M, H, B)
    steps = dj.sync_steps(_dataset(), M, H, B)
    diloco = dj.train_diloco(
        _loss, params, rounds, num_rounds=2, num_workers=M, inner_steps=H, has_aux=True,
        inner_optimizer=optax.sgd(0.01),
    )  # fmt: skip
    sync = dj.train_sync(
        _loss, params, steps, num_steps=2 * H, num_workers=M, has_aux=True,
        optimizer=optax.sgd(0.01),
    )  # fmt: skip
    for r, entry in enumerate(diloco.history):
        per_step = np.array([s["worker_mean_id"] for s in sync.history[r * H : (r + 1) * H]])
        np.testing.assert_allclose(entry["worker_mean_id"], per_step.mean(axis=0), rtol=1e-6)
        want = rounds[r]["id"].reshape(M, -1).mean(axis=1)
        np.testing.assert_allclose(entry["worker_mean_id"], want, rtol=1e-6)


def test_an_iterable_of_examples_is_the_stacked_dataset():
    data = _dataset()
    examples = [{"id": data["id"][i], "x": data["x"][i]} for i in range(N)]
    a = dj.worker_rounds(examples, M, H, B, seed=2)
    b = dj.worker_rounds(data, M, H, B, seed=2)
    np.testing.assert_array_equal(a[0]["x"], b[0]["x"])


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((0, H, B), {}, "num_workers must be an integer >= 1"),
        ((M, 0, B), {}, "inner_steps must be an integer >= 1"),
        ((M, H, True), {}, "batch_size must be an integer >= 1"),
        ((M, H, B), {"seed": -1}, "seed must be an integer >= 0"),
        ((M, H, B), {"iid": "yes"}, "iid must be True or False"),
        ((M, H, B), {"num_rounds": -1}, "num_rounds must be an integer >= 0"),
        ((M, 10, B), {}, "fewer than one round needs"),
    ],
)
def test_bad_input_names_the_argument(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        dj.worker_rounds(_dataset(), *args, **kwargs)


def test_a_dataset_whose_leaves_disagree_is_refused():
    with pytest.raises(ValueError, match="share a leading example axis"):
        dj.worker_rounds({"a": np.zeros(10), "b": np.zeros(11)}, 1, 1, 1)
    with pytest.raises(ValueError, match="dataset is empty"):
        dj.worker_rounds([], 1, 1, 1)

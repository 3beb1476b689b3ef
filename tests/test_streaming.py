"""Streaming DiLoCo: fragments synced on a staggered schedule, against a NumPy reference
written from the schedule's definition."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import linear_loss, make_data

import diloco_jax as dj
from diloco_jax import hlo


def two_leaf_loss(params, batch):
    return 0.5 * jnp.mean((params["a"] - batch["x"]) ** 2 + (params["b"] - batch["y"]) ** 2)


def numpy_streaming(a, b, rounds, lr, outer_lr, momentum, tau, alpha):
    """The schedule, step by step: leaf a is fragment 0, leaf b fragment 1 (P = 2).

    SGD inner steps on 0.5 mean((a - x)^2 + (b - y)^2); SGD(outer_lr, momentum) outer steps,
    one momentum trace per fragment that advances only at that fragment's syncs."""
    glob = {"a": float(a), "b": float(b)}
    trace = {"a": 0.0, "b": 0.0}
    num_workers = rounds[0]["x"].shape[0]
    local = [dict(glob) for _ in range(num_workers)]
    for batch in rounds:
        steps = batch["x"].shape[1]
        per = steps // 2
        snapshot = [{} for _ in range(num_workers)]
        for h in range(steps):
            for m in range(num_workers):
                x, y = batch["x"][m, h].astype(np.float64), batch["y"][m, h].astype(np.float64)
                local[m]["a"] -= lr * np.mean(local[m]["a"] - x)
                local[m]["b"] -= lr * np.mean(local[m]["b"] - y)
            done = h + 1
            for p, leaf in enumerate(("a", "b")):
                if done == (p + 1) * per - tau:
                    for m in range(num_workers):
                        snapshot[m][leaf] = local[m][leaf]
                if done == (p + 1) * per:
                    delta = np.mean([glob[leaf] - snapshot[m][leaf] for m in range(num_workers)])
                    trace[leaf] = delta + momentum * trace[leaf]
                    glob[leaf] = glob[leaf] - outer_lr * trace[leaf]
                    for m in range(num_workers):
                        local[m][leaf] = glob[leaf] + alpha * (local[m][leaf] - glob[leaf])
    return glob, local


def _rounds(num_rounds, num_workers, steps, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(num_workers, steps, 3)).astype(np.float32),
            "y": rng.normal(size=(num_workers, steps, 3)).astype(np.float32),
        }
        for _ in range(num_rounds)
    ]


@pytest.mark.parametrize("tau, alpha", [(0, 0.0), (1, 0.0), (0, 0.5), (1, 0.5)])
@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_two_leaf_schedule_matches_numpy(tau, alpha, backend):
    rounds = _rounds(num_rounds=3, num_workers=2, steps=4)
    params = {"a": jnp.float32(1.0), "b": jnp.float32(-2.0)}
    result = dj.train_diloco(
        two_leaf_loss,
        params,
        rounds,
        num_rounds=3,
        num_workers=2,
        inner_steps=4,
        backend=backend,
        inner_optimizer=optax.sgd(0.3),
        outer_optimizer=optax.sgd(0.8, momentum=0.5),
        fragments=2,
        overlap_steps=tau,
        merge_alpha=alpha,
    )
    glob, local = numpy_streaming(1.0, -2.0, rounds, 0.3, 0.8, 0.5, tau, alpha)
    np.testing.assert_allclose(result.params["a"], glob["a"], rtol=1e-5)
    np.testing.assert_allclose(result.params["b"], glob["b"], rtol=1e-5)
    for leaf in ("a", "b"):  # worker params persist across rounds (no reset at the boundary)
        np.testing.assert_allclose(
            result.state.parts["workers"].params[leaf], [w[leaf] for w in local], rtol=1e-5
        )
    # each fragment's own outer state advanced at its 3 syncs only
    counts = [jax.tree.leaves(s) for s in result.state.outer_opt_state]
    assert len(counts) == 2


def test_one_fragment_no_overlap_no_alpha_is_standard_diloco():
    rounds = make_data(np.random.default_rng(1), num_rounds=3, num_workers=4, inner_steps=3)
    params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.float32(0.5)}
    kw = dict(num_rounds=3, num_workers=4, inner_steps=3, backend="shard_map")
    plain = dj.train_diloco(linear_loss, params, rounds, **kw)
    stream = dj.train_diloco(linear_loss, params, rounds, fragments=1, **kw)
    jax.tree.map(np.testing.assert_array_equal, stream.params, plain.params)
    assert [h["loss"] for h in stream.history] == [h["loss"] for h in plain.history]


def test_each_sync_sends_only_its_fragment():
    params = {"a": jnp.zeros(1000), "b": jnp.zeros(3000)}
    inner, outer = optax.sgd(0.1), dj.default_outer_optimizer()
    backend = dj.make_backend("shard_map", 4)
    state = dj.init_state(params, 4, inner_optimizer=inner, outer_optimizer=outer, fragments=2)
    batch = {"x": jnp.ones((4, 4, 2)), "y": jnp.ones((4, 4, 2))}
    loss = lambda p, b: jnp.mean(p["a"]) * jnp.mean(b["x"]) + jnp.mean(p["b"]) * jnp.mean(b["y"])
    round_fn = functools.partial(
        dj.diloco_round,
        loss,
        inner_optimizer=inner,
        outer_optimizer=outer,
        fragments=2,
        exclude_nonfinite=False,  # the unweighted exchange: no weights beside the deltas
        backend=backend,
    )
    found = hlo.collectives(jax.jit(round_fn).lower(state, batch).compile())
    # fragment 0 (a: 1000 floats) and fragment 1 (b: 3000 floats) in separate all-reduces,
    # nothing padded; the round's 4-byte mean loss may ride along with either.
    shapes = [set(c.operand_shapes) for c in found]
    assert sum((1000,) in s for s in shapes) == 1 and sum((3000,) in s for s in shapes) == 1
    assert not any((1000,) in s and (3000,) in s for s in shapes)
    assert sum(c.operand_bytes for c in found) == 4000 + 12000 + 4


def test_streaming_with_compression_and_resume(tmp_path):
    rounds = make_data(np.random.default_rng(2), num_rounds=4, num_workers=2, inner_steps=4)
    params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.float32(0.5)}
    kw = dict(
        num_rounds=4,
        num_workers=2,
        inner_steps=4,
        backend="vmap",
        fragments=2,
        overlap_steps=1,
        merge_alpha=0.25,
        compression="int8,ef=1",
    )
    full = dj.train_diloco(linear_loss, params, rounds, **kw)
    assert full.history[0]["bytes_communicated"] == dj.comm.round_bytes(params, "int8")
    dj.train_diloco(linear_loss, params, rounds, checkpoint_dir=tmp_path, **dict(kw, num_rounds=2))
    resumed = dj.train_diloco(linear_loss, params, rounds, checkpoint_dir=tmp_path, **kw)
    jax.tree.map(np.testing.assert_array_equal, resumed.state, full.state)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(fragments=2, inner_steps=3), "multiple of the number of fragments"),
        (dict(fragments=0), "Streaming.fragments must be an int >= 1"),
        (dict(fragments=3), "fragments must be between 1"),
        (dict(fragments=True), "fragments must be"),
        (dict(fragments={"w": 0}), "fragments must be an int >= 1 or a pytree"),
        (dict(fragments={"w": 0, "b": 2}), "cover 0..P-1"),
        (dict(fragments={"w": 0, "b": 0.5}), "must hold ints"),
        (dict(fragments=2, overlap_steps=-1), "overlap_steps"),
        (dict(fragments=2, overlap_steps=2), "overlap_steps"),
        (dict(fragments=2, merge_alpha=1.5), "merge_alpha"),
        (dict(fragments=2, merge_alpha=-0.1), "merge_alpha"),
        (dict(overlap_steps=1), "need fragments"),
        (dict(merge_alpha=0.5), "need fragments"),
    ],
)
def test_invalid_streaming_options(kwargs, match):
    kw = dict(num_rounds=1, num_workers=2, inner_steps=4) | kwargs
    rounds = make_data(np.random.default_rng(3), 1, 2, kw["inner_steps"])
    params = {"w": jnp.zeros(3), "b": jnp.float32(0)}
    with pytest.raises(ValueError, match=match):
        dj.train_diloco(linear_loss, params, rounds, **kw)

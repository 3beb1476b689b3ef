"""`unroll_inner_steps=True`: each worker's H inner steps compiled as straight-line code, not
one loop. The same DiLoCo (a float64 NumPy reference, and the looped run up to float
rounding, DES-LOC's synced loop too), no loop left in the compiled round, a bad value named."""

import jax
import numpy as np
import optax
import pytest
from reference import diloco_sgd, linear_loss, make_data

import diloco_jax as dj

NESTEROV = dict(momentum=0.9, nesterov=True)


def _run(data, **options):
    params = {"w": np.asarray([0.3, -0.2, 0.1], np.float32), "b": np.float32(0.5)}
    return dj.train_diloco(
        linear_loss, params, data, num_rounds=3, num_workers=4, inner_steps=3,
        inner_optimizer=optax.sgd(0.05), outer_optimizer=optax.sgd(0.7, **NESTEROV),
        **options,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["vmap", "sequential", "shard_map"])
def test_unrolled_steps_train_the_numpy_reference(backend):
    data = make_data(np.random.default_rng(3), num_rounds=3, num_workers=4, inner_steps=3)
    got = _run(data, backend=backend, unroll_inner_steps=True)
    w, b, losses = diloco_sgd(np.float32([0.3, -0.2, 0.1]), np.float32(0.5), data, 0.05, 0.7, 0.9)
    np.testing.assert_allclose(got.params["w"], w, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(got.params["b"], b, rtol=2e-5, atol=1e-6)
    for record, want in zip(got.history, losses, strict=True):
        np.testing.assert_allclose(record["worker_loss"], want, rtol=1e-5)


def test_unrolled_des_loc_steps_are_the_looped_ones_up_to_rounding():
    """DES-LOC's inner loop (its own scan, averaging the momentum every 2 steps) unrolls too."""
    data = make_data(np.random.default_rng(4), num_rounds=2, num_workers=4, inner_steps=4)
    params = {"w": np.asarray([0.3, -0.2, 0.1], np.float32), "b": np.float32(0.5)}
    run = lambda unroll: dj.train_diloco(  # noqa: E731
        linear_loss, params, data, num_rounds=2, num_workers=4, inner_steps=4,
        backend="vmap", state_sync={"mu": 2}, unroll_inner_steps=unroll,
    )  # fmt: skip
    looped, unrolled = run(False), run(True)
    for name in params:
        np.testing.assert_allclose(unrolled.params[name], looped.params[name], rtol=2e-6)
        assert not np.allclose(unrolled.params[name], params[name])  # it trained


def _whiles(unroll: bool, **options) -> int:
    """The while loops in the optimized program of one round (vmap, M = 2, H = 3)."""
    data = make_data(np.random.default_rng(5), num_rounds=1, num_workers=2, inner_steps=3)[0]
    params = {"w": np.zeros(3, np.float32), "b": np.float32(0)}
    method = dj.DiLoCo(**options)
    state = dj.init_state(params, 2, method)
    step = dj.jit_round(linear_loss, method, backend="vmap", unroll_inner_steps=unroll)
    return step.lower(state, data).compile().as_text().count(" while(")


def test_the_unrolled_round_compiles_without_a_loop():
    assert _whiles(False) == 1  # the inner steps' scan
    assert _whiles(True) == 0


@pytest.mark.parametrize("value", [1, "yes", None])
def test_unroll_inner_steps_must_be_a_bool(value):
    data = make_data(np.random.default_rng(6), num_rounds=1, num_workers=2, inner_steps=2)
    params = {"w": np.zeros(3, np.float32), "b": np.float32(0)}
    with pytest.raises(ValueError, match=r"unroll_inner_steps must be True or False"):
        dj.train_diloco(linear_loss, params, data, num_rounds=1, num_workers=2, inner_steps=2,
                        unroll_inner_steps=value)  # fmt: skip
    state = dj.init_state(params, 2)
    with pytest.raises(ValueError, match=r"unroll_inner_steps must be True or False"):
        dj.diloco_round(linear_loss, state, jax.tree.map(np.asarray, data[0]),
                        unroll_inner_steps=value)  # fmt: skip

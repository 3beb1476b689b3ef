import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diloco_jax as dj


def test_delta_dtype_is_float32_or_wider():
    assert dj.outer.delta_dtype(jnp.bfloat16) == np.float32
    assert dj.outer.delta_dtype(jnp.float16) == np.float32
    assert dj.outer.delta_dtype(jnp.float32) == np.float32
    assert dj.outer.delta_dtype(np.float64) == np.float64


def test_worker_delta_is_global_minus_local_in_float32():
    g = {"a": jnp.asarray([1.0, 2.0], jnp.bfloat16)}
    w = {"a": jnp.asarray([0.5, 2.5], jnp.bfloat16)}
    d = dj.outer.worker_delta(g, w)
    assert d["a"].dtype == jnp.float32
    np.testing.assert_array_equal(d["a"], [0.5, -0.5])


def test_outer_step_under_vmap_matches_hand_computed_nesterov():
    # Three workers; Δ_m = θ - θ_m = [1, 2, 6] - ... ; mean Δ = 3.
    theta = jnp.asarray([10.0])
    workers = jnp.asarray([[9.0], [8.0], [4.0]])  # Δ = 1, 2, 6 -> mean 3
    opt = optax.sgd(0.7, momentum=0.9, nesterov=True)
    state = dj.outer.outer_init(opt, theta)

    def step(local, params, state):
        return dj.outer.outer_step(opt, params, state, local, axis_name="w")

    new, state, delta = jax.vmap(step, in_axes=(0, None, None), out_axes=None, axis_name="w")(
        workers, theta, state
    )
    # trace = 3; nesterov update = -0.7 * (3 + 0.9 * 3) = -3.99
    np.testing.assert_allclose(delta, [3.0])
    np.testing.assert_allclose(new, [10.0 - 3.99], rtol=1e-6)
    # a second outer step with the same Δ: trace = 3 + 0.9*3 = 5.7, update = -0.7*(3 + 0.9*5.7)
    new2, _, _ = jax.vmap(step, in_axes=(0, None, None), out_axes=None, axis_name="w")(
        workers, theta, state
    )
    np.testing.assert_allclose(new2, [10.0 - 0.7 * (3 + 0.9 * 5.7)], rtol=1e-6)


def test_outer_update_keeps_param_dtype_and_state_is_float32_for_bf16():
    params = {"w": jnp.asarray([1.0, -1.0], jnp.bfloat16)}
    opt = optax.sgd(0.5, momentum=0.9)
    state = dj.outer.outer_init(opt, params)
    assert jax.tree.leaves(state)[0].dtype == jnp.float32
    new, state = dj.outer.outer_update(opt, params, state, {"w": jnp.asarray([1.0, 2.0])})
    assert new["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(new["w"].astype(np.float32), [0.5, -2.0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_payload_bytes(dtype):
    tree = {"a": jnp.zeros((3, 4), dtype), "b": (jnp.zeros((), dtype),)}
    itemsize = 4 if dtype == jnp.float32 else 2
    assert dj.comm.payload_bytes(tree) == 13 * itemsize
    assert dj.comm.payload_bytes(jax.eval_shape(lambda t: t, tree)) == 13 * itemsize

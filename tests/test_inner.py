import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import linear_grads, linear_loss

import diloco_jax as dj


def test_inner_loop_matches_numpy_sgd():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 4, 3)).astype(np.float32)  # [H, B, D]
    y = rng.normal(size=(5, 4)).astype(np.float32)
    params = {"w": jnp.asarray([0.5, -1.0, 2.0]), "b": jnp.float32(0.25)}
    opt = optax.sgd(0.1)

    out, state, losses = jax.jit(dj.inner.inner_loop, static_argnums=(0, 1))(
        linear_loss, opt, params, opt.init(params), {"x": x, "y": y}
    )

    w, b, ref_losses = np.array([0.5, -1.0, 2.0]), 0.25, []
    for xs, ys in zip(x.astype(np.float64), y.astype(np.float64), strict=True):
        gw, gb, loss = linear_grads(w, b, xs, ys)
        ref_losses.append(loss)  # taken before the update
        w, b = w - 0.1 * gw, b - 0.1 * gb
    np.testing.assert_allclose(out["w"], w, rtol=1e-5)
    np.testing.assert_allclose(out["b"], b, rtol=1e-5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses.shape == (5,) and losses.dtype == jnp.float32


def test_inner_loop_keeps_dtypes_and_counts_adam_steps():
    params = {"w": jnp.ones((3,), jnp.bfloat16), "b": jnp.zeros((), jnp.float32)}
    batches = {"x": jnp.ones((4, 2, 3), jnp.bfloat16), "y": jnp.zeros((4, 2), jnp.float32)}
    opt = optax.adamw(1e-3)
    out, state, losses = dj.inner.inner_loop(linear_loss, opt, params, opt.init(params), batches)
    assert out["w"].dtype == jnp.bfloat16 and out["b"].dtype == jnp.float32
    assert int(state[0].count) == 4
    assert losses.dtype == jnp.float32


@pytest.mark.parametrize("bad", [lambda p, b: p["w"] * 2.0, lambda p, b: jnp.int32(1)])
def test_inner_loop_rejects_non_scalar_or_int_loss(bad):
    params = {"w": jnp.ones((3,))}
    opt = optax.sgd(0.1)
    with pytest.raises(ValueError, match="loss_fn must return a float scalar"):
        dj.inner.inner_loop(bad, opt, params, opt.init(params), jnp.ones((2, 3)))

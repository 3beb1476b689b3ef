"""`DiLoCo(outer_state_dtype="bfloat16")` / `dj.outer.cast_state`: the outer momentum stored in
bfloat16 (half its bytes), computed in float32, against a NumPy reference that rounds the
stored momentum once a round; the spec field's checks, repr and shorthand."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from reference import linear_grads, linear_loss, make_data

import diloco_jax as dj

M, H, R = 2, 3, 4
INNER_LR, OUTER_LR, MOMENTUM = 0.1, 0.7, 0.9


def _reference(w, b, rounds, store):
    """DiLoCo with SGD inner steps and Nesterov outer steps in float32, the trace rounded by
    `store` each time it is saved (the update uses the unrounded new trace, as optax's)."""
    f32 = np.float32
    w, b = w.astype(f32), f32(b)
    trace_w, trace_b = np.zeros_like(w), f32(0)
    for batch in rounds:
        deltas_w, deltas_b = [], []
        for xm, ym in zip(batch["x"], batch["y"], strict=True):
            wm, bm = w.copy(), b
            for xs, ys in zip(xm, ym, strict=True):
                gw, gb, _ = linear_grads(wm, bm, xs, ys)
                wm, bm = (wm - f32(INNER_LR) * gw).astype(f32), f32(bm - f32(INNER_LR) * gb)
            deltas_w.append(w - wm)
            deltas_b.append(b - bm)
        dw, db = np.mean(deltas_w, axis=0, dtype=f32), f32(np.mean(deltas_b, dtype=f32))
        new_w, new_b = dw + f32(MOMENTUM) * trace_w, db + f32(MOMENTUM) * trace_b
        w = (w - f32(OUTER_LR) * (dw + f32(MOMENTUM) * new_w)).astype(f32)
        b = f32(b - f32(OUTER_LR) * (db + f32(MOMENTUM) * new_b))
        trace_w, trace_b = store(new_w), store(new_b)
    return w, b, trace_w, trace_b


def _bf16(x):
    return np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32)


def _run(**options):
    params = {"w": np.asarray([0.3, -0.2, 0.1], np.float32), "b": np.float32(0.5)}
    rounds = make_data(np.random.default_rng(3), R, M, H)
    result = dj.train_diloco(
        linear_loss, params, rounds, num_rounds=R, num_workers=M, inner_steps=H,
        inner_optimizer=optax.sgd(INNER_LR),
        outer_optimizer=optax.sgd(OUTER_LR, momentum=MOMENTUM, nesterov=True), **options,
    )  # fmt: skip
    return params, rounds, result


def test_bfloat16_momentum_matches_the_rounding_reference():
    params, rounds, result = _run(outer_state_dtype="bfloat16")
    trace = result.state.outer_opt_state[0].trace
    assert trace["w"].dtype == jnp.bfloat16 and trace["b"].dtype == jnp.bfloat16
    assert result.params["w"].dtype == jnp.float32  # θ keeps its dtype
    w, b, tw, tb = _reference(params["w"], params["b"], rounds, _bf16)
    np.testing.assert_allclose(result.params["w"], w, rtol=2e-6, atol=2e-7)
    np.testing.assert_allclose(result.params["b"], b, rtol=2e-6, atol=2e-7)
    np.testing.assert_array_equal(np.asarray(trace["w"], np.float32), tw)
    np.testing.assert_array_equal(np.asarray(trace["b"], np.float32), tb)
    # Lossy, and measurably so: the float32 run is the reference without the rounding.
    w32, _, tw32, _ = _reference(params["w"], params["b"], rounds, lambda x: x)
    _, _, plain = _run()
    np.testing.assert_allclose(plain.params["w"], w32, rtol=2e-6, atol=2e-7)
    assert np.abs(w - w32).max() > 1e-5 and np.abs(tw - tw32).max() > 1e-5


def test_the_shorthand_is_the_spec_field_and_float32_is_the_plain_run():
    _, _, short = _run(outer_state_dtype="bfloat16")
    spec = dj.DiLoCo(
        inner=optax.sgd(INNER_LR),
        outer=optax.sgd(OUTER_LR, momentum=MOMENTUM, nesterov=True),
        outer_state_dtype=jnp.bfloat16,
    )
    assert spec.outer_state_dtype == "bfloat16"
    assert "outer_state_dtype='bfloat16'" in repr(spec)
    assert spec.fingerprint()["outer_state_dtype"] == "bfloat16"
    assert "outer_state_dtype" not in dj.DiLoCo().fingerprint()  # old checkpoints restore
    params = {"w": np.asarray([0.3, -0.2, 0.1], np.float32), "b": np.float32(0.5)}
    rounds = make_data(np.random.default_rng(3), R, M, H)
    by_spec = dj.train_diloco(
        linear_loss, params, rounds, num_rounds=R, num_workers=M, inner_steps=H, method=spec
    )
    for a, b in zip(jax.tree.leaves(short.state), jax.tree.leaves(by_spec.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    _, _, plain = _run()
    _, _, f32 = _run(outer_state_dtype="float32")
    for a, b in zip(jax.tree.leaves(plain.state), jax.tree.leaves(f32.state), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad", ["int8", "nonsense", 3, jnp.int32])
def test_a_non_float_dtype_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="outer_state_dtype must be a floating dtype"):
        dj.DiLoCo(outer_state_dtype=bad)


def test_cast_state_keeps_integer_leaves_and_computes_wide():
    tx = dj.outer.cast_state(optax.adam(0.1), "bfloat16")
    state = tx.init({"w": jnp.ones(3)})
    assert state[0].count.dtype == jnp.int32 and state[0].mu["w"].dtype == jnp.bfloat16
    updates, state = tx.update({"w": jnp.full(3, 0.5)}, state)
    assert updates["w"].dtype == jnp.float32 and state[0].nu["w"].dtype == jnp.bfloat16

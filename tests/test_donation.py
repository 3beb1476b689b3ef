"""The round jitted as train_diloco runs it (`dj.jit_round`): on CPU the state donated except
the fields a left-out worker's restore reads, so the compiled round keeps no round-start copy
in its temporaries; elsewhere all of it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diloco_jax as dj
from diloco_jax import donation

M, H, D = 2, 3, 64
NO_EXCLUSION = dj.DiLoCo(weights=dj.Weights(exclude_nonfinite=False))


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def params_and_batches(nan_worker=None, size=D):
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(size, size)) / size, jnp.float32)}
    x = rng.normal(size=(M, H, 4, size)).astype(np.float32)
    if nan_worker is not None:
        x[nan_worker, 1, 0, 0] = np.nan
    return params, {
        "x": jnp.asarray(x),
        "y": jnp.asarray(rng.normal(size=(M, H, 4, size)), jnp.float32),
    }


def test_restored_fields_follow_the_weight_rule():
    restored = ("inner_opt_state", "model_state")
    assert dj.donation.restored_fields(None) == restored  # the default excludes non-finite workers
    assert dj.donation.restored_fields(dj.DiLoCo()) == restored
    assert dj.donation.restored_fields(NO_EXCLUSION) == ()
    anomaly = dj.Weights(exclude_nonfinite=False, anomaly=True, weighting=dj.NormSoftmax())
    assert dj.donation.restored_fields(dj.DiLoCo(weights=anomaly)) == restored
    assert dj.donation.restored_fields(dj.DiLoCo(delay=dj.Eager(1))) == ()  # eager: exclusion off


def test_jit_round_donates_all_but_the_restored_fields_and_equals_the_plain_round():
    params, batches = params_and_batches()
    expected, expected_metrics = jax.jit(functools.partial(dj.diloco_round, loss_fn))(
        dj.init_state(params, M), batches
    )
    state = dj.init_state(params, M)
    new, metrics = dj.jit_round(loss_fn)(state, batches)
    assert all(x.is_deleted() for x in jax.tree.leaves(state.params))
    assert all(x.is_deleted() for x in jax.tree.leaves(state.outer_opt_state))
    assert not any(x.is_deleted() for x in jax.tree.leaves(state.inner_opt_state))
    jax.tree.map(np.testing.assert_array_equal, new, expected)
    jax.tree.map(np.testing.assert_array_equal, metrics, expected_metrics)

    state = dj.init_state(params, M, NO_EXCLUSION)  # nothing read back: all donated
    dj.jit_round(loss_fn, NO_EXCLUSION)(state, batches)
    assert all(x.is_deleted() for x in jax.tree.leaves(state.inner_opt_state))

    # The keyword shorthand builds the method first: int8 deltas turn the exclusion off.
    state = dj.init_state(params, M, dj.DiLoCo(compression="int8"))
    dj.jit_round(loss_fn, compression="int8")(state, batches)
    assert all(x.is_deleted() for x in jax.tree.leaves(state.inner_opt_state))
    with pytest.raises(ValueError, match="not both"):
        dj.jit_round(loss_fn, NO_EXCLUSION, compression="int8")


def compiled_temp_bytes(step, method) -> int:
    params, batches = params_and_batches(size=256)
    state = dj.init_state(params, M, method)
    return step.lower(state, batches).compile().memory_analysis().temp_size_in_bytes


def test_the_restore_keeps_no_round_start_copy():
    backend = dj.make_backend("shard_map", M)  # one worker per device
    inner_state_bytes = 2 * 256 * 256 * 4  # a device's Adam mu and nu, float32
    plain = compiled_temp_bytes(dj.jit_round(loss_fn, NO_EXCLUSION, backend=backend), NO_EXCLUSION)
    restoring = compiled_temp_bytes(dj.jit_round(loss_fn, backend=backend), None)
    whole = functools.partial(dj.diloco_round, loss_fn, backend=backend)
    copying = compiled_temp_bytes(jax.jit(whole, donate_argnums=0), None)
    assert copying >= plain + inner_state_bytes  # the round-start copy a donated state needs
    assert restoring < plain + inner_state_bytes


def test_only_cpu_keeps_the_restored_fields():
    restored = dj.donation.restored_fields(None)
    assert donation.kept_fields(None, "cpu") == restored
    assert donation.kept_fields(None, "gpu") == donation.kept_fields(None, "tpu") == ()
    assert donation.kept_fields(NO_EXCLUSION, "cpu") == ()
    assert donation.platform_of(dj.make_backend("shard_map", M)) == "cpu"
    assert donation.platform_of("vmap") == jax.default_backend()


def test_a_non_finite_worker_restarts_from_its_round_start_inner_state():
    params, batches = params_and_batches(nan_worker=1)
    state = dj.init_state(params, M)
    step = dj.jit_round(loss_fn)
    state, _ = step(state, params_and_batches()[1])  # a finite round: Adam state non-zero
    start = jax.tree.map(np.asarray, state.inner_opt_state)
    new, metrics = step(state, batches)
    np.testing.assert_array_equal(np.asarray(metrics["excluded_workers"]), [False, True])
    for got, before in zip(
        jax.tree.leaves(new.inner_opt_state), jax.tree.leaves(start), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got)[1], before[1])
        if before.ndim > 1:  # mu and nu moved on for the finite worker
            assert not np.array_equal(np.asarray(got)[0], before[0])
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(new))

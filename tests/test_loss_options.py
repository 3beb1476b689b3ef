"""Bring your own model, first parts: per-step randomness (`rng_seed`) and auxiliary metrics
(`has_aux`) in the three trainers. Keys are checked against the documented `fold_in` chain
computed here in plain JAX; aux means against NumPy means of the data."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import linear_loss, make_data

import diloco_jax as dj

M, H, R, SEED = 2, 4, 3, 11
PARAMS = {"w": jnp.zeros(3), "b": jnp.float32(0)}


def _key(seed, *path):
    key = jax.random.PRNGKey(seed)
    for i in path:
        key = jax.random.fold_in(key, i)
    return key


def noisy_loss(params, batch, key):
    """The linear loss, reporting the step's uniform draw and the batch's mean target."""
    u = jax.random.uniform(key, ())
    return linear_loss(params, batch), {"u": u, "mean_y": jnp.mean(batch["y"])}


def _expected_u(path_of):
    """float32 [R, M]: each worker's mean over its H steps of uniform(key of (r, m, h))."""
    return np.array(
        [
            [np.mean([float(jax.random.uniform(_key(SEED, *path_of(r, m, h)), ()))
                      for h in range(H)]) for m in range(M)]
            for r in range(R)
        ]
    )  # fmt: skip


def _diloco(backend="vmap", **options):
    rounds = make_data(np.random.default_rng(0), R, M, H)
    options = {"inner_optimizer": optax.sgd(0.1), **options}
    return dj.train_diloco(
        noisy_loss, PARAMS, rounds, num_rounds=R, num_workers=M, inner_steps=H, backend=backend,
        has_aux=True, rng_seed=SEED, **options,
    )  # fmt: skip


def test_round_keys_follow_the_fold_in_chain_and_differ_across_workers():
    history = _diloco().history
    got = np.array([h["worker_u"] for h in history])
    np.testing.assert_allclose(got, _expected_u(lambda r, m, h: (r, m, h)), rtol=1e-6)
    assert all(h["worker_u"][0] != h["worker_u"][1] for h in history)
    np.testing.assert_allclose([h["u"] for h in history], got.mean(axis=1), rtol=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        dict(backend="shard_map"),
        dict(backend="pmap"),
        dict(fragments=2),  # the round pauses at each fragment's sync: keys keep their step
        dict(state_sync={"mu": 2}, inner_optimizer=optax.adam(0.01)),  # DES-LOC's one scan
        dict(worker_steps=[4, 4], weighting="steps"),
    ],
)
def test_keys_do_not_depend_on_the_backend_or_the_code_path(options):
    # Another program may sum a worker's H draws in another order: the means agree to
    # rounding, while another key would draw other values entirely.
    plain = [h["worker_u"] for h in _diloco().history]
    np.testing.assert_allclose(
        [h["worker_u"] for h in _diloco(**options).history], plain, rtol=1e-6
    )


def test_aux_means_equal_the_data_means_and_masked_steps_are_left_out():
    rounds = make_data(np.random.default_rng(0), R, M, H)
    history = _diloco().history
    for r, h in enumerate(history):
        want_M = rounds[r]["y"].mean(axis=(1, 2))
        np.testing.assert_allclose(h["worker_mean_y"], want_M, rtol=1e-5)
        np.testing.assert_allclose(h["mean_y"], want_M.mean(), rtol=1e-5)
    slow = _diloco(worker_steps=[4, 2]).history
    for r, h in enumerate(slow):
        y = rounds[r]["y"]
        want = [y[0, :4].mean(), y[1, :2].mean()]
        np.testing.assert_allclose(h["worker_mean_y"], want, rtol=1e-5)
        np.testing.assert_allclose(h["mean_y"], (4 * want[0] + 2 * want[1]) / 6, rtol=1e-5)


def dropout_loss(params, batch, key):
    keep = jax.random.bernoulli(key, 0.5, batch["x"].shape)
    x = jnp.where(keep, batch["x"] / 0.5, 0.0)
    return linear_loss(params, {"x": x, "y": batch["y"]})


def test_a_dropout_model_is_reproducible_and_resumes_bit_identically(tmp_path):
    rounds = make_data(np.random.default_rng(1), 4, M, H)
    run = dict(num_workers=M, inner_steps=H, backend="vmap", rng_seed=SEED)
    a = dj.train_diloco(dropout_loss, PARAMS, rounds, num_rounds=4, **run)
    b = dj.train_diloco(dropout_loss, PARAMS, rounds, num_rounds=4, **run)
    jax.tree.map(np.testing.assert_array_equal, a.state, b.state)
    other = dj.train_diloco(dropout_loss, PARAMS, rounds, num_rounds=4, **{**run, "rng_seed": 12})
    assert not np.array_equal(other.params["w"], a.params["w"])
    dj.train_diloco(dropout_loss, PARAMS, rounds, num_rounds=2, checkpoint_dir=tmp_path, **run)
    resumed = dj.train_diloco(
        dropout_loss, PARAMS, rounds, num_rounds=4, checkpoint_dir=tmp_path, **run
    )
    jax.tree.map(np.testing.assert_array_equal, resumed.state, a.state)
    assert resumed.history == a.history
    with pytest.raises(ValueError, match="rng_seed"):  # another seed: another run
        dj.train_diloco(
            dropout_loss, PARAMS, rounds, num_rounds=4, checkpoint_dir=tmp_path,
            **{**run, "rng_seed": 12},
        )  # fmt: skip


def test_sync_keys_per_step_and_worker_and_aux():
    rounds = make_data(np.random.default_rng(0), 1, M, H)
    steps = [{k: v[:, h] for k, v in rounds[0].items()} for h in range(H)]
    result = dj.train_sync(
        noisy_loss, PARAMS, steps, num_steps=H, num_workers=M, has_aux=True, rng_seed=SEED
    )
    for s, entry in enumerate(result.history):
        want = [float(jax.random.uniform(_key(SEED, s, m), ())) for m in range(M)]
        np.testing.assert_allclose(entry["worker_u"], want, rtol=1e-6)
        np.testing.assert_allclose(entry["worker_mean_y"], steps[s]["y"].mean(axis=1), rtol=1e-5)


def test_async_job_keys_and_aux():
    rounds = make_data(np.random.default_rng(0), 3, M, H)
    result = dj.train_async(
        noisy_loss, PARAMS, rounds, num_workers=M, inner_steps=H, num_updates=4,
        step_seconds=(1.0, 1.5), has_aux=True, rng_seed=SEED,
    )  # fmt: skip
    schedule = dj.async_schedule((1.0, 1.5), H, 4)
    for entry, event in zip(result.history, schedule.events, strict=True):
        draws = [jax.random.uniform(_key(SEED, event.job, event.worker, h), ()) for h in range(H)]
        np.testing.assert_allclose(entry["u"], np.mean(draws), rtol=1e-6)
        want_y = rounds[event.job]["y"][event.worker].mean()
        np.testing.assert_allclose(entry["mean_y"], want_y, rtol=1e-5)


def test_loss_fn_mistakes_are_clear_errors():
    rounds = make_data(np.random.default_rng(0), 1, M, H)
    run = dict(num_rounds=1, num_workers=M, inner_steps=H, backend="vmap")
    with_aux = lambda p, b: (linear_loss(p, b), {"n": jnp.float32(1)})  # noqa: E731
    with pytest.raises(ValueError, match="loss_fn returned a tuple: .* pass has_aux=True"):
        dj.train_diloco(with_aux, PARAMS, rounds, **run)
    with pytest.raises(ValueError, match=r"loss_fn with has_aux=True must return \(loss, aux\)"):
        dj.train_diloco(linear_loss, PARAMS, rounds, has_aux=True, **run)
    vector = lambda p, b: (linear_loss(p, b), {"v": jnp.ones(3)})  # noqa: E731
    with pytest.raises(ValueError, match=r"loss_fn's aux\['v'\] must be a numeric scalar"):
        dj.train_diloco(vector, PARAMS, rounds, has_aux=True, **run)
    for name in ("loss", "wire_bytes", "outer_grad_norm"):
        clash = lambda p, b, n=name: (linear_loss(p, b), {n: jnp.float32(0)})  # noqa: E731
        with pytest.raises(ValueError, match=f"aux name '{name}' collides"):
            dj.train_diloco(clash, PARAMS, rounds, has_aux=True, **run)
    with pytest.raises(ValueError, match="loss_fn must return a float scalar"):
        dj.train_diloco(lambda p, b: jnp.ones(2), PARAMS, rounds, **run)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="rng_seed must be None or an integer >= 0"):
            dj.train_diloco(dropout_loss, PARAMS, rounds, rng_seed=bad, **run)
    with pytest.raises(ValueError, match="has_aux must be True or False"):
        dj.train_diloco(linear_loss, PARAMS, rounds, has_aux=1, **run)

"""DES-LOC's optimizer-state sync (Iacob et al. 2025) against a NumPy reference written from
the definition: Adam inner steps whose first and second moments are averaged over the
workers after every K_u-th and K_v-th inner step counted over the run, plain averaging of
the params once a round."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import linear_grads, linear_loss, make_data

import diloco_jax as dj
from diloco_jax import hlo

M, H, R = 4, 3, 4
LR, B1, B2, EPS = 0.05, 0.9, 0.95, 1e-8
INNER = optax.adam(LR, b1=B1, b2=B2, eps=EPS)
OUTER = optax.sgd(1.0)  # plain averaging of the params, the paper's setting
PARAMS = {"w": np.asarray([0.3, -0.2, 0.1], np.float32), "b": np.float32(0.5)}


def np_des_loc(rounds, k_mu, k_nu):
    """Float64: each worker's Adam on (w, b); after global step s, mu averaged over the
    workers if s % k_mu == 0 and nu if s % k_nu == 0; θ ← mean of the workers' params."""
    num = rounds[0]["x"].shape[0]
    w, b = np.float64(PARAMS["w"]), np.float64(PARAMS["b"])
    zeros = lambda: [np.zeros(3), 0.0]  # noqa: E731
    mu, nu = [zeros() for _ in range(num)], [zeros() for _ in range(num)]
    step = 0
    for batch in rounds:
        x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
        local = [[w.copy(), b] for _ in range(num)]
        for h in range(x.shape[1]):
            step += 1
            for m in range(num):
                gw, gb, _ = linear_grads(local[m][0], local[m][1], x[m, h], y[m, h])
                for i, g in enumerate((gw, gb)):
                    mu[m][i] = B1 * mu[m][i] + (1 - B1) * g
                    nu[m][i] = B2 * nu[m][i] + (1 - B2) * g**2
                    m_hat, v_hat = mu[m][i] / (1 - B1**step), nu[m][i] / (1 - B2**step)
                    local[m][i] = local[m][i] - LR * m_hat / (np.sqrt(v_hat) + EPS)
            for moments, every in ((mu, k_mu), (nu, k_nu)):
                if every and step % every == 0:
                    mean = [np.mean([mo[i] for mo in moments], axis=0) for i in range(2)]
                    for mo in moments:
                        mo[0], mo[1] = mean[0].copy(), mean[1]
        w = np.mean([p[0] for p in local], axis=0)
        b = np.mean([p[1] for p in local])
    return w, b, mu, nu


def _train(rounds, backend="vmap", **options):
    return dj.train_diloco(
        linear_loss, PARAMS, rounds, num_rounds=len(rounds), num_workers=M, inner_steps=H,
        inner_optimizer=INNER, outer_optimizer=OUTER, backend=backend, **options,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["vmap", "shard_map", "pmap"])
@pytest.mark.parametrize("k_mu, k_nu", [(2, 5), (3 * H, 6 * H)])
def test_moments_averaged_on_their_schedules(k_mu, k_nu, backend):
    rounds = make_data(np.random.default_rng(0), R, M, H)
    result = _train(rounds, backend, state_sync={"mu": k_mu, "nu": k_nu})
    w, b, mu, nu = np_des_loc(rounds, k_mu, k_nu)
    np.testing.assert_allclose(result.params["w"], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.params["b"], b, rtol=1e-5, atol=1e-6)
    adam = result.state.inner_opt_state[0]
    for m in range(M):
        np.testing.assert_allclose(adam.mu["w"][m], mu[m][0], rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(adam.nu["w"][m], nu[m][0], rtol=1e-4, atol=1e-9)


def test_no_state_sync_is_diloco_bit_for_bit():
    rounds = make_data(np.random.default_rng(1), R, M, H)
    plain = _train(rounds)
    never = _train(rounds, state_sync={"mu": 10**6, "nu": 10**6})  # due after the run ends
    jax.tree.map(np.testing.assert_array_equal, never.state, plain.state)
    # and the reference without syncs is plain DiLoCo with averaging
    w, _, _, _ = np_des_loc(rounds, 0, 0)
    np.testing.assert_allclose(plain.params["w"], w, rtol=1e-5, atol=1e-6)


def test_state_sync_bytes_are_counted_and_compiled_in_a_conditional():
    params = {"w": jnp.zeros(64), "b": jnp.float32(0)}
    rounds = [{"x": np.ones((M, H, 2, 64), np.float32), "y": np.ones((M, H, 2), np.float32)}] * 3
    options = dict(state_sync={"mu": 2, "nu": 4}, exclude_nonfinite=False)
    result = dj.train_diloco(
        linear_loss, params, rounds, num_rounds=3, num_workers=M, inner_steps=H,
        inner_optimizer=INNER, outer_optimizer=OUTER, backend="shard_map", **options,
    )  # fmt: skip
    plain = dj.train_diloco(
        linear_loss, params, rounds, num_rounds=3, num_workers=M, inner_steps=H,
        inner_optimizer=INNER, outer_optimizer=OUTER, backend="shard_map",
        exclude_nonfinite=False,
    )  # fmt: skip
    moment = 65 * 4 * 2 * (M - 1) / M  # one ring all-reduce of a moment (64 + 1 floats)
    for r, (got, base) in enumerate(zip(result.history, plain.history, strict=True)):
        steps = (r + 1) * H
        syncs = steps // 2 + steps // 4
        assert got["wire_bytes"] - base["wire_bytes"] == pytest.approx(syncs * moment, abs=1)
    # In the compiled round, the moments' all-reduces sit in the scan, under a conditional.
    state = dj.init_state(params, M, inner_optimizer=INNER, outer_optimizer=OUTER)
    round_fn = functools.partial(
        dj.diloco_round, linear_loss, inner_optimizer=INNER, outer_optimizer=OUTER,
        backend=dj.make_backend("shard_map", M), state_sync={"mu": 2, "nu": 4},
    )  # fmt: skip
    found = hlo.collectives(jax.jit(round_fn).lower(state, jax.tree.map(jnp.asarray, rounds[0])))
    in_loop = [c for c in found if c.in_loop]
    assert sorted(c.operand_bytes for c in in_loop) == [260, 260]  # (w, b) of mu, of nu


@pytest.mark.parametrize(
    "sync, match",
    [
        ({"mu": 0}, "StateSync.mu must be an integer >= 1"),
        ({"mu": 1.5}, "StateSync.mu must be an integer >= 1"),
        ({"momentum": 3}, "StateSync field 'momentum' is not one field"),
        ({}, "StateSync needs at least one field"),
        ("mu", "StateSync takes fields as keywords or a dict"),
    ],
)
def test_bad_state_sync(sync, match):
    with pytest.raises(ValueError, match=match):
        dj.StateSync(sync).check_run(PARAMS, M, H, INNER.init(PARAMS))
    with pytest.raises(ValueError, match=match):
        _train(make_data(np.random.default_rng(2), 1, M, H), state_sync=sync)

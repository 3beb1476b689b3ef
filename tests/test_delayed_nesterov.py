"""delayed_nesterov against a NumPy reference of the rule, written here from the paper."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diloco_jax as dj
from diloco_jax.delayed_nesterov_outer import DelayedNesterovState


def dn_reference(deltas, lr, beta, n, c, theta0):
    """Thetas after each arrival of Delayed Nesterov, in float64 (lr: a function of the
    0-based arrival index)."""
    theta = {k: np.asarray(v, np.float64) for k, v in theta0.items()}
    m = {k: np.zeros_like(v) for k, v in theta.items()}
    buf = {k: np.zeros_like(v) for k, v in theta.items()}
    thetas = []
    for k, g in enumerate(deltas, start=1):
        eps = lr(k - 1)
        for name in theta:
            buf[name] = buf[name] + g[name]
            if k % n == 0:
                m[name] = beta * m[name] + buf[name] / n
                step = (1 - c * n + c) * beta * m[name] + g[name] / n
                buf[name] = np.zeros_like(buf[name])
            else:
                step = c * beta * m[name] + g[name] / n
            theta[name] = theta[name] - eps * step
        thetas.append({name: v.copy() for name, v in theta.items()})
    return thetas


def arrivals(count, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "a": rng.normal(size=3).astype(np.float32),
            "b": rng.normal(size=(2, 2)).astype(np.float32),
        }
        for _ in range(count)
    ]


THETA0 = {"a": np.array([0.5, -1.0, 2.0], np.float32), "b": np.ones((2, 2), np.float32)}


def run_optax(optimizer, deltas, theta0=THETA0):
    """Feeds each delta to `optimizer` and applies its update, as the async server does."""
    params = jax.tree.map(jnp.asarray, theta0)
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    thetas = []
    for g in deltas:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
        thetas.append(params)
    return thetas, state


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("c", [0.0, 0.1])
def test_rule_matches_numpy_reference(n, c):
    deltas = arrivals(9)
    got, state = run_optax(dj.delayed_nesterov(0.7, momentum=0.9, buffer_size=n, c=c), deltas)
    want = dn_reference(deltas, lambda k: 0.7, 0.9, n, c, THETA0)
    for g, w in zip(got, want, strict=True):
        for name in w:
            np.testing.assert_allclose(g[name], w[name], rtol=2e-6, atol=2e-6)
    assert int(state.count) == 9
    assert state.count.dtype == jnp.int32


def test_schedule_learning_rate_is_counted_per_arrival():
    schedule = optax.linear_schedule(0.8, 0.1, transition_steps=6)
    deltas = arrivals(8, seed=1)
    got, _ = run_optax(dj.delayed_nesterov(schedule, momentum=0.5, buffer_size=3, c=0.1), deltas)
    want = dn_reference(deltas, lambda k: float(schedule(k)), 0.5, 3, 0.1, THETA0)
    for g, w in zip(got, want, strict=True):
        for name in w:
            np.testing.assert_allclose(g[name], w[name], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("lr", [0.7, optax.cosine_decay_schedule(0.7, 5)])
def test_buffer_one_and_c_zero_is_optax_nesterov_bit_for_bit(lr):
    deltas = arrivals(7, seed=2)
    got, _ = run_optax(dj.delayed_nesterov(lr, momentum=0.9, buffer_size=1), deltas)
    want, _ = run_optax(optax.sgd(lr, momentum=0.9, nesterov=True), deltas)
    for g, w in zip(got, want, strict=True):
        for name in w:
            np.testing.assert_array_equal(g[name], w[name])


def test_n_arrivals_from_one_theta_are_one_nesterov_step_on_their_mean():
    # c = 0: the N arrivals of a round together move theta as Nesterov on their mean does.
    n, rounds = 4, 3
    deltas = arrivals(n * rounds, seed=3)
    got, _ = run_optax(dj.delayed_nesterov(0.5, momentum=0.9, buffer_size=n), deltas)
    means = [
        jax.tree.map(lambda *xs: np.mean(np.stack(xs), axis=0), *deltas[r * n : (r + 1) * n])
        for r in range(rounds)
    ]
    want, _ = run_optax(optax.sgd(0.5, momentum=0.9, nesterov=True), means)
    for r in range(rounds):
        for name in THETA0:
            np.testing.assert_allclose(got[(r + 1) * n - 1][name], want[r][name], rtol=1e-5)


def test_state_and_update_keep_dtypes_and_structure():
    opt = dj.delayed_nesterov(0.1, buffer_size=2)
    params = {"x": jnp.zeros((2,), jnp.float32), "y": jnp.zeros((), jnp.bfloat16)}
    state = opt.init(params)
    assert isinstance(state, DelayedNesterovState)
    updates, state = opt.update(params, state)
    assert jax.tree.map(lambda u: u.dtype, updates) == jax.tree.map(lambda p: p.dtype, params)
    assert jax.tree.structure(state.buffer) == jax.tree.structure(params)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(buffer_size=0), "buffer_size"),
        (dict(buffer_size=1.5), "buffer_size"),
        (dict(buffer_size=True), "buffer_size"),
        (dict(momentum=-0.1), "momentum"),
        (dict(momentum=1.0), "momentum"),
        (dict(momentum=math.nan), "momentum"),
        (dict(c=-0.1), "c"),
        (dict(c=math.nan), "c"),
        (dict(learning_rate=0.0), "learning_rate"),
        (dict(learning_rate=-1.0), "learning_rate"),
        (dict(learning_rate=math.inf), "learning_rate"),
        (dict(learning_rate="0.1"), "learning_rate"),
    ],
)
def test_bad_input_names_the_argument(kwargs, name):
    args = dict(learning_rate=0.1) | kwargs
    with pytest.raises(ValueError, match=f"^{name} "):
        dj.delayed_nesterov(**args)

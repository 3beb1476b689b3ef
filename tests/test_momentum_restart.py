"""restart_momentum against NumPy references of the rule, written here from the paper's rule
(Topollai et al. 2026, arXiv 2605.28585): update n starts from the wrapped optimizer's initial
state (zero momentum) when n > 0 and n % K == 0."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diloco_jax as dj
from diloco_jax.momentum_restart import RestartMomentumState, restart_momentum

LR, BETA = 0.7, 0.9
PARAMS = {"a": np.array([0.5, -1.0, 2.0], np.float32), "b": np.ones((2, 2), np.float32)}


def nesterov_reference(grads, lr, beta, every):
    """Updates and final momentum of optax.sgd(lr, momentum=beta, nesterov=True) with
    restarts, in float64. optax's trace: m <- g + beta m; Nesterov update -lr (g + beta m),
    with the new m."""
    m = {k: np.zeros(v.shape, np.float64) for k, v in grads[0].items()}
    steps = []
    for n, g in enumerate(grads):
        if n > 0 and n % every == 0:
            m = {k: np.zeros_like(v) for k, v in m.items()}
        m = {k: g[k] + beta * m[k] for k in m}
        steps.append({k: -lr * (g[k] + beta * m[k]) for k in m})
    return steps, m


def random_grads(count, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {k: rng.normal(size=v.shape).astype(np.float32) for k, v in PARAMS.items()}
        for _ in range(count)
    ]


def run(optimizer, grads, params=PARAMS):
    """Feeds each gradient to `optimizer` (jitted); returns the updates and the final state."""
    params = jax.tree.map(jnp.asarray, params)
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    steps = []
    for g in grads:
        step, state = update(g, state, params)
        steps.append(step)
    return steps, state


def nesterov():
    return optax.sgd(LR, momentum=BETA, nesterov=True)


def test_nesterov_with_restarts_matches_numpy_reference():
    grads = random_grads(8)
    got, state = run(restart_momentum(nesterov(), every=3), grads)
    want, want_m = nesterov_reference(grads, LR, BETA, every=3)
    for g, w in zip(got, want, strict=True):
        for k in w:
            np.testing.assert_allclose(g[k], w[k], rtol=1e-6, atol=1e-6)
    assert isinstance(state, RestartMomentumState)
    assert int(state.count) == 8 and state.count.dtype == jnp.int32
    trace = state.inner_state[0].trace
    for k in want_m:
        np.testing.assert_allclose(trace[k], want_m[k], rtol=1e-6, atol=1e-6)
        assert trace[k].dtype == jnp.float32 and trace[k].shape == PARAMS[k].shape


def test_restart_update_starts_from_zero_momentum():
    # With K = 3 update 3 must equal a fresh optimizer's first update on the same gradient,
    # -lr (1 + beta) g, whatever came before; update 2 must not (it still has momentum).
    grads = random_grads(4, seed=1)
    got, _ = run(restart_momentum(nesterov(), every=3), grads)
    for k in PARAMS:
        np.testing.assert_allclose(got[3][k], -LR * (1 + BETA) * grads[3][k], rtol=1e-6)
        assert not np.allclose(got[2][k], -LR * (1 + BETA) * grads[2][k])


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.chain(optax.clip_by_global_norm(1.0), nesterov()),
        lambda: optax.adam(0.1),
    ],
    ids=["clip_sgd", "adam"],
)
def test_whole_wrapped_state_is_reset(make):
    # The update at n = K is the wrapped optimizer's update from its initial state.
    grads = random_grads(3, seed=2)
    got, _ = run(restart_momentum(make(), every=2), grads)
    want, _ = run(make(), grads[2:])
    for k in PARAMS:
        np.testing.assert_allclose(got[2][k], want[0][k], rtol=1e-6, atol=1e-7)


def test_every_beyond_the_run_is_the_plain_optimizer_bit_for_bit():
    grads = random_grads(8, seed=3)
    got, state = run(restart_momentum(nesterov(), every=100), grads)
    want, plain_state = run(nesterov(), grads)
    for g, w in zip(got, want, strict=True):
        for k in w:
            np.testing.assert_array_equal(g[k], w[k])
    jax.tree.map(np.testing.assert_array_equal, state.inner_state, plain_state)


def test_without_params_the_fresh_state_is_built_from_the_updates():
    opt = restart_momentum(nesterov(), every=2)
    grads = random_grads(3, seed=4)
    state = opt.init(jax.tree.map(jnp.asarray, PARAMS))
    steps = []
    for g in grads:
        step, state = jax.jit(opt.update)(g, state)
        steps.append(step)
    want, _ = nesterov_reference(grads, LR, BETA, every=2)
    for k in PARAMS:
        np.testing.assert_allclose(steps[2][k], want[2][k], rtol=1e-6)


def test_vmap_over_stacked_states_matches_a_loop():
    # Slices start at different counts (0, 1, 2), so the restart predicate differs per slice.
    opt = restart_momentum(nesterov(), every=2)
    params = jax.tree.map(jnp.asarray, PARAMS)
    states = [opt.init(params)] + [run(opt, random_grads(i, seed=10 + i))[1] for i in (1, 2)]
    grads = [random_grads(3, seed=20 + n) for n in range(4)]  # grads[n][i]: step n, slice i
    stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
    vupdate = jax.jit(jax.vmap(opt.update, in_axes=(0, 0, None)))
    vstate = stack(states)
    loop_states = list(states)
    update = jax.jit(opt.update)
    for n in range(4):
        vstep, vstate = vupdate(stack(grads[n]), vstate, params)
        for i in range(3):
            step, loop_states[i] = update(grads[n][i], loop_states[i], params)
            for k in PARAMS:
                np.testing.assert_allclose(vstep[k][i], step[k], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(vstate.count, [4, 5, 6])
    jax.tree.map(
        lambda v, *xs: np.testing.assert_allclose(v, np.stack(xs), rtol=1e-6, atol=1e-7),
        vstate,
        *loop_states,
    )


# --- inside a real DiLoCo run -----------------------------------------------------------------

D, B = 3, 4
LIN_PARAMS = {"w": np.array([0.3, -0.2, 0.1], np.float32), "b": np.array(0.05, np.float32)}


def linear_loss(p, batch):
    return 0.5 * jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)


def linear_rounds(num_rounds, m, h, seed=0):
    rng = np.random.default_rng(seed)
    true_w = np.array([1.0, -2.0, 0.5])
    rounds = []
    for _ in range(num_rounds):
        x = rng.normal(size=(m, h, B, D)).astype(np.float32)
        y = (x @ true_w + 0.3 + 0.1 * rng.normal(size=(m, h, B))).astype(np.float32)
        rounds.append({"x": x, "y": y})
    return rounds


def diloco_reference(rounds, inner_lr, lr, beta, every):
    """DiLoCo in float64: each worker takes H SGD steps from theta on its batches; the outer
    gradient is mean_m(theta - theta_m); outer Nesterov SGD with restarts every K rounds."""
    theta = {k: np.asarray(v, np.float64) for k, v in LIN_PARAMS.items()}
    m = {k: np.zeros_like(v) for k, v in theta.items()}
    for n, rnd in enumerate(rounds):
        x, y = rnd["x"].astype(np.float64), rnd["y"].astype(np.float64)
        deltas = []
        for w in range(x.shape[0]):
            p = {k: v.copy() for k, v in theta.items()}
            for h in range(x.shape[1]):
                r = x[w, h] @ p["w"] + p["b"] - y[w, h]
                p["w"] = p["w"] - inner_lr * (x[w, h].T @ r) / B
                p["b"] = p["b"] - inner_lr * np.mean(r)
            deltas.append({k: theta[k] - p[k] for k in theta})
        g = {k: np.mean([d[k] for d in deltas], axis=0) for k in theta}
        if n > 0 and n % every == 0:
            m = {k: np.zeros_like(v) for k, v in m.items()}
        m = {k: g[k] + beta * m[k] for k in m}
        theta = {k: theta[k] - lr * (g[k] + beta * m[k]) for k in theta}
    return theta, m


def train(outer_optimizer, rounds, m, h, inner_optimizer=None):
    return dj.train_diloco(
        linear_loss,
        LIN_PARAMS,
        rounds,
        num_rounds=len(rounds),
        num_workers=m,
        inner_steps=h,
        inner_optimizer=inner_optimizer,
        outer_optimizer=outer_optimizer,
        backend="vmap",
    )


def test_diloco_with_every_beyond_the_run_is_bit_identical_to_plain():
    rounds = linear_rounds(4, m=2, h=3, seed=1)
    inner = optax.sgd(0.1, momentum=0.5)
    got = train(restart_momentum(nesterov(), every=100), rounds, m=2, h=3, inner_optimizer=inner)
    want = train(nesterov(), rounds, m=2, h=3, inner_optimizer=inner)
    for k in LIN_PARAMS:
        np.testing.assert_array_equal(got.params[k], want.params[k])


def test_diloco_run_matches_numpy_reference():
    rounds = linear_rounds(4, m=2, h=2, seed=2)
    result = train(
        restart_momentum(nesterov(), every=2), rounds, m=2, h=2, inner_optimizer=optax.sgd(0.1)
    )
    want, want_m = diloco_reference(rounds, 0.1, LR, BETA, every=2)
    state = result.state.outer_opt_state
    assert int(state.count) == 4
    trace = state.inner_state[0].trace
    for k in LIN_PARAMS:
        np.testing.assert_allclose(result.params[k], want[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(trace[k], want_m[k], rtol=1e-5, atol=1e-6)
        assert trace[k].dtype == jnp.float32


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("every", [0, -1, True, 1.5, None, "2"])
def test_bad_every_is_refused(every):
    with pytest.raises(ValueError, match="every"):
        restart_momentum(nesterov(), every=every)


@pytest.mark.parametrize("optimizer", [None, object(), optax.sgd])
def test_bad_optimizer_is_refused(optimizer):
    with pytest.raises(ValueError, match="optimizer"):
        restart_momentum(optimizer, every=2)


def test_numpy_integer_every_is_accepted():
    opt = restart_momentum(nesterov(), every=np.int64(2))
    state = opt.init(jax.tree.map(jnp.asarray, PARAMS))
    assert int(state.count) == 0 and state.count.dtype == jnp.int32

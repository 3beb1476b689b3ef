"""Delayed and eager outer updates against a NumPy reference written from the definitions
(Kale, Douillard, Donchev 2025), their degenerate cases, the overlap the compiled round
allows, resume, and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import linear_grads, linear_loss, make_data

import diloco_jax as dj
from diloco_jax import hlo

INNER_LR, OUTER_LR, MOMENTUM = 0.05, 0.7, 0.9
INNER = optax.sgd(INNER_LR)
OUTER = optax.sgd(OUTER_LR, momentum=MOMENTUM, nesterov=True)
PARAMS = {"w": np.asarray([0.3, -0.2, 0.1], np.float32), "b": np.float32(0.5)}
M, H, R = 4, 3, 4


def np_delayed(rounds, delay, eager):
    """Naive delayed (every worker on θ; θ_t = Nesterov(θ_{t-1}, Δ̄_{t-d})) or eager (worker
    m on its own θ_m with its own momentum; Δ̃_m = Δ̄_{t-d} + (Δ_m^t - Δ_m^{t-d}) / M), with
    SGD inner steps, float64. Returns (final params: θ, or the mean of the θ_m; losses[t][m])."""
    num = rounds[0]["x"].shape[0]
    w0, b0 = np.float64(PARAMS["w"]), np.float64(PARAMS["b"])
    thetas = [(w0.copy(), b0) for _ in range(num)]  # eager: one per worker; naive: all equal
    traces = [(np.zeros(3), 0.0) for _ in range(num)]
    deltas, losses = [], []  # deltas[t][m] = (dw, db)
    for t, batch in enumerate(rounds):
        x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
        fresh, round_losses = [], []
        for m in range(num):
            wm, bm = thetas[m][0].copy(), thetas[m][1]
            step_losses = []
            for h in range(x.shape[1]):
                gw, gb, loss = linear_grads(wm, bm, x[m, h], y[m, h])
                step_losses.append(loss)
                wm, bm = wm - INNER_LR * gw, bm - INNER_LR * gb
            fresh.append((thetas[m][0] - wm, thetas[m][1] - bm))
            round_losses.append(np.mean(step_losses))
        deltas.append(fresh)
        losses.append(round_losses)
        old = deltas[t - delay] if t >= delay else [(np.zeros(3), 0.0)] * num
        mean = (np.mean([d[0] for d in old], 0), np.mean([d[1] for d in old]))
        for m in range(num):
            g = mean
            if eager:
                g = (
                    mean[0] + (fresh[m][0] - old[m][0]) / num,
                    mean[1] + (fresh[m][1] - old[m][1]) / num,
                )
            tw, tb = g[0] + MOMENTUM * traces[m][0], g[1] + MOMENTUM * traces[m][1]
            traces[m] = (tw, tb)
            thetas[m] = (
                thetas[m][0] - OUTER_LR * (g[0] + MOMENTUM * tw),
                thetas[m][1] - OUTER_LR * (g[1] + MOMENTUM * tb),
            )
    w = np.mean([th[0] for th in thetas], 0)
    b = np.mean([th[1] for th in thetas])
    return w, b, losses


def _train(rounds, backend="vmap", **options):
    return dj.train_diloco(
        linear_loss, PARAMS, rounds, num_rounds=len(rounds), num_workers=rounds[0]["x"].shape[0],
        inner_steps=rounds[0]["x"].shape[1], inner_optimizer=INNER, outer_optimizer=OUTER,
        backend=backend, **options,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["vmap", "shard_map", "pmap"])
@pytest.mark.parametrize("delay, eager", [(1, False), (2, False), (1, True), (2, True)])
def test_delayed_and_eager_match_numpy(delay, eager, backend):
    rounds = make_data(np.random.default_rng(1), R, M, H)
    result = _train(rounds, backend, outer_delay=delay, eager=eager)
    w, b, losses = np_delayed(rounds, delay, eager)
    np.testing.assert_allclose(result.params["w"], w, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(result.params["b"], b, rtol=2e-5, atol=1e-6)
    for entry, want in zip(result.history, losses, strict=True):
        np.testing.assert_allclose(entry["worker_loss"], want, rtol=2e-5)
    if eager:
        assert result.state.params is None and result.state.local_params["w"].shape == (M, 3)
        # each worker's own θ_m differs from the others' (its own fresh delta)
        assert not np.allclose(result.state.local_params["w"][0], result.state.local_params["w"][1])


def test_no_delay_is_diloco_and_delay_only_shifts_the_mean():
    rounds = make_data(np.random.default_rng(2), R, M, H)
    plain = _train(rounds, exclude_nonfinite=False)
    w, b, _ = np_delayed(rounds, 0, False)
    np.testing.assert_allclose(plain.params["w"], w, rtol=2e-5)
    delayed = _train(rounds, outer_delay=1, exclude_nonfinite=False)
    # the first round applies a zero mean: θ stays where it started
    first = _train(rounds[:1], outer_delay=1, exclude_nonfinite=False)
    jax.tree.map(lambda a, p: np.testing.assert_array_equal(a, p), first.params, PARAMS)
    assert not np.allclose(delayed.params["w"], plain.params["w"])


@pytest.mark.parametrize("delay", [1, 2])
def test_eager_with_one_worker_is_diloco(delay):
    rounds = make_data(np.random.default_rng(3), R, 1, H)
    plain = _train(rounds)
    eager = _train(rounds, outer_delay=delay, eager=True)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        eager.params,
        plain.params,
    )


def test_delay_with_faults_and_compression():
    """Naive delay with non-finite exclusion and an int8 exchange: a NaN worker's delta
    travels with weight 0 and the run stays finite; weights ride with the delta in flight."""
    rounds = make_data(np.random.default_rng(4), R, M, H)
    rounds[1]["x"][2, 0, 0, 0] = np.nan
    result = _train(rounds, outer_delay=1, exclude_nonfinite=True, compression="int8,ef=1")
    assert result.history[1]["excluded_workers"] == [2]
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(result.params))
    # Round 1's deltas are in flight at the end of a 2-round run: worker 2's with weight 0.
    two = _train(rounds[:2], outer_delay=1, exclude_nonfinite=True, compression="int8,ef=1")
    assert two.state.pending_weights.tolist() == [1.0, 1.0, 0.0, 1.0]


def test_the_delayed_exchange_does_not_wait_for_the_inner_loop():
    """In the compiled delayed round, no collective reads the inner scan's result: XLA's
    asynchronous collectives may run the exchange under the scan (on GPU/TPU)."""
    params = {"w": jnp.zeros(64), "b": jnp.float32(0)}
    batch = {"x": jnp.ones((4, 3, 2, 64)), "y": jnp.ones((4, 3, 2))}
    for options in (dict(outer_delay=1), dict(outer_delay=2, eager=True)):
        state = dj.init_state(params, 4, INNER, OUTER, **options)
        round_fn = functools.partial(
            dj.diloco_round, linear_loss, inner_optimizer=INNER, outer_optimizer=OUTER,
            backend=dj.make_backend("shard_map", 4), **options,
        )  # fmt: skip
        text = jax.jit(round_fn).lower(state, batch).compile().as_text()
        exchanges = [c for c in hlo.collectives(text) if c.operand_bytes >= 64 * 4]
        assert exchanges and not any(hlo.depends_on(text, c.name, "while") for c in exchanges)
    # Without a delay the exchange reads the scan's result: the check can fail.
    state = dj.init_state(params, 4, INNER, OUTER)
    round_fn = functools.partial(
        dj.diloco_round, linear_loss, inner_optimizer=INNER, outer_optimizer=OUTER,
        backend=dj.make_backend("shard_map", 4),
    )  # fmt: skip
    text = jax.jit(round_fn).lower(state, batch).compile().as_text()
    exchanges = [c for c in hlo.collectives(text) if c.operand_bytes >= 64 * 4]
    assert exchanges and all(hlo.depends_on(text, c.name, "while") for c in exchanges)


@pytest.mark.parametrize("eager", [False, True])
def test_resume_carries_what_is_in_flight(eager, tmp_path):
    rounds = make_data(np.random.default_rng(5), R, M, H)
    options = dict(outer_delay=2, eager=eager, exclude_nonfinite=False)
    full = _train(rounds, **options)
    _train(rounds[:2], checkpoint_dir=tmp_path, **options)
    resumed = _train(rounds, checkpoint_dir=tmp_path, **options)
    jax.tree.map(np.testing.assert_array_equal, resumed.params, full.params)
    jax.tree.map(np.testing.assert_array_equal, resumed.state, full.state)
    with pytest.raises(ValueError, match="pending_deltas"):  # another delay: another run
        _train(rounds, checkpoint_dir=tmp_path, exclude_nonfinite=False)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(outer_delay=-1), "outer_delay must be an integer >= 0"),
        (dict(outer_delay=3), "outer_delay must be at most 2"),
        (dict(outer_delay=True), "outer_delay must be an integer"),
        (dict(eager=True), "eager=True needs outer_delay >= 1"),
        (dict(outer_delay=1, eager=1), "eager must be a bool"),
        (dict(outer_delay=1, fragments=2), "can't be combined with fragments"),
        (dict(outer_delay=1, eager=True, exclude_nonfinite=True), "fault options"),
        (dict(outer_delay=1, eager=True, drop_probability=0.1), "fault options"),
    ],
)
def test_bad_delay_options(options, match):
    rounds = make_data(np.random.default_rng(6), 1, 2, 2)
    with pytest.raises(ValueError, match=match):
        _train(rounds, **options)

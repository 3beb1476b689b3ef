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


def np_delayed(rounds, delay, eager, worker_steps=None):
    """Naive delayed (every worker on θ; θ_t = Nesterov(θ_{t-1}, Δ̄_{t-d})) or eager (worker
    m on its own θ_m with its own momentum; Δ̃_m = Δ̄_{t-d} + (Δ_m^t - Δ_m^{t-d}) / M), with
    SGD inner steps, float64. `worker_steps`: worker m takes only its first h_m steps of a
    round (the mean stays uniform). Returns (final params: θ, or the mean of the θ_m;
    losses[t][m], each worker's mean over the steps it took)."""
    num = rounds[0]["x"].shape[0]
    taken = worker_steps or [rounds[0]["x"].shape[1]] * num
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
            for h in range(taken[m]):
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


def np_fragmented(rounds, delay, eager, tau, alpha, worker_steps=None):
    """Streaming DiLoCo with two fragments (leaf "b" is fragment 0, "w" fragment 1; S = H / 2
    steps apart; each worker snapshots a fragment tau steps before its sync and merges θ' +
    alpha (θ_m - θ') after it) where each fragment's mean is applied d of its syncs late
    (naive), or eagerly with each worker's own θ_m and momentum per fragment. `worker_steps`
    (naive only): worker m takes only its first h_m steps of each round and its delta weighs
    h_m in the mean. SGD inner steps, float64. Returns (final params: θ, or the mean of the
    θ_m; losses[t][m], each worker's mean over the steps it took)."""
    num, num_steps = rounds[0]["x"].shape[:2]
    taken = np.asarray(worker_steps or [num_steps] * num)
    names, per = ("b", "w"), num_steps // 2
    start = {"w": np.float64(PARAMS["w"]), "b": np.float64(PARAMS["b"])}
    thetas = [dict(start) for _ in range(num)]  # naive: the same θ on every worker
    traces = [{k: np.zeros_like(v) for k, v in start.items()} for _ in range(num)]
    running = [dict(start) for _ in range(num)]
    sent = {name: [] for name in names}  # sent[name][t][m]: worker m's delta of round t
    losses = []
    for batch in rounds:
        x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
        snaps = [{} for _ in range(num)]
        step_losses = np.zeros((num, num_steps))
        for h in range(num_steps):
            for m, p in enumerate(running):
                if h < taken[m]:
                    gw, gb, step_losses[m, h] = linear_grads(p["w"], p["b"], x[m, h], y[m, h])
                    running[m] = {"w": p["w"] - INNER_LR * gw, "b": p["b"] - INNER_LR * gb}
            for f, name in enumerate(names):
                if h + 1 == (f + 1) * per - tau:
                    for m in range(num):
                        snaps[m][name] = running[m][name]
                if h + 1 != (f + 1) * per:
                    continue
                sent[name].append([thetas[m][name] - snaps[m][name] for m in range(num)])
                fresh, t = sent[name][-1], len(sent[name]) - 1
                old = sent[name][t - delay] if t >= delay else [0.0 * d for d in fresh]
                mean = sum(w * d for w, d in zip(taken, old, strict=True)) / taken.sum()
                for m in range(num):
                    g = mean + (fresh[m] - old[m]) / num if eager else mean
                    traces[m][name] = g + MOMENTUM * traces[m][name]
                    theta = thetas[m][name] - OUTER_LR * (g + MOMENTUM * traces[m][name])
                    thetas[m][name] = theta
                    running[m][name] = theta + alpha * (running[m][name] - theta)
        losses.append(step_losses.sum(axis=1) / taken)
    return {k: np.mean([th[k] for th in thetas], axis=0) for k in names}, losses


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
        assert result.state.params is None and result.state.parts["eager"].theta["w"].shape == (
            M,
            3,
        )
        # each worker's own θ_m differs from the others' (its own fresh delta)
        theta = result.state.parts["eager"].theta
        assert not np.allclose(theta["w"][0], theta["w"][1])


STREAMING = dict(fragments=2, overlap_steps=1, merge_alpha=0.5)


@pytest.mark.parametrize(
    "delay, eager, backend",
    [
        (0, False, "vmap"),  # Streaming DiLoCo itself: checks the reference too
        (1, False, "vmap"),
        (2, False, "shard_map"),
        (1, True, "pmap"),
        (2, True, "vmap"),
        (2, True, "shard_map"),
    ],
)
def test_delayed_and_eager_with_fragments_match_numpy(delay, eager, backend):
    rounds = make_data(np.random.default_rng(7), R, M, 4)
    options = dict(outer_delay=delay, eager=eager) if delay else {}
    result = _train(rounds, backend, exclude_nonfinite=False, **STREAMING, **options)
    want, losses = np_fragmented(rounds, delay, eager, tau=1, alpha=0.5)
    for name in ("w", "b"):
        np.testing.assert_allclose(result.params[name], want[name], rtol=2e-5, atol=1e-6)
    for entry, want_losses in zip(result.history, losses, strict=True):
        np.testing.assert_allclose(entry["worker_loss"], want_losses, rtol=2e-5)
    if eager:  # each worker's own θ_m beside the params it trains
        state = result.state
        own = state.parts["eager"]
        assert own.theta["w"].shape == (M, 3) and len(own.outer) == 2
        assert not np.allclose(own.theta["w"][0], state.parts["workers"].params["w"][0])


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_delay_with_fragments_and_step_weighting_matches_numpy(backend):
    """Slow workers over fragments: each fragment's weights travel with its deltas."""
    rounds = make_data(np.random.default_rng(9), R, M, 4)
    steps = [4, 3, 2, 1]
    result = _train(
        rounds, backend, outer_delay=1, worker_steps=steps, weighting="steps",
        exclude_nonfinite=False, **STREAMING,
    )  # fmt: skip
    want, losses = np_fragmented(rounds, 1, False, tau=1, alpha=0.5, worker_steps=steps)
    for name in ("w", "b"):
        np.testing.assert_allclose(result.params[name], want[name], rtol=2e-5, atol=1e-6)
    for entry, want_losses in zip(result.history, losses, strict=True):
        np.testing.assert_allclose(entry["worker_loss"], want_losses, rtol=2e-5)
    assert result.state.parts["delay"].weights.tolist() == [[4, 4], [3, 3], [2, 2], [1, 1]]


@pytest.mark.parametrize("delay", [1, 2])
def test_eager_with_fragments_and_one_worker_is_streaming_diloco(delay):
    rounds = make_data(np.random.default_rng(8), R, 1, 4)
    plain = _train(rounds, **STREAMING)
    eager = _train(rounds, outer_delay=delay, eager=True, **STREAMING)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        (eager.params, eager.state.parts["workers"].params),
        (plain.params, plain.state.parts["workers"].params),
    )


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_eager_with_slow_workers_matches_numpy(backend):
    """Per-worker step counts keep every worker's share 1/M, so eager updates take them."""
    rounds = make_data(np.random.default_rng(11), R, M, H)
    steps = (3, 2, 1, 3)
    result = _train(rounds, backend, outer_delay=1, eager=True, worker_steps=steps)
    w, b, losses = np_delayed(rounds, 1, True, worker_steps=steps)
    np.testing.assert_allclose(result.params["w"], w, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(result.params["b"], b, rtol=2e-5, atol=1e-6)
    for entry, want in zip(result.history, losses, strict=True):
        np.testing.assert_allclose(entry["worker_loss"], want, rtol=2e-5)


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
    assert two.state.parts["delay"].weights.tolist() == [1.0, 1.0, 0.0, 1.0]
    # With fragments a weight per worker and fragment: worker 2 is NaN at fragment 0's sync
    # (step 2) and restarts from θ there, so it is finite again at fragment 1's (step 4).
    rounds = make_data(np.random.default_rng(4), 2, M, 4)
    rounds[1]["x"][2, 0, 0, 0] = np.nan
    two = _train(
        rounds, outer_delay=1, exclude_nonfinite=True, compression="int8,ef=1", fragments=2
    )
    assert two.state.parts["delay"].weights.tolist() == [[1, 1], [1, 1], [0, 1], [1, 1]]
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(two.params))


def test_the_delayed_exchange_does_not_wait_for_the_inner_loop():
    """In the compiled delayed round, no collective reads the inner scan's result: XLA's
    asynchronous collectives may run the exchange under the scan (on GPU/TPU)."""
    params = {"w": jnp.zeros(64), "b": jnp.float32(0)}
    # 8 steps: with 2 fragments and overlap 1 every segment but the 1-step ones is a loop.
    batch = {"x": jnp.ones((4, 8, 2, 64)), "y": jnp.ones((4, 8, 2))}

    def exchanges_wait_for_the_loop(overlap_steps=0, **options):
        state = dj.init_state(params, 4, inner_optimizer=INNER, outer_optimizer=OUTER, **options)
        round_fn = functools.partial(
            dj.diloco_round, linear_loss, inner_optimizer=INNER, outer_optimizer=OUTER,
            backend=dj.make_backend("shard_map", 4), overlap_steps=overlap_steps, **options,
        )  # fmt: skip
        text = jax.jit(round_fn).lower(state, batch).compile().as_text()
        exchanges = [c for c in hlo.collectives(text) if c.operand_bytes >= 64 * 4]
        assert exchanges
        return [hlo.depends_on(text, c.name, "while") for c in exchanges]

    for options in (
        dict(outer_delay=1),
        dict(outer_delay=2, eager=True),
        dict(outer_delay=1, fragments=2, overlap_steps=1),
        dict(outer_delay=2, eager=True, fragments=2),
    ):
        assert not any(exchanges_wait_for_the_loop(**options)), options
    # Without a delay the exchange reads the scan's result: the check can fail.
    assert all(exchanges_wait_for_the_loop())
    assert all(exchanges_wait_for_the_loop(fragments=2, overlap_steps=1))


@pytest.mark.parametrize(
    "eager, streaming", [(False, {}), (True, {}), (True, dict(fragments=2, merge_alpha=0.5))]
)
def test_resume_carries_what_is_in_flight(eager, streaming, tmp_path):
    rounds = make_data(np.random.default_rng(5), R, M, 4)
    options = dict(outer_delay=2, eager=eager, exclude_nonfinite=False, **streaming)
    full = _train(rounds, **options)
    _train(rounds[:2], checkpoint_dir=tmp_path, **options)
    resumed = _train(rounds, checkpoint_dir=tmp_path, **options)
    jax.tree.map(np.testing.assert_array_equal, resumed.params, full.params)
    jax.tree.map(np.testing.assert_array_equal, resumed.state, full.state)
    with pytest.raises(ValueError, match="parts.delay.deltas"):  # another delay: another run
        _train(rounds, checkpoint_dir=tmp_path, exclude_nonfinite=False, **streaming)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(outer_delay=-1), r"Delayed.rounds \(outer_delay\) must be an integer >= 1"),
        (dict(outer_delay=3), r"Delayed.rounds \(outer_delay\) must be at most 2"),
        (dict(outer_delay=True), r"Delayed.rounds \(outer_delay\) must be an integer"),
        (dict(eager=True), r"Eager.rounds \(outer_delay\) must be >= 1"),
        (dict(outer_delay=1, eager=1), "eager must be a bool"),
        (dict(outer_delay=1, eager=True, exclude_nonfinite=True), "Eager can't be combined"),
        (dict(outer_delay=1, eager=True, worker_steps=(2, 1), weighting="steps"), "weigh it"),
        (dict(outer_delay=1, eager=True, drop_probability=0.1), "Eager can't be combined"),
    ],
)
def test_bad_delay_options(options, match):
    rounds = make_data(np.random.default_rng(6), 1, 2, 2)
    with pytest.raises(ValueError, match=match):
        _train(rounds, **options)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(outer_delay=1, eager=True), r"another method.*\"parts\['workers'\]\"\]"),
        (dict(outer_delay=1, fragments=2), r"another method.*\['params', 'outer_opt_state'"),
        (dict(outer_delay=2, eager=True, fragments=2), r"another method.*parts\['delay'\]"),
    ],
)
def test_a_state_built_for_eager_updates_over_fragments_runs_only_so(options, match):
    state = dj.init_state(
        PARAMS,
        2,
        inner_optimizer=INNER,
        outer_optimizer=OUTER,
        fragments=2,
        outer_delay=1,
        eager=True,
    )
    batch = make_data(np.random.default_rng(10), 1, 2, 4)[0]
    with pytest.raises(ValueError, match=match):
        dj.diloco_round(
            linear_loss, state, batch, inner_optimizer=INNER, outer_optimizer=OUTER, **options
        )

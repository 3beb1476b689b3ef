"""CGAD (`dj.cgad`) and Adam-Decay (`dj.adam_decay`): Adam on pseudo-gradients scaled by
their age's gate. The gate by hand, Adam at age 0, the ages `train_async` (its jobs'
staleness) and the delay part (d) hand it, each against a float64 NumPy reference."""

import math

import numpy as np
import optax
import pytest
from reference import linear_loss, make_data, precision
from test_async import HAND_SCHEDULE, PARAMS, make_rounds

import diloco_jax as dj
from diloco_jax.cgad_outer import age_gate, scale_by_age_gate

LR, DECAY, CUTOFF = 0.05, 0.3, 4.0


def _np_gate(age, decay, cutoff):
    window = (
        1.0
        if cutoff is None
        else (0.5 * (1 + math.cos(math.pi * age / cutoff)) if age < cutoff else 0.0)
    )
    return window * math.exp(-decay * age)


@pytest.mark.parametrize(
    ("age", "cutoff", "want"),
    [
        (0, 4.0, 1.0),
        (1, 4.0, math.exp(-0.3) * (1 + math.cos(math.pi / 4)) / 2),
        (2, 4.0, math.exp(-0.6) * 0.5),
        (4, 4.0, 0.0),
        (9, 4.0, 0.0),
        (3, None, math.exp(-0.9)),  # Adam-Decay: no cutoff
    ],
)
def test_the_gate_by_hand(age, cutoff, want):
    np.testing.assert_allclose(float(age_gate(age, 0.3, cutoff)), want, rtol=1e-6, atol=1e-7)


def test_cgad_at_age_zero_is_adam_bit_for_bit():
    params = {"w": np.asarray([0.3, -0.2], np.float32)}
    gate, adam = dj.cgad(LR, DECAY, CUTOFF), optax.adam(LR)
    s_gate, s_adam = gate.init(params), adam.init(params)
    rng = np.random.default_rng(0)
    for step in range(4):
        g = {"w": rng.normal(size=2).astype(np.float32)}
        # With age=0 given, and without it (an update without an age is at age 0).
        u_gate, s_gate = gate.update(g, s_gate, params, **({"age": 0} if step % 2 else {}))
        u_adam, s_adam = adam.update(g, s_adam, params)
        np.testing.assert_array_equal(u_gate["w"], u_adam["w"])


def _np_gated_adam(g, state, t, age, cutoff):
    """One float64 step of Adam (lr LR, b1 0.9, b2 0.999, eps 1e-8) on σ(age) g."""
    m, v = state
    g = _np_gate(age, DECAY, cutoff) * g
    m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
    step = -LR * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
    return step, (m, v)


@pytest.mark.parametrize("cutoff", [CUTOFF, None])
def test_train_async_gates_each_delta_by_its_jobs_staleness(cutoff):
    """The hand schedule of test_async (staleness 0, 0, 2, 0, 4, 0, 3, ...): the server's
    outer step is Adam on σ(staleness) x the arriving delta; the delta at staleness 4 enters
    CGAD's moments as zero."""
    rounds = [{k: v.astype(np.float64) for k, v in r.items()} for r in make_rounds(6, 3, 2)]
    outer = dj.cgad(LR, DECAY, cutoff) if cutoff else dj.adam_decay(LR, DECAY)
    with precision("float64"):
        result = dj.train_async(
            linear_loss, {k: np.float64(v) for k, v in PARAMS.items()}, rounds, num_workers=3,
            inner_steps=2, num_updates=len(HAND_SCHEDULE), step_seconds=(1.0, 2.0, 3.0),
            inner_optimizer=optax.sgd(0.1, momentum=0.5), outer_optimizer=outer,
        )  # fmt: skip
    flat = lambda p: np.append(np.asarray(p["w"], np.float64), np.float64(p["b"]))  # noqa: E731
    thetas = [flat(PARAMS)]
    traces = [np.zeros(4) for _ in range(3)]
    adam = (np.zeros(4), np.zeros(4))
    for t, (m, job, start_update, _, staleness) in enumerate(HAND_SCHEDULE, start=1):
        start = thetas[start_update]
        theta, trace = start.copy(), traces[m]
        for h in range(2):
            x = rounds[job]["x"][m, h].astype(np.float64)
            y = rounds[job]["y"][m, h].astype(np.float64)
            err = x @ theta[:3] + theta[3] - y
            trace = np.append(x.T @ err / len(y), err.mean()) + 0.5 * trace
            theta = theta - 0.1 * trace
        traces[m] = trace
        step, adam = _np_gated_adam(start - theta, adam, t, staleness, cutoff)
        thetas.append(thetas[-1] + step)
    assert [h["staleness"] for h in result.history] == [e[4] for e in HAND_SCHEDULE]
    np.testing.assert_allclose(flat(result.params), thetas[-1], rtol=0, atol=1e-12)


def test_a_delayed_mean_is_gated_at_age_d():
    """Delayed(1): round t applies round t - 1's mean at age 1 (round 0 a zero mean)."""
    rounds = make_data(np.random.default_rng(1), 4, 2, 3)
    params = {"w": np.asarray([0.3, -0.2, 0.1], np.float32), "b": np.float32(0.5)}
    method = dj.DiLoCo(inner=optax.sgd(0.05), outer=dj.cgad(LR, DECAY, CUTOFF), delay=dj.Delayed(1))
    got = dj.train_diloco(linear_loss, params, rounds, num_rounds=4, num_workers=2,
                          inner_steps=3, method=method, backend="vmap")  # fmt: skip
    theta = np.append(params["w"].astype(np.float64), np.float64(params["b"]))
    adam, pending = (np.zeros(4), np.zeros(4)), np.zeros(4)
    for t, batch in enumerate(rounds, start=1):
        deltas = []
        for m in range(2):
            w = theta.copy()
            for h in range(3):
                x, y = batch["x"][m, h].astype(np.float64), batch["y"][m, h].astype(np.float64)
                err = x @ w[:3] + w[3] - y
                w = w - 0.05 * np.append(x.T @ err / len(y), err.mean())
            deltas.append(theta - w)
        step, adam = _np_gated_adam(pending, adam, t, 1, CUTOFF)
        pending = np.mean(deltas, axis=0)
        theta = theta + step
    np.testing.assert_allclose(got.params["w"], theta[:3], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.params["b"], theta[3], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("delay", [dj.Delayed(1), dj.Eager(1)])
def test_a_cutoff_below_the_delay_gates_every_mean_out(delay):
    """Age 1 >= cutoff 0.5: every mean enters Adam as zero, so θ never moves (under eager
    updates every worker's own θ_m stays where it started)."""
    rounds = make_data(np.random.default_rng(2), 3, 2, 2)
    params = {"w": np.asarray([0.3, -0.2, 0.1], np.float32), "b": np.float32(0.5)}
    method = dj.DiLoCo(inner=optax.sgd(0.05), outer=dj.cgad(LR, DECAY, 0.5), delay=delay)
    got = dj.train_diloco(linear_loss, params, rounds, num_rounds=3, num_workers=2,
                          inner_steps=2, method=method, backend="vmap")  # fmt: skip
    np.testing.assert_array_equal(got.params["w"], params["w"])
    np.testing.assert_array_equal(got.params["b"], params["b"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (dict(decay=-0.1), "decay must be a finite number >= 0"),
        (dict(decay=float("inf")), "decay must be a finite number >= 0"),
        (dict(decay=0.1, cutoff=0), "cutoff must be a finite number > 0"),
        (dict(decay=0.1, cutoff=-2.0), "cutoff must be a finite number > 0"),
        (dict(decay=True), "decay must be a finite number >= 0"),
    ],
)
def test_bad_hyperparameters_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        scale_by_age_gate(**args)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (dict(learning_rate=0.0), "learning_rate must be a finite number > 0"),
        (dict(b1=1.0), r"b1 must be a finite number in \[0, 1\)"),
        (dict(b2=-0.1), r"b2 must be a finite number in \[0, 1\)"),
        (dict(eps=0.0), "eps must be a finite number > 0"),
        (dict(cutoff=float("nan")), "cutoff must be a finite number > 0"),
    ],
)
def test_bad_adam_arguments_are_refused(args, message):
    full = dict(learning_rate=LR, decay=DECAY, cutoff=CUTOFF) | args
    with pytest.raises(ValueError, match=message):
        dj.cgad(**full)
    if "cutoff" not in args:
        with pytest.raises(ValueError, match=message):
            dj.adam_decay(**{k: v for k, v in full.items() if k != "cutoff"})


@pytest.mark.parametrize("name, cutoff", [("cgad", CUTOFF), ("adam_decay", None)])
def test_the_lm_apps_outer_optimizer_is_gated_adam_with_its_b2(name, cutoff):
    """`--outer-optimizer cgad|adam_decay --age-decay D [--age-cutoff C]`: the app's Adam (b1
    0.9, b2 0.95, eps 1e-8) on σ(age) Δ, against float64 NumPy over ages 0, 1, 3, 2."""
    from diloco_jax.lm.config import make_config, outer_optimizer

    cfg = make_config(
        "micro", outer_optimizer=name, outer_lr=LR, age_decay=DECAY, age_cutoff=cutoff
    )
    opt = outer_optimizer(cfg)
    params = {"w": np.zeros(3, np.float32)}
    state = opt.init(params)
    m = v = np.zeros(3)
    rng = np.random.default_rng(1)
    for t, age in enumerate([0, 1, 3, 2], start=1):
        g = rng.normal(size=3).astype(np.float32)
        update, state = opt.update({"w": g}, state, params, age=age)
        gated = _np_gate(age, DECAY, cutoff) * g.astype(np.float64)
        m, v = 0.9 * m + 0.1 * gated, 0.95 * v + 0.05 * gated * gated
        want = -LR * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.95**t)) + 1e-8)
        np.testing.assert_allclose(update["w"], want, rtol=2e-5, atol=1e-8)

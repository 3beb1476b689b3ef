"""HeLoCo (`dj.heloco`): its tensor-block correction and momentum look-ahead step against a
float64 NumPy reference written from the rule (the authors' torchft fork), each branch hit;
train_async starting every job from θ̄ against a NumPy run of the same arrivals; the
degenerate case (momentum 0, no correction: SGD on each arriving delta); the async elastic
syncer handing out θ̄; and the refusals."""

import numpy as np
import optax
import pytest
from elastic_linear import PARAMS, make_async_task
from reference import linear_grads, linear_loss, precision

import diloco_jax as dj
from diloco_jax.elastic_task import Elastic, ElasticTask

DEFAULTS = dict(rho=1.0, c_ok=0.2, k_s=0.5, k_d=1.0, kappa=3.0, beta_max=0.5, eps=1e-8)
RULE = {**DEFAULTS, "rho": 0.8}


def np_correct(d, m, rho, c_ok, k_s, k_d, kappa, beta_max, eps):
    """One block's corrected delta, and which case it took."""
    nd, nm = np.linalg.norm(d), np.linalg.norm(m)
    if nd < eps or nm < eps:
        return rho * d, "kept"
    cos = float(d.ravel() @ m.ravel()) / (max(nd, eps) * max(nm, eps))
    conf = nd / (nd + kappa * nm + eps)
    if cos >= c_ok:
        return rho * d, "kept"
    v = m / nm
    if cos < 0:
        beta = min(k_s * -cos * conf, beta_max)
        return rho * (d - beta * cos * nd * v), "shrunk"
    lam = min(k_d * (1 - cos) * conf, 1.0)
    mix = (1 - lam) * d / nd + lam * v
    return rho * nd * mix / np.linalg.norm(mix), "turned"


def np_step(theta, m, deltas, lr, mu, correction=True, rule=RULE):
    """HeLoCo's outer step on one arriving delta (dicts of float64 leaves)."""
    cases = {}
    for k in theta:
        if correction:
            g, cases[k] = np_correct(deltas[k], m[k], **rule)
        else:
            g, cases[k] = rule["rho"] * deltas[k], "off"
        m[k] = mu * m[k] + (1 - mu) * g
        theta[k] = theta[k] - lr * (g + mu * m[k])
    return cases


def test_the_correction_and_step_equal_a_numpy_reference_in_every_case():
    rng = np.random.default_rng(0)
    theta = {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=5)}
    m = {k: np.zeros_like(v) for k, v in theta.items()}
    base = {k: rng.normal(size=v.shape) for k, v in theta.items()}
    arrivals = [  # momentum 0 (kept), aligned, opposed, nearly orthogonal
        base,
        {k: 0.5 * v + 0.1 * rng.normal(size=v.shape) for k, v in base.items()},
        {k: -v for k, v in base.items()},
    ]
    orth = {}
    for k, v in base.items():  # a delta at cosine 0.1 with the momentum then
        r = rng.normal(size=v.shape)
        r -= (r.ravel() @ v.ravel()) / (v.ravel() @ v.ravel()) * v
        orth[k] = 0.1 * v / np.linalg.norm(v) + np.sqrt(0.99) * r / np.linalg.norm(r)
    arrivals.append(orth)
    with precision("float64"):
        tx = dj.heloco(0.7, momentum=0.9, **RULE)
        state = tx.init(theta)
        got = dict(theta)
        ref_theta, seen = {k: v.copy() for k, v in theta.items()}, []
        for delta in arrivals:
            updates, state = tx.update(delta, state)
            got = optax.apply_updates(got, updates)
            seen.append(set(np_step(ref_theta, m, delta, 0.7, 0.9).values()))
            for k in theta:
                np.testing.assert_allclose(got[k], ref_theta[k], rtol=1e-12, atol=1e-14)
                np.testing.assert_allclose(state.momentum[k], m[k], rtol=1e-12, atol=1e-14)
        start = tx.lookahead(got, state)
        for k in theta:
            np.testing.assert_allclose(start[k], ref_theta[k] - 0.7 * 0.9 * m[k], rtol=1e-12)
    assert seen[:2] == [{"kept"}, {"kept"}]
    assert "shrunk" in seen[2] and "turned" in seen[3]


def _np_async(events, rounds, lr, mu, inner_lr, correction, lookahead):
    """train_async's arrivals in NumPy: each job starts from θ̄ (or θ) after its start
    update, runs its SGD steps on linear_loss, and its delta takes HeLoCo's step."""
    theta = {"w": PARAMS["w"].astype(np.float64), "b": np.float64(PARAMS["b"])}
    m = {k: np.zeros_like(v) for k, v in theta.items()}
    starts = {}

    def start_now():
        return {k: theta[k] - (lr * mu * m[k] if lookahead else 0) for k in theta}

    starts[0] = start_now()
    for e in events:
        start = starts[e.start_update]
        w, b = start["w"].copy(), start["b"]
        x, y = rounds[e.job]["x"][e.worker], rounds[e.job]["y"][e.worker]
        for h in range(e.steps):
            gw, gb, _ = linear_grads(w, b, x[h].astype(np.float64), y[h].astype(np.float64))
            w, b = w - inner_lr * gw, b - inner_lr * gb
        delta = {"w": start["w"] - w, "b": start["b"] - b}
        np_step(theta, m, delta, lr, mu, correction, rule=DEFAULTS)
        starts[e.update + 1] = start_now()
    return theta


@pytest.mark.parametrize("correction, lookahead", [(True, True), (False, False)])
def test_train_async_starts_each_job_from_the_lookahead_as_a_numpy_run(correction, lookahead):
    rng = np.random.default_rng(1)
    h, m_count, updates = 3, 2, 8
    rounds = [
        {"x": rng.normal(size=(m_count, h, 4, 3)), "y": rng.normal(size=(m_count, h, 4))}
        for _ in range(updates)
    ]
    events = dj.async_schedule([1.0, 1.7], h, updates).events
    with precision("float64"):
        result = dj.train_async(
            linear_loss, {k: np.float64(v) for k, v in PARAMS.items()}, rounds,
            num_workers=m_count, inner_steps=h, num_updates=updates, arrivals=events,
            inner_optimizer=optax.sgd(0.1),
            outer_optimizer=dj.heloco(0.7, 0.9, correction=correction, lookahead=lookahead),
        )  # fmt: skip
    want = _np_async(events, rounds, 0.7, 0.9, 0.1, correction, lookahead)
    assert any(e.staleness for e in events)
    for k in ("w", "b"):
        np.testing.assert_allclose(result.params[k], want[k], rtol=1e-12)


def test_momentum_0_without_correction_is_sgd_on_each_arriving_delta():
    rng = np.random.default_rng(2)
    rounds = [{"x": rng.normal(size=(2, 3, 4, 3)), "y": rng.normal(size=(2, 3, 4))}
              for _ in range(6)]  # fmt: skip
    run = dict(num_workers=2, inner_steps=3, num_updates=6, step_seconds=[1.0, 1.3],
               inner_optimizer=optax.adam(0.05))  # fmt: skip
    with precision("float64"):
        params = {k: np.float64(v) for k, v in PARAMS.items()}
        plain = dj.train_async(linear_loss, params, rounds, outer_optimizer=optax.sgd(0.7), **run)
        he_outer = dj.heloco(0.7, momentum=0.0, correction=False)
        he = dj.train_async(linear_loss, params, rounds, outer_optimizer=he_outer, **run)
    for k in ("w", "b"):
        np.testing.assert_allclose(he.params[k], plain.params[k], rtol=1e-13)


def test_the_async_elastic_syncer_hands_out_the_lookahead(tmp_path):
    import dataclasses

    from diloco_jax.arrival_syncer import ArrivalSyncer

    task = make_async_task()
    method = dataclasses.replace(task.method, outer=dj.heloco(0.7, momentum=0.9))
    task = dataclasses.replace(task, num_workers=2, method=method)
    s = ArrivalSyncer(task, Elastic(heartbeat_interval=0.05, heartbeat_timeout=30.0), tmp_path)
    inc = [s.join(m, None)["incarnation"] for m in range(2)]
    job = s.next_round(0, inc[0], -1, 0.1)
    np.testing.assert_array_equal(job["theta"][1], PARAMS["w"])  # momentum 0: θ̄ = θ
    delta = [np.float32(0.1), np.full(3, 0.2, np.float32)]  # leaves of {"b", "w"}
    assert s.push(0, inc[0], job["serial"], delta, 0.0)["status"] == "ok"
    theta = {"b": 0.5 - 0.7 * (0.1 + 0.9 * 0.01), "w": PARAMS["w"] - 0.7 * (0.2 + 0.9 * 0.02)}
    np.testing.assert_allclose(s.theta["w"], theta["w"], rtol=1e-6)
    nxt = s.next_round(1, inc[1], -1, 0.1)
    np.testing.assert_allclose(nxt["theta"][1], theta["w"] - 0.7 * 0.9 * 0.02, rtol=1e-6)
    np.testing.assert_allclose(nxt["theta"][0], theta["b"] - 0.7 * 0.9 * 0.01, rtol=1e-6)


def test_where_the_lookahead_would_be_dropped_it_is_refused():
    he = dj.heloco(0.7)
    with pytest.raises(ValueError, match="train_diloco: the outer rule starts jobs from a look"):
        dj.train_diloco(linear_loss, PARAMS, [], num_rounds=1, num_workers=1, inner_steps=1,
                        outer_optimizer=he)  # fmt: skip
    with pytest.raises(ValueError, match="HeLoCo's look-ahead\\) runs with train_async's one"):
        dj.train_async(linear_loss, PARAMS, [], num_workers=2, inner_steps=2, num_updates=1,
                       step_seconds=[1.0, 1.0], outer_optimizer=he,
                       server=dj.HALoS(regions=(0, 1), local_updates=1))  # fmt: skip
    task = make_async_task()
    with pytest.raises(ValueError, match="algo='async' does"):
        ElasticTask(task.loss_fn, task.params, task.batches, 2, task.inner_steps, 2,
                    dj.DiLoCo(outer=he))  # fmt: skip
    # Without the look-ahead, the compiled round takes it (correction and step only).
    dj.DiLoCo(outer=dj.heloco(0.7, lookahead=False))
    for name, value in (("learning_rate", 0), ("momentum", 1.0), ("rho", -1), ("c_ok", 2),
                        ("beta_max", 1.5), ("eps", 0), ("kappa", float("nan"))):  # fmt: skip
        with pytest.raises(ValueError, match=f"heloco's {name} must be a finite number"):
            dj.heloco(**{"learning_rate": 0.7, name: value})

"""GASLoC (`DiLoCo(gossip=GASLoC(...))`): each worker's outer step to y_m, then a pull toward
its random group's mean of y and momentum on y. Checked against a float64 NumPy reference
written from the paper's rule, its degenerate case (one group of all workers, α = 1, γ = 0:
DiLoCo), the bytes its compiled round sends, a resumed run, and its refusals."""

import jax
import numpy as np
import optax
import pytest
from reference import NpAdamWorkers, linear_loss, make_data, precision

import diloco_jax as dj
from diloco_jax import GASLoC, hlo
from diloco_jax.noloco import groups

INNER_LR, OUTER_LR = 0.05, 0.7


def _np_gasloc(w0, b0, rounds, group_size, alpha, gamma, seed):
    """float64 GASLoC: each worker's own θ_m, Adam inner steps whose state persists, and at
    each sync y_m = θ_m + η g_m (g_m = its params - θ_m), θ_m = y_m - α (y_m - mean_G y) +
    γ (y_m - y_m of the sync before; 0 at the first). Returns each worker's θ [M, 3], [M]."""
    num_workers = rounds[0]["x"].shape[0]
    theta = np.tile(np.append(np.float64(w0), np.float64(b0)), (num_workers, 1))
    previous = None
    inner = NpAdamWorkers(num_workers, INNER_LR)
    for r, batch in enumerate(rounds):
        local = inner.run(theta, batch["x"].astype(np.float64), batch["y"].astype(np.float64))
        ys = theta + OUTER_LR * (local - theta)
        new = np.empty_like(theta)
        for group in groups(seed, r, num_workers, group_size):
            mean = ys[group].mean(axis=0)
            for m in group:
                momentum = 0.0 if previous is None else ys[m] - previous[m]
                new[m] = ys[m] - alpha * (ys[m] - mean) + gamma * momentum
        theta, previous = new, ys
    return theta[:, :3], theta[:, 3]


def _method(**gasloc):
    return dj.DiLoCo(inner=optax.adam(INNER_LR), outer=optax.sgd(OUTER_LR),
                     gossip=GASLoC(**gasloc))  # fmt: skip


def _params(dtype=np.float32):
    return {"w": np.asarray([0.3, -0.2, 0.1], dtype), "b": dtype(0.5)}


def _train(rounds, method, dtype=np.float32, **options):
    return dj.train_diloco(
        linear_loss, _params(dtype), rounds, num_rounds=len(rounds),
        num_workers=rounds[0]["x"].shape[0], inner_steps=rounds[0]["x"].shape[1],
        method=method, **options,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("num_workers", "group_size", "alpha", "gamma"),
    [(4, 2, 1.0, 0.0), (8, 2, 0.6, 0.4), (8, 4, 0.8, 0.5)],
)
def test_float64_gasloc_is_the_numpy_reference(num_workers, group_size, alpha, gamma):
    rounds = make_data(np.random.default_rng(1), 4, num_workers, 3)
    rounds = [{k: v.astype(np.float64) for k, v in r.items()} for r in rounds]
    w, b = _np_gasloc([0.3, -0.2, 0.1], 0.5, rounds, group_size, alpha, gamma, seed=7)
    method = _method(group_size=group_size, alpha=alpha, gamma=gamma, seed=7)
    with precision("float64"):
        got = _train(rounds, method, np.float64, backend="vmap")
        own = got.state.parts["gasloc"].theta
        np.testing.assert_allclose(np.asarray(own["w"]), w, rtol=0, atol=1e-12)
        np.testing.assert_allclose(np.asarray(own["b"]), b, rtol=0, atol=1e-12)
        np.testing.assert_allclose(np.asarray(got.params["w"]), w.mean(0), rtol=0, atol=1e-12)
        assert got.state.params is None
    assert np.ptp(b) > 1e-4  # the workers disagree: no all-reduce


def test_float32_gasloc_is_the_reference_over_devices():
    """Eight workers, two on each of 4 devices: partners on the same device and on others."""
    rounds = make_data(np.random.default_rng(2), 3, 8, 3)
    w, b = _np_gasloc([0.3, -0.2, 0.1], 0.5, rounds, 2, 0.7, 0.3, seed=1)
    backend = dj.make_backend("shard_map", 8, jax.devices()[:4])
    got = _train(rounds, _method(alpha=0.7, gamma=0.3, seed=1), backend=backend)
    own = got.state.parts["gasloc"].theta
    np.testing.assert_allclose(np.asarray(own["w"]), w, rtol=0, atol=3e-5)
    np.testing.assert_allclose(np.asarray(own["b"]), b, rtol=0, atol=3e-5)


@pytest.mark.parametrize("outer", ["sgd", "nesterov"])
def test_one_group_without_momentum_is_diloco_with_the_same_outer_rule(outer):
    """A complete graph, α = 1, γ = 0: every θ_m stays DiLoCo's θ (the mean of the y_m is the
    step on the mean Δ for a rule linear in Δ)."""
    rounds = make_data(np.random.default_rng(4), 3, 4, 3)
    rounds = [{k: v.astype(np.float64) for k, v in r.items()} for r in rounds]
    rule = {"sgd": optax.sgd(OUTER_LR), "nesterov": optax.sgd(OUTER_LR, 0.9, nesterov=True)}
    with precision("float64"):
        method = dj.DiLoCo(inner=optax.adam(INNER_LR), outer=rule[outer],
                           gossip=GASLoC(group_size=4, alpha=1.0, gamma=0.0))  # fmt: skip
        gasloc = _train(rounds, method, np.float64, backend="vmap")
        diloco = _train(rounds, dj.DiLoCo(inner=optax.adam(INNER_LR), outer=rule[outer]),
                        np.float64, backend="vmap")  # fmt: skip
        for name in ("w", "b"):
            own = np.asarray(gasloc.state.parts["gasloc"].theta[name])
            for m in range(4):
                np.testing.assert_allclose(own[m], diloco.params[name], rtol=0, atol=1e-12)


def test_the_bytes_a_sync_sends_are_y_once_a_stage():
    """Pairs of 8 workers, two a device: the compiled round's one collective-permute moves
    each worker's y in float32 (half what NoLoCo moves, Δ and φ); the only all-reduce is the
    round's two float32 metrics. `transfers` prices the same bytes."""
    backend = dj.make_backend("shard_map", 8, jax.devices()[:4])
    params = {"w": np.zeros(64, np.float32), "b": np.float32(0)}
    method = _method()
    state = dj.init_state(params, 8, method)
    batch = make_data(np.random.default_rng(0), 1, 8, 2, dim=64)[0]
    text = dj.jit_round(linear_loss, method, backend=backend).lower(state, batch).compile()
    text = text.as_text()
    reduced = [c for c in hlo.collectives(text) if c.op != "collective-permute"]
    assert [(c.op, c.operand_bytes) for c in reduced] == [("all-reduce", 8)]
    per_worker = (64 + 1) * 4  # y, one stage
    assert hlo.wire_bytes(text) == 2 * per_worker + 2 * 3 / 4 * 8
    entries = method.gossip.transfers([np.zeros(64, np.float32), np.zeros((), np.float32)])
    assert dj.comm.wire_bytes(entries, 8) == per_worker
    noloco = dj.NoLoCo().transfers([np.zeros(64, np.float32), np.zeros((), np.float32)])
    assert dj.comm.wire_bytes(noloco, 8) == 2 * per_worker


def test_a_resumed_gasloc_run_is_the_uninterrupted_one(tmp_path):
    """The momentum's y of the sync before is in the checkpoint: resumed after 2 of 4 rounds,
    bit for bit the run in one go."""
    rounds = make_data(np.random.default_rng(6), 4, 4, 2)
    method = _method(alpha=0.5, gamma=0.5, seed=9)
    whole = _train(rounds, method, backend="vmap")
    _train(rounds[:2], method, backend="vmap", checkpoint_dir=tmp_path, checkpoint_every=1)
    resumed = _train(rounds, method, backend="vmap", checkpoint_dir=tmp_path,
                     checkpoint_every=1)  # fmt: skip
    for a, b in zip(jax.tree.leaves(resumed.state.parts["gasloc"]),
                    jax.tree.leaves(whole.state.parts["gasloc"]), strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"group_size": 3}, "GASLoC.group_size must be a power of 2 >= 2, got 3"),
        ({"alpha": 1.5}, "GASLoC.alpha must be"),
        ({"gamma": 1.0}, "GASLoC.gamma must be"),
        ({"gamma": float("nan")}, "GASLoC.gamma must be"),
        ({"seed": -1}, r"GASLoC.seed must be an integer in \[0, 2\*\*32\), got -1"),
    ],
)
def test_bad_fields_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        GASLoC(**fields)


def test_what_it_cannot_run_with_is_refused():
    with pytest.raises(ValueError, match=r"GASLoC \(gossip=\) can't be combined with compression"):
        dj.DiLoCo(gossip=GASLoC(), compression="int8")
    rounds = make_data(np.random.default_rng(7), 1, 6, 2)
    with pytest.raises(ValueError, match="GASLoC needs num_workers a power of 2"):
        _train(rounds, _method(), backend="vmap")
    assert dj.DiLoCo(gossip=GASLoC()).outer is None  # its default rule: SGD
    state = dj.DiLoCo(gossip=GASLoC()).outer_optimizer.init({"w": np.zeros(2, np.float32)})
    assert "Trace" not in str(state)  # no momentum: plain SGD


def test_the_shorthand_and_the_lm_config_build_gasloc():
    from diloco_jax.lm.config import make_config, method
    from diloco_jax.method import method_from_options

    spec = method_from_options(None, {"gasloc": {"alpha": 0.5}}, caller="t")
    assert spec.gossip == GASLoC(group_size=2, alpha=0.5)
    spec = method_from_options(None, {"gasloc": {}, "gossip_group_size": 4}, caller="t")
    assert spec.gossip == GASLoC(group_size=4)
    cfg = make_config("micro", workers=4, gasloc="alpha=0.5,gamma=0.25", seed=3)
    assert method(cfg).gossip == GASLoC(group_size=2, alpha=0.5, gamma=0.25, seed=3)
    assert method(make_config("micro", gossip_group_size=2)).gossip == dj.NoLoCo(2)

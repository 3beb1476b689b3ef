"""train_diloco / train_sync / diloco_round against hand arithmetic and NumPy references."""

import time
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from quick import quick
from reference import diloco_sgd, linear_loss, make_data

import diloco_jax as dj
from diloco_jax.workers import one_device_backend

NESTEROV = dict(momentum=0.9, nesterov=True)


def scalar_loss(params, batch):
    return 0.5 * jnp.mean((params * batch["x"] - batch["y"]) ** 2)


def test_one_and_two_rounds_by_hand():
    # Scalar model w, loss 0.5 (w x - y)^2, SGD(0.1) inner, Nesterov SGD(0.7, 0.9) outer,
    # M=2, H=2, every step of worker 0 sees (x=1, y=1), of worker 1 sees (x=2, y=2).
    x = np.array([[1.0, 1.0], [2.0, 2.0]], np.float32)[..., None]  # [M, H, B=1]
    batch = {"x": x, "y": x.copy()}
    # Round 0 from w=0. Worker 0: grad (w-1): w 0 -> 0.1 -> 0.19, losses 0.5, 0.405.
    # Worker 1: grad 2(2w-2): w 0 -> 0.4 -> 0.64, losses 2, 0.72.
    # Δ = mean(0 - 0.19, 0 - 0.64) = -0.415; trace = -0.415;
    # w1 = 0 - 0.7 (Δ + 0.9 trace) = 0.7 * 0.7885 = 0.55195.
    w1 = 0.7 * (0.415 + 0.9 * 0.415)
    # Round 1 from w1. Worker 0: w -> w1 + 0.1 (1 - w1) -> ... ; worker 1 likewise with 0.4.
    a1 = w1 + 0.1 * (1 - w1)
    a2 = a1 + 0.1 * (1 - a1)
    c1 = w1 + 0.4 * (1 - w1)
    c2 = c1 + 0.4 * (1 - c1)
    delta = ((w1 - a2) + (w1 - c2)) / 2
    trace = delta + 0.9 * -0.415
    w2 = w1 - 0.7 * (delta + 0.9 * trace)

    result = dj.train_diloco(
        scalar_loss,
        jnp.float32(0.0),
        [batch, batch],
        num_rounds=2,
        num_workers=2,
        inner_steps=2,
        backend="vmap",
        inner_optimizer=optax.sgd(0.1),
        outer_optimizer=optax.sgd(0.7, **NESTEROV),
    )
    h0, h1 = result.history
    np.testing.assert_allclose(w1, 0.55195, rtol=1e-12)
    np.testing.assert_allclose(h0["worker_loss"], [(0.5 + 0.405) / 2, (2 + 0.72) / 2], rtol=1e-6)
    np.testing.assert_allclose(h0["loss"], (0.4525 + 1.36) / 2, rtol=1e-6)
    np.testing.assert_allclose(h0["outer_grad_norm"], 0.415, rtol=1e-6)
    h1_worker0 = (0.5 * (w1 - 1) ** 2 + 0.5 * (a1 - 1) ** 2) / 2
    np.testing.assert_allclose(h1["worker_loss"][0], h1_worker0, rtol=1e-5)
    np.testing.assert_allclose(h1["outer_grad_norm"], abs(delta), rtol=1e-5)
    np.testing.assert_allclose(result.params, w2, rtol=1e-6)
    assert [h["round"] for h in result.history] == [0, 1]
    assert [h["steps"] for h in result.history] == [2, 4]
    assert [h["bytes_communicated"] for h in result.history] == [4, 8]
    assert int(result.state.round) == 2


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_numpy_reference(nesterov):
    rng = np.random.default_rng(1)
    data = make_data(rng, num_rounds=3, num_workers=4, inner_steps=3)
    params = {"w": np.asarray([0.3, -0.2, 0.1], np.float32), "b": np.float32(0.5)}
    result = dj.train_diloco(
        linear_loss,
        params,
        data,
        num_rounds=3,
        num_workers=4,
        inner_steps=3,
        backend="vmap",
        inner_optimizer=optax.sgd(0.05),
        outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=nesterov),
    )
    w, b, losses = diloco_sgd(params["w"], params["b"], data, 0.05, 0.7, 0.9, nesterov)
    np.testing.assert_allclose(result.params["w"], w, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(result.params["b"], b, rtol=2e-5, atol=1e-6)
    for h, ref in zip(result.history, losses, strict=True):
        np.testing.assert_allclose(h["worker_loss"], ref, rtol=1e-5)
        np.testing.assert_allclose(h["loss"], np.mean(ref), rtol=1e-5)


def test_one_worker_with_outer_sgd_1_is_plain_optax_training():
    # M=1 and outer SGD(1.0): θ ← θ - (θ - θ_1) = θ_1, and AdamW's state carries on, so R
    # rounds of H steps are H*R consecutive AdamW steps.
    rng = np.random.default_rng(2)
    data = make_data(rng, num_rounds=3, num_workers=1, inner_steps=4)
    params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.float32(0.5)}
    inner = optax.adamw(0.05, b1=0.9, b2=0.95, weight_decay=0.1)
    result = dj.train_diloco(
        linear_loss,
        params,
        data,
        num_rounds=3,
        num_workers=1,
        inner_steps=4,
        inner_optimizer=inner,
        outer_optimizer=optax.sgd(1.0),
    )
    p, s = params, inner.init(params)
    for rnd in data:
        for h in range(4):
            g = jax.grad(linear_loss)(p, {"x": rnd["x"][0, h], "y": rnd["y"][0, h]})
            u, s = inner.update(g, s, p)
            p = optax.apply_updates(p, u)
    chex_close(result.params, p, rtol=1e-6)
    assert result.history[-1]["bytes_communicated"] == 0  # a lone worker sends nothing


def test_one_inner_step_with_outer_sgd_1_is_train_sync():
    rng = np.random.default_rng(3)
    rounds = make_data(rng, num_rounds=4, num_workers=3, inner_steps=1)
    steps = [{k: v[:, 0] for k, v in r.items()} for r in rounds]
    params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.float32(0.5)}
    dil = dj.train_diloco(
        linear_loss,
        params,
        rounds,
        num_rounds=4,
        num_workers=3,
        inner_steps=1,
        inner_optimizer=optax.sgd(0.1),
        outer_optimizer=optax.sgd(1.0),
    )
    syn = dj.train_sync(
        linear_loss, params, steps, num_steps=4, num_workers=3, optimizer=optax.sgd(0.1)
    )
    chex_close(dil.params, syn.params, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        [h["loss"] for h in dil.history], [h["loss"] for h in syn.history], rtol=1e-6
    )


def test_train_sync_matches_numpy_data_parallel_sgd():
    rng = np.random.default_rng(4)
    steps = [{k: v[:, 0] for k, v in r.items()} for r in make_data(rng, 3, 2, 1)]
    params = {"w": np.zeros(3, np.float32), "b": np.float32(0)}
    result = dj.train_sync(
        linear_loss, params, steps, num_steps=3, num_workers=2, optimizer=optax.sgd(0.2)
    )
    w, b = np.zeros(3), 0.0
    for st in steps:
        x, y = st["x"].astype(np.float64), st["y"].astype(np.float64)
        errs = [x[m] @ w + b - y[m] for m in range(2)]
        gw = np.mean([x[m].T @ errs[m] / len(errs[m]) for m in range(2)], axis=0)
        gb = np.mean([e.mean() for e in errs])
        w, b = w - 0.2 * gw, b - 0.2 * gb
    np.testing.assert_allclose(result.params["w"], w, rtol=1e-5)
    np.testing.assert_allclose(result.params["b"], b, rtol=1e-5)
    assert [h["bytes_communicated"] for h in result.history] == [16, 32, 48]
    assert [h["step"] for h in result.history] == [0, 1, 2]


def _adamw_diloco_reference(params, data, inner, outer, reset):
    """DiLoCo written directly with optax per worker (no library code)."""
    num_workers = data[0]["x"].shape[0]
    inner_states = [inner.init(params) for _ in range(num_workers)]
    outer_state = outer.init(params)
    for rnd in data:
        locals_ = []
        for m in range(num_workers):
            p, s = params, inner.init(params) if reset else inner_states[m]
            for h in range(rnd["x"].shape[1]):
                g = jax.grad(linear_loss)(p, {"x": rnd["x"][m, h], "y": rnd["y"][m, h]})
                u, s = inner.update(g, s, p)
                p = optax.apply_updates(p, u)
            inner_states[m] = s
            locals_.append(p)
        delta = jax.tree.map(lambda g, *ls: g - sum(ls) / num_workers, params, *locals_)
        u, outer_state = outer.update(delta, outer_state, params)
        params = optax.apply_updates(params, u)
    return params


def test_adamw_inner_state_persists_across_rounds():
    rng = np.random.default_rng(5)
    data = make_data(rng, num_rounds=3, num_workers=2, inner_steps=3)
    params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.float32(0.5)}
    inner, outer = dj.default_inner_optimizer(), dj.default_outer_optimizer()
    result = dj.train_diloco(
        linear_loss, params, data, num_rounds=3, num_workers=2, inner_steps=3, backend="vmap"
    )
    kept = _adamw_diloco_reference(params, data, inner, outer, reset=False)
    reset = _adamw_diloco_reference(params, data, inner, outer, reset=True)
    chex_close(result.params, kept, rtol=1e-5, atol=1e-7)
    assert not np.allclose(result.params["w"], reset["w"], rtol=1e-5, atol=1e-7)
    # AdamW's step count kept counting: 3 rounds x 3 steps, on every worker.
    counts = [
        leaf for leaf in jax.tree.leaves(result.state.inner_opt_state) if leaf.dtype == jnp.int32
    ]
    assert counts and all(np.array_equal(c, [9, 9]) for c in counts)


@pytest.mark.parametrize("num_workers", quick([1, 3, 8, 16], {1, 3}))
def test_backends_agree(num_workers):
    # 8 fake devices: M=3 uses 3 devices, M=8 one worker each, M=16 two workers per device.
    rng = np.random.default_rng(6)
    data = make_data(rng, num_rounds=2, num_workers=num_workers, inner_steps=2)
    params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.float32(0.5)}
    results = {
        be: dj.train_diloco(
            linear_loss,
            params,
            data,
            num_rounds=2,
            num_workers=num_workers,
            inner_steps=2,
            backend=be,
        )
        for be in ("vmap", "shard_map", "pmap", "auto")
    }
    for be, res in results.items():
        chex_close(res.params, results["vmap"].params, rtol=1e-6, atol=1e-7)
        for h, ref in zip(res.history, results["vmap"].history, strict=True):
            np.testing.assert_allclose(h["worker_loss"], ref["worker_loss"], rtol=1e-6)
            assert h["bytes_communicated"] == ref["bytes_communicated"], be
    syncs = [
        dj.train_sync(
            linear_loss,
            params,
            [{k: v[:, 0] for k, v in d.items()} for d in data],
            num_steps=2,
            num_workers=num_workers,
            backend=be,
        ).params
        for be in ("vmap", "shard_map", "pmap")
    ]
    for s in syncs[1:]:
        chex_close(s, syncs[0], rtol=1e-6, atol=1e-7)


def test_make_backend_placement_rules():
    devices = jax.devices()
    assert len(devices) == 8
    assert dj.make_backend("auto", 1).name == "vmap"
    assert dj.make_backend("auto", 4).name == "shard_map"
    assert len(dj.make_backend("shard_map", 3).devices) == 3
    b = dj.make_backend("pmap", 16)
    assert (len(b.devices), b.workers_per_device) == (8, 2)
    # One CPU device: the workers one after another (benchmarks/worker_map.py measured it).
    with pytest.warns(UserWarning, match="can't be split evenly"):
        assert dj.make_backend("auto", 12).name == "sequential"  # 12 over 8 devices: one
    assert dj.make_backend("auto", 4, devices=devices[:1]).name == "sequential"
    assert dj.make_backend("auto", 1, devices=devices[:1]).name == "vmap"  # nothing to map
    # An accelerator batches the M workers into one kernel instead.
    assert one_device_backend(types.SimpleNamespace(platform="gpu"), 4) == "vmap"


def test_inputs_unchanged_usable_and_runs_bit_identical():
    rng = np.random.default_rng(7)
    data = make_data(rng, num_rounds=2, num_workers=2, inner_steps=2)
    params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.float32(0.5)}
    np_params = jax.tree.map(np.asarray, params)
    data_copy = jax.tree.map(np.copy, data)
    for backend in ("vmap", "shard_map", "pmap"):
        a = dj.train_diloco(
            linear_loss, params, data, num_rounds=2, num_workers=2, inner_steps=2, backend=backend
        )
        b = dj.train_diloco(
            linear_loss, params, data, num_rounds=2, num_workers=2, inner_steps=2, backend=backend
        )
        jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
        assert a.history == b.history
        assert not any(x.is_deleted() for x in jax.tree.leaves(params))
        jax.tree.map(np.testing.assert_array_equal, params, np_params)
        jax.tree.map(np.testing.assert_array_equal, data, data_copy)
        s = dj.train_sync(
            linear_loss,
            params,
            [{k: v[:, 0] for k, v in d.items()} for d in data],
            num_steps=2,
            num_workers=2,
            backend=backend,
        )
        assert not any(x.is_deleted() for x in jax.tree.leaves(params))
        assert s.params["w"].shape == (3,)
    assert float(linear_loss(params, {"x": np.ones((1, 3)), "y": np.ones(1)})) >= 0


@pytest.mark.parametrize("backend", ["vmap", "shard_map", "pmap"])
def test_batches_placed_once_are_reused_not_copied_or_donated(backend):
    # Placing is skipped for leaves that already have the target sharding (the host loop's
    # cheap path); the result must equal feeding host arrays, and the batches must survive.
    rng = np.random.default_rng(11)
    data = make_data(rng, num_rounds=2, num_workers=2, inner_steps=2)
    params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.float32(0.5)}
    b = dj.make_backend(backend, 2)
    placed = [b.place_batches(d, lead=2) for d in data]
    again = b.place_batches(placed[0], lead=2)
    pairs = zip(jax.tree.leaves(again), jax.tree.leaves(placed[0]), strict=True)
    assert all(x is y for x, y in pairs)
    kw = dict(num_rounds=2, num_workers=2, inner_steps=2, backend=b)
    host = dj.train_diloco(linear_loss, params, data, **kw)
    device = dj.train_diloco(linear_loss, params, placed, **kw)
    jax.tree.map(np.testing.assert_array_equal, host.params, device.params)
    assert host.history == device.history
    assert not any(x.is_deleted() for x in jax.tree.leaves(placed))
    jax.tree.map(np.testing.assert_array_equal, placed, data)


def test_backends_agree_to_float_rounding_of_one_reference():
    """The README's sentence on backends: each computes the same rounds, equal to a float64
    NumPy reference up to float32 rounding (not bit for bit among themselves). vmap's run is
    test_matches_numpy_reference's."""
    rng = np.random.default_rng(12)
    data = make_data(rng, num_rounds=3, num_workers=4, inner_steps=3)
    params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.float32(0.5)}
    w, b, _ = diloco_sgd(params["w"], params["b"], data, 0.05, 0.7, 0.9)
    for backend in ("shard_map", "pmap"):
        got = dj.train_diloco(
            linear_loss, params, data, num_rounds=3, num_workers=4, inner_steps=3,
            inner_optimizer=optax.sgd(0.05), outer_optimizer=optax.sgd(0.7, **NESTEROV),
            backend=backend,
        )  # fmt: skip
        np.testing.assert_allclose(got.params["w"], w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got.params["b"], b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dtypes_kept(dtype):
    rng = np.random.default_rng(8)
    data = make_data(rng, num_rounds=2, num_workers=2, inner_steps=2)
    params = {"w": jnp.asarray([0.3, -0.2, 0.1], dtype), "b": jnp.asarray(0.5, jnp.float32)}
    result = dj.train_diloco(linear_loss, params, data, num_rounds=2, num_workers=2, inner_steps=2)
    assert result.params["w"].dtype == dtype and result.params["b"].dtype == jnp.float32
    assert result.params["w"].shape == (3,) and result.params["b"].shape == ()
    outer_dtypes = {x.dtype for x in jax.tree.leaves(result.state.outer_opt_state)}
    assert outer_dtypes == {jnp.dtype(jnp.float32)}
    # deltas travel in float32 even for bfloat16 params: 4 bytes x 4 elements per round
    assert result.history[-1]["bytes_communicated"] == 2 * 4 * 4


@pytest.fixture
def x64():
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)


def test_float64_params_without_x64_are_refused_naming_the_leaf():
    """Without x64, JAX would run a float64 leaf as float32 and hand it back so: refused."""
    params = {"w": np.zeros(3), "b": np.float32(0.0)}  # np.zeros: float64
    rounds = make_data(np.random.default_rng(0), 1, 2, 2)
    for train in (
        lambda: dj.train_diloco(linear_loss, params, rounds, num_rounds=1, num_workers=2,
                                inner_steps=2),
        lambda: dj.train_sync(linear_loss, params, [], num_steps=0, num_workers=2),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=r"params\['w'\] is float64.*64-bit mode is off"):
            train()


def test_train_sync_refuses_diloco_rounds_from_worker_rounds():
    dataset = {"x": np.ones((16, 3), np.float32), "y": np.ones(16, np.float32)}
    rounds = dj.worker_rounds(dataset, 2, 2, 2, num_rounds=2)
    params = {"w": jnp.zeros(3), "b": jnp.float32(0)}
    with pytest.raises(ValueError, match=r"DiLoCo rounds from dj.worker_rounds.*dj.sync_steps"):
        dj.train_sync(linear_loss, params, rounds, num_steps=2, num_workers=2)
    steps = dj.sync_steps(dataset, 2, 2, 2, num_rounds=2)
    assert len(dj.train_sync(linear_loss, params, steps, num_steps=4, num_workers=2).history) == 4


def test_auto_warns_when_it_falls_back_to_one_device():
    assert len(jax.devices()) == 8
    with pytest.warns(UserWarning, match=r"num_workers=12 can't be split evenly over 8 devices"):
        backend = dj.make_backend("auto", 12)
    assert backend.name == "sequential" and len(backend.devices) == 1
    for placeable in (1, 4, 16):  # one worker, at most the devices, a multiple of them
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dj.make_backend("auto", placeable)


def test_float64_stays_float64_end_to_end(x64):
    rng = np.random.default_rng(9)
    data = [jax.tree.map(lambda a: a.astype(np.float64), d) for d in make_data(rng, 2, 2, 2)]
    params = {"w": np.asarray([0.3, -0.2, 0.1]), "b": np.float64(0.5)}
    result = dj.train_diloco(
        linear_loss,
        params,
        data,
        num_rounds=2,
        num_workers=2,
        inner_steps=2,
        inner_optimizer=optax.sgd(0.05),
        outer_optimizer=optax.sgd(0.7, **NESTEROV),
    )
    assert {x.dtype for x in jax.tree.leaves(result.state)} <= {
        jnp.dtype("float64"),
        jnp.dtype("int32"),
        jnp.dtype("int64"),
    }
    assert result.params["w"].dtype == np.float64
    w, b, _ = diloco_sgd(params["w"], params["b"], data, 0.05, 0.7, 0.9)
    np.testing.assert_allclose(result.params["w"], w, rtol=1e-12)
    np.testing.assert_allclose(result.params["b"], b, rtol=1e-12)
    assert result.history[-1]["bytes_communicated"] == 2 * 4 * 8


def test_zero_rounds_returns_initial_params_and_consumes_nothing():
    params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.float32(0.5)}

    def data():
        raise AssertionError("data must not be read")
        yield

    result = dj.train_diloco(
        linear_loss, params, data(), num_rounds=0, num_workers=2, inner_steps=3
    )
    assert result.history == []
    jax.tree.map(np.testing.assert_array_equal, result.params, params)
    assert int(result.state.round) == 0
    assert dj.train_sync(linear_loss, params, [], num_steps=0, num_workers=2).history == []


def test_any_pytree_and_multi_array_batches():
    params = {
        "layer": ({"w": jnp.ones((2, 2))}, jnp.float32(0.1)),
        "scale": jnp.asarray(1.0, jnp.bfloat16),
    }

    def loss_fn(p, batch):
        (inner, bias), scale = p["layer"], p["scale"]
        pred = batch["x"] @ inner["w"] @ jnp.ones(2) * scale.astype(jnp.float32) + bias
        return jnp.sum(batch["mask"] * (pred - batch["y"]) ** 2) / jnp.sum(batch["mask"])

    rng = np.random.default_rng(10)
    rnd = {
        "x": rng.normal(size=(2, 1, 3, 2)).astype(np.float32),
        "y": rng.normal(size=(2, 1, 3)).astype(np.float32),
        "mask": np.array([1, 1, 0], np.float32) * np.ones((2, 1, 3), np.float32),
    }
    result = dj.train_diloco(loss_fn, params, [rnd], num_rounds=1, num_workers=2, inner_steps=1)
    assert jax.tree.structure(result.params) == jax.tree.structure(params)
    assert result.params["scale"].dtype == jnp.bfloat16
    assert np.isfinite(result.history[0]["loss"])


def test_diloco_round_composes_under_jit():
    rng = np.random.default_rng(11)
    data = make_data(rng, num_rounds=2, num_workers=2, inner_steps=2)
    params = {"w": np.asarray([0.3, -0.2, 0.1], np.float32), "b": np.float32(0.5)}
    inner, outer = optax.sgd(0.05), optax.sgd(0.7, **NESTEROV)
    state = dj.init_state(params, 2, inner_optimizer=inner, outer_optimizer=outer)
    step = jax.jit(
        lambda s, b: dj.diloco_round(
            linear_loss, s, b, inner_optimizer=inner, outer_optimizer=outer
        )
    )
    for rnd in data:
        state, metrics = step(state, rnd)
    w, b, losses = diloco_sgd(params["w"], params["b"], data, 0.05, 0.7, 0.9)
    np.testing.assert_allclose(state.params["w"], w, rtol=2e-5)
    np.testing.assert_allclose(metrics["worker_loss"], losses[-1], rtol=1e-5)
    assert metrics["worker_loss"].shape == (2,) and int(state.round) == 2


# ---- bad input ---------------------------------------------------------------------------

PARAMS = {"w": jnp.zeros(3), "b": jnp.float32(0)}


def _diloco(**overrides):
    kwargs = dict(num_rounds=1, num_workers=2, inner_steps=2, backend="vmap")
    kwargs.update(overrides)
    data = kwargs.pop("data", make_data(np.random.default_rng(0), 2, 2, 2))
    loss_fn = kwargs.pop("loss_fn", linear_loss)
    return dj.train_diloco(loss_fn, kwargs.pop("params", PARAMS), data, **kwargs)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(num_workers=0), "num_workers"),
        (dict(num_workers=2.0), "num_workers"),
        (dict(inner_steps=0), "inner_steps"),
        (dict(num_rounds=-1), "num_rounds"),
        (dict(num_rounds=True), "num_rounds"),
        (dict(backend="gpu"), "backend"),
        (
            dict(
                backend="shard_map",
                num_workers=12,
                data=make_data(np.random.default_rng(0), 1, 12, 2),
            ),
            "num_workers=12",
        ),
        (dict(num_workers=3), r"leading dims \[num_workers, inner_steps\]"),
        (dict(inner_steps=3), r"leading dims \[num_workers, inner_steps\]"),
        (dict(num_rounds=3), "data ran out after 2"),
        (dict(data=5), "data must be an iterable"),
        (dict(loss_fn=lambda p, b: b["x"] @ p["w"]), "loss_fn must return a float scalar"),
        (dict(params={"w": jnp.zeros(3, jnp.int32)}), "params leaves must be floating"),
        (dict(params={}), "params must be a pytree"),
        (dict(inner_optimizer="adam"), "inner_optimizer"),
        (dict(outer_optimizer=0.7), "outer_optimizer"),
        # Issue 40, finding 4: what JAX's int32 counters and 32-bit seeds hold.
        (dict(num_rounds=2**31), "num_rounds must be at most 2,147,483,647"),
        (dict(inner_steps=2**16, num_rounds=2**15), "num_rounds x inner_steps: 32,768 x 65,536"),
        (dict(rng_seed=2**32), "rng_seed must be at most 4,294,967,295"),
        (dict(drop_probability=0.5, drop_seed=2**32), "drop_seed must be at most"),
        (dict(checkpoint_every=2**31, checkpoint_dir="never"), "checkpoint_every must be at most"),
        (dict(checkpoint_fingerprint=[1]), "checkpoint_fingerprint must be a dict"),
    ],
)
def test_train_diloco_bad_input(overrides, match):
    with pytest.raises(ValueError, match=match):
        _diloco(**overrides)


def test_workers_are_checked_against_the_data_and_the_memory_before_the_state_is_built():
    """Issue 40, finding 4: 10^7 workers for data of 2 was refused only after their state was
    built (16 s, 4.7 GB); 10^9 workers of data read as it goes allocated until memory ran
    out. Both are refused before anything is allocated: the data's first item, and the
    bytes the state needs against what the devices hold."""
    data = make_data(np.random.default_rng(0), 2, 2, 2)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"data item 0: .* = \(10000000, 2\), got shape \(2,"):
        _diloco(num_workers=10**7, data=data)
    # Per worker AdamW's two moments of the 3 + 1 float32 params and its int32 count, 36
    # bytes: 36.0 GB for 10^9 (beside 32 bytes of θ and the outer momentum).
    with pytest.raises(ValueError, match=r"num_workers=1000000000 needs at least 36\.0 GB"):
        _diloco(num_workers=10**9, data=iter(data))
    assert time.monotonic() - start < 10


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(num_steps=-1), "num_steps"),
        (dict(num_workers=0), "num_workers"),
        (dict(backend="tpu"), "backend"),
        (dict(num_steps=5), "data ran out after 2"),
        (dict(num_workers=3), r"leading dims \[num_workers\]"),
        (dict(optimizer="sgd"), "optimizer"),
    ],
)
def test_train_sync_bad_input(overrides, match):
    kwargs = dict(num_steps=2, num_workers=2, backend="vmap")
    kwargs.update(overrides)
    steps = [
        {k: v[:, 0] for k, v in d.items()} for d in make_data(np.random.default_rng(0), 2, 2, 1)
    ]
    with pytest.raises(ValueError, match=match):
        dj.train_sync(linear_loss, PARAMS, steps, **kwargs)


def chex_close(a, b, **tol):
    import chex

    chex.assert_trees_all_close(a, b, **tol)

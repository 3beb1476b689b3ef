"""Worker faults in diloco_round (non-finite deltas, drops, uneven inner steps) against a NumPy
reference extended from tests/reference.py's diloco_sgd."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from reference import linear_grads, linear_loss, make_data

import diloco_jax as dj
from diloco_jax import faults

INNER_LR, OUTER_LR, MOMENTUM = 0.05, 0.7, 0.9
INNER = optax.sgd(INNER_LR)
OUTER = optax.sgd(OUTER_LR, momentum=MOMENTUM, nesterov=True)
PARAMS = {"w": np.asarray([0.3, -0.2, 0.1], np.float32), "b": np.float32(0.5)}


def faulty_sgd(w, b, rounds, include, steps=None, weights=None, carry=None):
    """diloco_sgd (SGD inner, Nesterov SGD outer, float64) with faults.

    include[r][m]: worker m's delta joins round r's mean (a round with none is skipped: θ and
    the momentum trace stay). steps[m]: worker m takes its first steps[m] steps. weights[m]:
    its weight in the mean (default 1). carry[r][m]: worker m starts round r + 1 from its own
    params instead of the new θ. Returns (w, b, losses[r][m] over each worker's own steps).
    """
    w, b = np.float64(w).copy(), np.float64(b)
    num_workers = rounds[0]["x"].shape[0]
    steps = steps or [rounds[0]["x"].shape[1]] * num_workers
    weights = weights or [1.0] * num_workers
    starts = [(w.copy(), b)] * num_workers
    trace_w, trace_b, losses = np.zeros_like(w), 0.0, []
    for r, batch in enumerate(rounds):
        x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
        finals, round_losses, sum_w, sum_b, total = [], [], 0.0, 0.0, 0.0
        for m in range(num_workers):
            wm, bm = starts[m][0].copy(), starts[m][1]
            step_losses = []
            for h in range(steps[m]):
                gw, gb, loss = linear_grads(wm, bm, x[m, h], y[m, h])
                step_losses.append(loss)
                wm, bm = wm - INNER_LR * gw, bm - INNER_LR * gb
            finals.append((wm, bm))
            round_losses.append(np.mean(step_losses))
            if include[r][m]:
                sum_w, sum_b = sum_w + weights[m] * (w - wm), sum_b + weights[m] * (b - bm)
                total += weights[m]
        if total > 0:
            dw, db = sum_w / total, sum_b / total
            trace_w, trace_b = dw + MOMENTUM * trace_w, db + MOMENTUM * trace_b
            w = w - OUTER_LR * (dw + MOMENTUM * trace_w)
            b = b - OUTER_LR * (db + MOMENTUM * trace_b)
        carry_r = carry[r] if carry else [False] * num_workers
        starts = [finals[m] if carry_r[m] else (w.copy(), b) for m in range(num_workers)]
        losses.append(round_losses)
    return w, b, losses


def run_rounds(data, backend="vmap", inner=INNER, drop_probability=None, **options):
    """Runs len(data) jitted rounds; returns (state, [metrics as NumPy])."""
    num_workers = data[0]["x"].shape[0]
    state = dj.init_state(
        PARAMS,
        num_workers,
        inner_optimizer=inner,
        outer_optimizer=OUTER,
        drop_probability=drop_probability,
    )
    step = jax.jit(
        functools.partial(
            dj.diloco_round,
            linear_loss,
            inner_optimizer=inner,
            outer_optimizer=OUTER,
            backend=backend,
            drop_probability=drop_probability,
            **options,
        )
    )
    history = []
    for batch in data:
        state, metrics = step(state, batch)
        history.append(jax.tree.map(np.asarray, metrics))
    return state, history


def assert_params(state, w, b):
    np.testing.assert_allclose(state.params["w"], w, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(state.params["b"], b, rtol=2e-5, atol=1e-6)


def assert_trees_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_nonfinite_worker_is_left_out_of_that_round(backend):
    data = make_data(np.random.default_rng(0), num_rounds=2, num_workers=4, inner_steps=2)
    data[0]["x"][1, 0, 0, 0] = np.nan
    state, history = run_rounds(data, backend, exclude_nonfinite=True)
    include = [[True, False, True, True], [True] * 4]
    w, b, losses = faulty_sgd(PARAMS["w"], PARAMS["b"], data, include)
    assert_params(state, w, b)
    assert history[0]["excluded_workers"].tolist() == [False, True, False, False]
    assert not history[1]["excluded_workers"].any()
    assert not history[0]["skipped"] and not history[1]["skipped"]
    assert not history[0]["dropped_workers"].any()
    np.testing.assert_allclose(history[1]["worker_loss"], losses[1], rtol=1e-5)
    assert np.isnan(history[0]["worker_loss"][1])


# shard_map: one worker per device, where the restore and the skip are loops of zero or one
# trip (round.py's `in_place_skips`); vmap: both workers on one device, selects.
@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_nonfinite_worker_keeps_its_inner_state_from_before_the_round(backend):
    data = make_data(np.random.default_rng(1), num_rounds=1, num_workers=2, inner_steps=2)
    data[0]["y"][1, 1, 0] = np.inf
    inner = optax.adam(0.01)
    state, _ = run_rounds(data, backend, inner=inner, exclude_nonfinite=True)
    fresh = inner.init(PARAMS)
    mu0, mu1 = (jax.tree.map(lambda x, m=m: x[m], state.inner_opt_state[0].mu) for m in (0, 1))
    assert_trees_equal(mu1, jax.tree.map(np.asarray, fresh[0].mu))
    assert int(state.inner_opt_state[0].count[0]) == 2
    assert int(state.inner_opt_state[0].count[1]) == 0
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(mu0))


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_all_workers_nonfinite_skips_the_round_bit_for_bit(backend):
    data = make_data(np.random.default_rng(2), num_rounds=2, num_workers=2, inner_steps=2)
    data[1]["x"][:, 0] = np.nan
    state1, _ = run_rounds(data[:1], backend, exclude_nonfinite=True)
    state2, history = run_rounds(data, backend, exclude_nonfinite=True)
    assert history[1]["skipped"] and not history[0]["skipped"]
    assert history[1]["excluded_workers"].all()
    assert_trees_equal(state2.params, state1.params)
    assert_trees_equal(state2.outer_opt_state, state1.outer_opt_state)
    assert int(state2.round) == 2


def test_restore_workers_takes_the_start_values_of_workers_not_kept():
    new_k = {"a": np.asarray([[1.0, np.nan], [3.0, 4.0], [np.inf, 6.0]], np.float32)}
    start_k = {"a": np.asarray([[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]], np.float32)}
    restore = jax.jit(faults.restore_workers)
    kept = restore(jnp.asarray([True, True, True]), new_k, start_k)
    assert_trees_equal(kept, new_k)
    mixed = restore(jnp.asarray([False, True, False]), new_k, start_k)
    np.testing.assert_array_equal(mixed["a"], [[-1.0, -2.0], [3.0, 4.0], [-5.0, -6.0]])


def test_unless_applies_the_update_or_leaves_the_values_bit_for_bit():
    values = (np.asarray([1.5, -0.0, 2.0], np.float32), np.asarray([0.25, 0.5, 0.0], np.float32))
    step = np.asarray([0.1, 0.2, 0.3], np.float32)

    def update(x, v, g):  # heavy-ball: v <- 0.9 v + g, x <- x - v
        v = 0.9 * v + g
        return x - v, v

    run = jax.jit(lambda skip: faults.unless(skip, update, values, step))
    x, v = run(jnp.bool_(False))
    v_ref = np.float32(0.9) * values[1] + step
    np.testing.assert_array_equal(v, v_ref)
    np.testing.assert_array_equal(x, values[0] - v_ref)
    kept = run(jnp.bool_(True))
    assert_trees_equal(kept, values)
    assert np.signbit(kept[0][1])  # -0.0 stays -0.0: the values, not x + 0


def test_drop_probability_zero_is_the_plain_round_bit_for_bit():
    data = make_data(np.random.default_rng(3), num_rounds=2, num_workers=2, inner_steps=2)
    plain, plain_history = run_rounds(data)
    zero, history = run_rounds(data, drop_probability=0.0)
    assert_trees_equal(zero.params, plain.params)
    assert_trees_equal(zero.outer_opt_state, plain.outer_opt_state)
    own = zero.parts["workers"].params
    assert_trees_equal(own, jax.tree.map(lambda x: np.stack([x] * 2), zero.params))
    assert not any(h["dropped_workers"].any() or h["skipped"] for h in history)
    np.testing.assert_array_equal(history[1]["loss"], plain_history[1]["loss"])


def test_a_round_that_drops_every_worker_is_skipped():
    data = make_data(np.random.default_rng(4), num_rounds=2, num_workers=2, inner_steps=2)
    state, history = run_rounds(data, drop_probability=0.999)
    assert all(h["skipped"] and h["dropped_workers"].all() for h in history)
    assert_trees_equal(state.params, jax.tree.map(np.asarray, PARAMS))
    assert_trees_equal(state.outer_opt_state, OUTER.init(jax.tree.map(jnp.asarray, PARAMS)))


def test_drops_are_deterministic_from_seed_and_round():
    data = make_data(np.random.default_rng(5), num_rounds=3, num_workers=4, inner_steps=1)
    a, ha = run_rounds(data, drop_probability=0.5, drop_seed=7)
    b, hb = run_rounds(data, drop_probability=0.5, drop_seed=7)
    assert_trees_equal(a, b)
    for r, (x, y) in enumerate(zip(ha, hb, strict=True)):
        np.testing.assert_array_equal(x["dropped_workers"], y["dropped_workers"])
        expected = faults.drop_mask(7, jnp.int32(r), 4, 0.5)
        np.testing.assert_array_equal(x["dropped_workers"], expected)


def _seed_dropping(masks):
    """A seed whose p=0.5 drop masks for rounds 0, 1, ... of 2 workers are `masks`."""
    for seed in range(1000):
        got = [faults.drop_mask(seed, jnp.int32(r), 2, 0.5).tolist() for r in range(len(masks))]
        if got == masks:
            return seed
    raise AssertionError(f"no seed below 1000 drops {masks}")


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_dropped_worker_carries_on_from_its_own_params(backend):
    masks = [[True, False], [False, False]]
    seed = _seed_dropping(masks)
    data = make_data(np.random.default_rng(6), num_rounds=2, num_workers=2, inner_steps=2)
    state, history = run_rounds(data, backend, drop_probability=0.5, drop_seed=seed)
    assert [h["dropped_workers"].tolist() for h in history] == masks
    include = [[not d for d in mask] for mask in masks]
    w, b, losses = faulty_sgd(PARAMS["w"], PARAMS["b"], data, include, carry=masks)
    assert_params(state, w, b)
    for h, ref in zip(history, losses, strict=True):
        np.testing.assert_allclose(h["worker_loss"], ref, rtol=1e-5)
    # Control: had worker 0 restarted from θ, round 1 would differ.
    w_restart, _, _ = faulty_sgd(PARAMS["w"], PARAMS["b"], data, include)
    assert not np.allclose(w, w_restart, rtol=1e-4)


@pytest.mark.parametrize("weighting, backend", [("uniform", "vmap"), ("steps", "shard_map")])
def test_uneven_worker_steps(weighting, backend):
    H = 3
    data = make_data(np.random.default_rng(7), num_rounds=2, num_workers=2, inner_steps=H)
    state, history = run_rounds(data, backend, worker_steps=(H, 1), weighting=weighting)
    weights = [H, 1] if weighting == "steps" else None
    include = [[True, True]] * 2
    w, b, losses = faulty_sgd(PARAMS["w"], PARAMS["b"], data, include, [H, 1], weights)
    assert_params(state, w, b)
    for h, ref in zip(history, losses, strict=True):
        np.testing.assert_allclose(h["worker_loss"], ref, rtol=1e-5)
        np.testing.assert_allclose(h["loss"], (H * ref[0] + ref[1]) / (H + 1), rtol=1e-5)


def test_masked_steps_do_not_advance_the_inner_optimizer():
    data = make_data(np.random.default_rng(8), num_rounds=1, num_workers=2, inner_steps=3)
    state, _ = run_rounds(data, inner=optax.adam(0.01), worker_steps=[3, 1])
    assert state.inner_opt_state[0].count.tolist() == [3, 1]


@pytest.mark.parametrize(
    "options, name",
    [
        (dict(drop_probability=-0.1), "drop_probability"),
        (dict(drop_probability=1.0), "drop_probability must be below 1"),
        (dict(drop_probability=1.5), "drop_probability"),
        (dict(worker_steps=(1, 1, 1)), "worker_steps"),
        (dict(worker_steps=(0, 2)), "worker_steps"),
        (dict(worker_steps=(1, 3)), "worker_steps"),
        (dict(weighting="median"), "weighting"),
        (dict(exclude_nonfinite=True, compression="int9"), "compression"),
        (dict(exclude_nonfinite=True, compression="int4,ef=1"), r"parts\['compression'\]"),
    ],
)
def test_invalid_options_raise(options, name):
    data = make_data(np.random.default_rng(9), num_rounds=1, num_workers=2, inner_steps=2)
    state = dj.init_state(PARAMS, 2, inner_optimizer=INNER, outer_optimizer=OUTER)
    with pytest.raises(ValueError, match=name):
        dj.diloco_round(
            linear_loss, state, data[0], inner_optimizer=INNER, outer_optimizer=OUTER, **options
        )


def test_drops_need_each_workers_own_params_in_the_state():
    data = make_data(np.random.default_rng(10), num_rounds=1, num_workers=2, inner_steps=2)
    state = dj.init_state(PARAMS, 2, inner_optimizer=INNER, outer_optimizer=OUTER)
    with pytest.raises(ValueError, match=r"parts\['workers'\]"):
        dj.diloco_round(
            linear_loss,
            state,
            data[0],
            inner_optimizer=INNER,
            outer_optimizer=OUTER,
            drop_probability=0.5,
        )


def test_uneven_steps_with_a_sampler():
    H = 3
    data = make_data(np.random.default_rng(11), num_rounds=1, num_workers=2, inner_steps=H)
    sampler = dj.Sampler(
        arrays=jax.tree.map(jnp.asarray, data[0]),
        sample=lambda arrays, r, m, h: jax.tree.map(lambda x: x[m, h], arrays),
    )
    state = dj.init_state(PARAMS, 2, inner_optimizer=INNER, outer_optimizer=OUTER)
    state, metrics = dj.diloco_round(
        linear_loss,
        state,
        sampler,
        inner_optimizer=INNER,
        outer_optimizer=OUTER,
        num_workers=2,
        inner_steps=H,
        worker_steps=(1, H),
    )
    w, b, losses = faulty_sgd(PARAMS["w"], PARAMS["b"], data, [[True, True]], [1, H])
    assert_params(state, w, b)
    np.testing.assert_allclose(metrics["worker_loss"], losses[0], rtol=1e-5)


def test_train_diloco_reports_excluded_workers_and_skips(tmp_path):
    # Exclusion is on by default for exact deltas: NaN data on worker 1 in round 0.
    rounds = make_data(np.random.default_rng(11), num_rounds=2, num_workers=3, inner_steps=2)
    rounds[0]["x"][1, 0, 0, 0] = np.nan
    params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.float32(0.5)}
    kw = dict(
        num_rounds=2,
        num_workers=3,
        inner_steps=2,
        backend="shard_map",
        inner_optimizer=optax.sgd(0.05),
        outer_optimizer=optax.sgd(0.7, momentum=0.9),
    )
    result = dj.train_diloco(linear_loss, params, rounds, **kw)
    assert [h["excluded_workers"] for h in result.history] == [[1], []]
    assert [h["skipped"] for h in result.history] == [False, False]
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.params))
    # Every worker NaN in round 0: round 0 is skipped, params untouched by it.
    bad = [dict(rounds[0], x=np.full_like(rounds[0]["x"], np.nan)), rounds[1]]
    with pytest.warns(RuntimeWarning, match="every worker was excluded .* in 1 of 1 rounds"):
        skipped = dj.train_diloco(linear_loss, params, bad, **dict(kw, num_rounds=1))
    assert skipped.history[0]["skipped"] and skipped.history[0]["excluded_workers"] == [0, 1, 2]
    jax.tree.map(np.testing.assert_array_equal, skipped.params, params)
    # Opting out keeps the old behaviour: the NaN reaches the global params.
    off = dj.train_diloco(linear_loss, params, rounds, exclude_nonfinite=False, **kw)
    assert "skipped" not in off.history[0]
    assert not np.isfinite(np.asarray(off.params["w"])).all()
    # Under a lossy compression exclusion is opt-in: off, the NaN spreads through the codes;
    # on, the same worker is left out and the run stays finite, residuals included.
    lossy = dict(kw, compression="int8,ef=1")
    spread = dj.train_diloco(linear_loss, params, rounds, **lossy)
    assert not np.isfinite(np.asarray(spread.params["w"])).all()
    kept = dj.train_diloco(linear_loss, params, rounds, exclude_nonfinite=True, **lossy)
    assert [h["excluded_workers"] for h in kept.history] == [[1], []]
    finite = jax.tree.leaves((kept.params, kept.state.parts["compression"]))
    assert all(np.isfinite(np.asarray(x)).all() for x in finite)


def test_train_diloco_drops_are_reported_and_resumable(tmp_path):
    rounds = make_data(np.random.default_rng(12), num_rounds=4, num_workers=4, inner_steps=2)
    params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.float32(0.5)}
    kw = dict(
        num_rounds=4,
        num_workers=4,
        inner_steps=2,
        backend="vmap",
        drop_probability=0.5,
        drop_seed=3,
    )
    full = dj.train_diloco(linear_loss, params, rounds, **kw)
    dropped = [h["dropped_workers"] for h in full.history]
    assert any(dropped) and dropped != [[0, 1, 2, 3]] * 4
    dj.train_diloco(linear_loss, params, rounds, checkpoint_dir=tmp_path, **dict(kw, num_rounds=2))
    resumed = dj.train_diloco(linear_loss, params, rounds, checkpoint_dir=tmp_path, **kw)
    jax.tree.map(np.testing.assert_array_equal, resumed.state, full.state)
    assert resumed.history == full.history
    with pytest.raises(ValueError, match="drop_seed"):
        dj.train_diloco(linear_loss, params, rounds, **dict(kw, drop_seed=-1))
    # Under compression the same workers are dropped (keyed by seed and round only).
    compressed = dj.train_diloco(linear_loss, params, rounds, **dict(kw, compression="int8"))
    assert [h["dropped_workers"] for h in compressed.history] == dropped


def test_the_finite_check_reads_each_devices_own_shard():
    """Inside the workers' map, a leaf split over a worker's own devices (fsdp, left to XLA's
    partitioner) is checked shard by shard: the compiled program moves none of it between
    devices (flattening it first gathered it whole onto each), and the answer is right."""
    mesh = jax.make_mesh((2, 4), ("workers", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    x = np.ones((2, 8, 16), np.float32)
    x[1, 3, 5] = np.nan
    x = jax.device_put(x, NamedSharding(mesh, P("workers", None, "fsdp")))
    check = jax.jit(
        jax.shard_map(
            lambda x: faults.all_finite({"w": x[0]})[None],
            mesh=mesh,
            in_specs=P("workers"),
            out_specs=P("workers"),
            axis_names={"workers"},
        )
    )
    np.testing.assert_array_equal(check(x), [True, False])
    text = check.lower(x).compile().as_text()
    assert "all-gather" not in text and "all-to-all" not in text


def test_rounds_in_which_every_worker_was_excluded_give_one_warning():
    """Issue 40, finding 8: a run whose workers all went non-finite "succeeded" with its
    params unchanged and no word. One warning now says in how many rounds that happened."""
    import warnings

    data = make_data(np.random.default_rng(12), num_rounds=3, num_workers=2, inner_steps=2)
    for r in (0, 2):
        data[r]["x"][:] = np.nan  # every worker's every step: non-finite deltas
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = dj.train_diloco(
            linear_loss, PARAMS, data, num_rounds=3, num_workers=2, inner_steps=2,
            exclude_nonfinite=True, backend="vmap",
        )  # fmt: skip
    messages = [str(w.message) for w in caught if "every worker was excluded" in str(w.message)]
    assert messages == [
        "every worker was excluded (a non-finite or outlier delta) in 2 of 3 rounds (the first: "
        "round 0); the params did not change in those rounds"
    ]
    assert [h["excluded_workers"] for h in result.history] == [[0, 1], [], [0, 1]]


MEMBERSHIP = ((True, True, True), (True, False, True), (True, False, True), (False, True, True))


@pytest.mark.parametrize("backend", ["vmap", "sequential"])
def test_membership_leaves_a_worker_out_and_back_from_theta(backend):
    data = make_data(np.random.default_rng(21), num_rounds=5, num_workers=3, inner_steps=3)
    state, history = run_rounds(data, backend, membership=MEMBERSHIP)
    # Out of a round: left out of its mean; back: from θ (the reference's default start).
    include = [list(row) for row in MEMBERSHIP] + [[True] * 3]
    w, b, losses = faulty_sgd(PARAMS["w"], PARAMS["b"], data, include)
    assert_params(state, w, b)
    for h, ref, row in zip(history, losses, include, strict=True):
        kept = [r for r, inside in zip(ref, row, strict=True) if inside]
        np.testing.assert_allclose(h["loss"], np.mean(kept), rtol=1e-5)
        assert h["dropped_workers"].tolist() == [not x for x in row]


def test_membership_keeps_an_absent_workers_inner_state():
    data = make_data(np.random.default_rng(22), num_rounds=4, num_workers=3, inner_steps=2)
    state, _ = run_rounds(data, inner=optax.adam(0.01), membership=MEMBERSHIP)
    # Steps taken: 2 a round in, 0 out; rounds 0-3 of MEMBERSHIP.
    assert state.inner_opt_state[0].count.tolist() == [6, 4, 8]


def test_data_positions_count_the_rounds_a_worker_was_in():
    positions = faults.data_positions(MEMBERSHIP, 6)
    assert positions.tolist() == [
        [0, 0, 0], [1, 1, 1], [2, 1, 2], [3, 1, 3], [3, 2, 4], [4, 3, 5],
    ]  # fmt: skip


@pytest.mark.parametrize(
    "membership, message",
    [
        (((True, False), (False, False)), "round 1 has none"),
        (((True, True), (True,)), "rows of bools"),
        (((1, 0),), "rows of bools"),
        (((True, True, True),), r"one entry per worker \(2\)"),
    ],
)
def test_membership_refusals(membership, message):
    data = make_data(np.random.default_rng(23), num_rounds=1, num_workers=2, inner_steps=2)
    with pytest.raises(ValueError, match=message):
        run_rounds(data, membership=membership)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(drop_probability=0.1), "drop_probability"),
        (dict(fragments=2), "fragments"),
        (dict(eager=True, outer_delay=1), "(?i)eager"),
    ],
)
def test_membership_refuses_parts_that_keep_a_workers_own_params(options, message):
    data = make_data(np.random.default_rng(24), num_rounds=1, num_workers=2, inner_steps=2)
    with pytest.raises(ValueError, match=message):
        run_rounds(data, membership=((True, True),), **options)

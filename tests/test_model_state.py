"""Model state beside the params (`model_state=`): each worker carries its own copy through its
inner steps, the merge rules ("mean", "first", "keep") apply at every round's end (every step
for train_sync), and no optimizer, delta or wire-byte count sees it. References: the model
state's update rule replayed in NumPy per worker."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from quick import quick
from reference import linear_loss, make_data

import diloco_jax as dj
from diloco_jax.round import diloco_round, init_state

M, H, R = 2, 3, 3
PARAMS = {"w": jnp.zeros(3), "b": jnp.float32(0)}
MODEL_STATE = {"avg": jnp.zeros(3), "count": jnp.zeros((), jnp.int32)}


def running_loss(params, model_state, batch):
    """The linear loss; the model state keeps a running mean of the batch's inputs (like a
    BatchNorm statistic) and counts its steps."""
    new = {
        "avg": 0.9 * model_state["avg"] + 0.1 * jnp.mean(batch["x"], axis=0),
        "count": model_state["count"] + 1,
    }
    return linear_loss(params, batch), new


def _rounds(seed=0, num_rounds=R):
    return make_data(np.random.default_rng(seed), num_rounds, M, H)


def _numpy_avg(rounds, merge):
    """Each worker's running mean after every round ([R, M, 3]) under `merge` of the avg."""
    avg, out = np.zeros((M, 3)), []
    for batch in rounds:
        for h in range(H):
            avg = 0.9 * avg + 0.1 * np.asarray(batch["x"], np.float64)[:, h].mean(axis=1)
        if merge == "mean":
            avg = np.broadcast_to(avg.mean(axis=0), avg.shape).copy()
        elif merge == "first":
            avg = np.broadcast_to(avg[0], avg.shape).copy()
        out.append(avg.copy())
    return np.array(out)


@pytest.mark.parametrize("merge", ["mean", "first", "keep"])
def test_round_merges_the_running_mean_by_its_rule(merge):
    rounds = _rounds()
    rules = {"avg": merge, "count": "keep"}
    state = init_state(PARAMS, M, model_state=MODEL_STATE)
    round_ = jax.jit(lambda s, b: diloco_round(running_loss, s, b, model_state_merge=rules))
    expected = _numpy_avg(rounds, merge)
    for r, batch in enumerate(rounds):
        state, _ = round_(state, batch)
        np.testing.assert_allclose(state.model_state["avg"], expected[r], rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(state.model_state["count"], [(r + 1) * H] * M)
    if merge == "keep":
        assert not np.array_equal(state.model_state["avg"][0], state.model_state["avg"][1])


def test_the_model_state_changes_no_param_value_byte_or_optimizer_state():
    """A run with a model state trains the params exactly as one without (weight decay on);
    its deltas and wire bytes are the params' alone, the merge's bytes are counted apart."""
    rounds = _rounds()
    common = dict(num_rounds=R, num_workers=M, inner_steps=H, backend="vmap")
    plain = dj.train_diloco(linear_loss, PARAMS, rounds, **common)
    with_state = dj.train_diloco(running_loss, PARAMS, rounds, model_state=MODEL_STATE, **common)
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(with_state.params), strict=True):
        np.testing.assert_array_equal(a, b)
    chex_equal = jax.tree.map(
        np.array_equal, plain.state.inner_opt_state, with_state.state.inner_opt_state
    )
    assert all(jax.tree.leaves(chex_equal))
    for p, s in zip(plain.history, with_state.history, strict=True):
        assert s["wire_bytes"] == p["wire_bytes"]
        assert s["bytes_communicated"] == p["bytes_communicated"]
        # "mean" of the float32 [3] avg (a ring all-reduce: 2 (M-1)/M x 12 bytes a round);
        # the int32 count is kept ("keep", the default for non-float leaves).
        assert s["model_state_wire_bytes"] == (s["round"] + 1) * 2 * (M - 1) / M * 12
    assert "model_state_wire_bytes" not in plain.history[0]
    # The result's model state is the merged one: the mean leaf once, the kept one per worker.
    np.testing.assert_allclose(
        with_state.model_state["avg"], _numpy_avg(rounds, "mean")[-1][0], rtol=1e-6, atol=1e-7
    )
    np.testing.assert_array_equal(with_state.model_state["count"], [R * H] * M)


def test_eval_fn_sees_the_merged_model_state_and_eval_data():
    rounds = _rounds()
    eval_data = {"x": jnp.ones((5, 3))}
    result = dj.train_diloco(
        running_loss, PARAMS, rounds, num_rounds=R, num_workers=M, inner_steps=H,
        model_state=MODEL_STATE, eval_data=eval_data,
        eval_fn=lambda p, ms, d: {"avg0": ms["avg"][0], "n": jnp.sum(d["x"]),
                                  "count0": ms["count"][0].astype(jnp.float32)},
    )  # fmt: skip
    expected = _numpy_avg(rounds, "mean")
    for r, entry in enumerate(result.history):
        np.testing.assert_allclose(entry["avg0"], expected[r][0][0], rtol=1e-6, atol=1e-7)
        assert entry["n"] == 15.0 and entry["count0"] == (r + 1) * H


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_device_backends_merge_like_vmap(backend):
    rounds = _rounds()
    rules = {"avg": "mean", "count": "first"}
    runs = [
        dj.train_diloco(
            running_loss,
            PARAMS,
            rounds,
            num_rounds=R,
            num_workers=M,
            inner_steps=H,
            backend=b,
            model_state=MODEL_STATE,
            model_state_merge=rules,
            inner_optimizer=optax.sgd(0.1),
        )  # fmt: skip
        for b in ("vmap", backend)
    ]
    for a, b in zip(jax.tree.leaves(runs[0].state), jax.tree.leaves(runs[1].state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert runs[1].model_state["count"].shape == ()  # "first": merged, one value


def test_data_parallel_workers_carry_their_model_state():
    rounds = _rounds()
    common = dict(
        num_rounds=R, num_workers=M, inner_steps=H, model_state=MODEL_STATE,
        inner_optimizer=optax.sgd(0.1),
    )  # fmt: skip
    vmap = dj.train_diloco(running_loss, PARAMS, rounds, backend="vmap", **common)
    mesh = dj.train_diloco(running_loss, PARAMS, rounds, data_parallel=2, **common)
    np.testing.assert_allclose(mesh.model_state["avg"], vmap.model_state["avg"], rtol=1e-6)
    np.testing.assert_allclose(mesh.params["w"], vmap.params["w"], rtol=1e-5)


@pytest.mark.parametrize(
    "options",
    quick([dict(fragments=3), dict(outer_delay=1), dict(outer_delay=1, eager=True),
           dict(worker_steps=(3, 2)), dict(state_sync={"mu": 2}), dict(drop_probability=0.5)],
          lambda o: "fragments" in o or "eager" in o or "drop_probability" in o),
    ids=["fragments", "delayed", "eager", "worker_steps", "state_sync", "drops"],
)  # fmt: skip
def test_every_method_part_carries_the_model_state(options):
    """With each part the params train as without a model state, and the running mean is
    merged at the round's end (worker_steps: a worker past its h_m steps keeps its state)."""
    rounds = _rounds()
    params = {**PARAMS, "unused": jnp.zeros(2)}  # a third leaf, for three fragments
    common = dict(num_rounds=R, num_workers=M, inner_steps=H, backend="vmap", **options)
    plain = dj.train_diloco(linear_loss, params, rounds, **common)
    with_state = dj.train_diloco(running_loss, params, rounds, model_state=MODEL_STATE, **common)
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(with_state.params), strict=True):
        np.testing.assert_array_equal(a, b)
    steps = options.get("worker_steps", (H, H))
    np.testing.assert_array_equal(with_state.model_state["count"], [R * h for h in steps])
    if "worker_steps" not in options:
        np.testing.assert_allclose(
            with_state.model_state["avg"], _numpy_avg(rounds, "mean")[-1][0], rtol=1e-6,
            atol=1e-7,
        )  # fmt: skip


def test_a_model_state_run_resumes_bit_identically(tmp_path):
    rounds = _rounds(num_rounds=4)
    common = dict(
        num_workers=M, inner_steps=H, model_state=MODEL_STATE, checkpoint_dir=tmp_path / "c"
    )
    whole = dj.train_diloco(
        running_loss, PARAMS, rounds, num_rounds=4, **{**common, "checkpoint_dir": None}
    )
    dj.train_diloco(running_loss, PARAMS, rounds[:2], num_rounds=2, **common)
    resumed = dj.train_diloco(running_loss, PARAMS, rounds, num_rounds=4, **common)
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert resumed.history == whole.history


def test_train_sync_merges_every_step():
    rng = np.random.default_rng(1)
    steps = [
        {"x": rng.normal(size=(M, 4, 3)).astype(np.float32),
         "y": rng.normal(size=(M, 4)).astype(np.float32)}
        for _ in range(5)
    ]  # fmt: skip
    result = dj.train_sync(
        running_loss, PARAMS, steps, num_steps=5, num_workers=M, model_state=MODEL_STATE,
        eval_fn=lambda p, ms: {"avg0": ms["avg"][0]}, eval_every=2,
    )  # fmt: skip
    avg = np.zeros(3)
    for batch in steps:  # every worker starts each step from the merged mean
        avg = np.mean([0.9 * avg + 0.1 * batch["x"][m].mean(axis=0) for m in range(M)], axis=0)
    np.testing.assert_allclose(result.model_state["avg"], avg, rtol=1e-6, atol=1e-7)
    assert [("avg0" in h) for h in result.history] == [False, True, False, True, True]
    plain = dj.train_sync(linear_loss, PARAMS, steps, num_steps=5, num_workers=M)
    np.testing.assert_array_equal(result.params["w"], plain.params["w"])


def test_aux_metrics_with_a_model_state():
    def loss(params, model_state, batch):
        value, new = running_loss(params, model_state, batch)
        return value, (new, {"mean_y": jnp.mean(batch["y"])})

    rounds = _rounds()
    history = dj.train_diloco(
        loss, PARAMS, rounds, num_rounds=R, num_workers=M, inner_steps=H, has_aux=True,
        model_state=MODEL_STATE,
    ).history  # fmt: skip
    for batch, entry in zip(rounds, history, strict=True):
        np.testing.assert_allclose(
            entry["worker_mean_y"], np.asarray(batch["y"]).mean(axis=(1, 2)), rtol=1e-6
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(model_state_merge={"avg": "mean", "count": "mean"}), "model_state_merge 'mean'"),
        (dict(model_state_merge="median"), "model_state_merge rules must be one of"),
        (dict(model_state_merge={"avg": "mean"}), "model_state_merge must be one rule or"),
        (dict(model_state={"avg": [1.0, 2.0]}), "model_state leaves must be arrays"),
    ],
)
def test_bad_model_state_input_names_the_argument(kwargs, match):
    kwargs = {"model_state": MODEL_STATE, **kwargs}
    with pytest.raises(ValueError, match=match):
        dj.train_diloco(
            running_loss, PARAMS, _rounds(), num_rounds=R, num_workers=M, inner_steps=H, **kwargs
        )


def test_a_loss_fn_that_drops_the_model_state_is_a_clear_error():
    with pytest.raises(ValueError, match="loss_fn with a model_state must return"):
        dj.train_diloco(
            lambda p, ms, b: linear_loss(p, b), PARAMS, _rounds(), num_rounds=1, num_workers=M,
            inner_steps=H, model_state=MODEL_STATE,
        )  # fmt: skip
    with pytest.raises(ValueError, match="new model_state must keep every leaf's shape"):
        dj.train_diloco(
            lambda p, ms, b: (linear_loss(p, b), {**ms, "avg": ms["avg"][:2]}), PARAMS,
            _rounds(), num_rounds=1, num_workers=M, inner_steps=H, model_state=MODEL_STATE,
        )  # fmt: skip
    with pytest.raises(ValueError, match="model_state_merge needs a model_state"):
        dj.train_diloco(
            linear_loss, PARAMS, _rounds(), num_rounds=1, num_workers=M, inner_steps=H,
            model_state_merge="mean",
        )  # fmt: skip


def test_eval_every_counts_inner_steps_in_every_trainer():
    """H = 3, eval_every = 4: the first round ends at or past 4, 8, 12 steps are rounds 1, 2
    and 3 (ends 6, 9, 12), and the last round always."""
    rounds = _rounds(num_rounds=5)
    ev = lambda p: {"e": jnp.sum(p["w"])}  # noqa: E731
    history = dj.train_diloco(
        linear_loss, PARAMS, rounds, num_rounds=5, num_workers=M, inner_steps=H, eval_fn=ev,
        eval_every=4,
    ).history  # fmt: skip
    assert [("e" in h) for h in history] == [False, True, True, True, True]
    history = dj.train_diloco(
        linear_loss, PARAMS, rounds, num_rounds=5, num_workers=M, inner_steps=H, eval_fn=ev,
        eval_every=7,
    ).history  # fmt: skip
    assert [("e" in h) for h in history] == [False, False, True, False, True]  # 7 -> 9, 14 -> 15

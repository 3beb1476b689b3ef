"""The method spec `dj.DiLoCo`: each part refuses bad fields when built, naming the part and
the field; the keyword shorthand builds the same spec; the spec is a stable value; a state
is checked against the spec it runs with; the optimizers-only trainers refuse other parts."""

import inspect
import json
import pathlib

import jax
import numpy as np
import optax
import pytest
from reference import linear_loss, make_data

import diloco_jax as dj
from diloco_jax.method import SHORTHAND, method_from_options

PARAMS = {"w": np.zeros((3,), np.float32), "b": np.zeros((), np.float32)}
INNER, OUTER = optax.sgd(0.1), optax.sgd(0.7, momentum=0.9, nesterov=True)
M, H = 2, 4


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: dj.NormSoftmax(0.0), "NormSoftmax.temperature must be a finite number > 0"),
        (lambda: dj.NormSoftmax(-1.0), "NormSoftmax.temperature must be a finite number > 0"),
        (lambda: dj.NormSoftmax(float("nan")), "NormSoftmax.temperature"),
        (lambda: dj.NormSoftmax(float("inf")), "NormSoftmax.temperature"),
        (lambda: dj.Delayed(-1), r"Delayed.rounds \(outer_delay\) must be an integer >= 1"),
        (lambda: dj.Delayed(0), r"Delayed.rounds \(outer_delay\) must be >= 1"),
        (lambda: dj.Eager(3), r"Eager.rounds \(outer_delay\) must be at most 2"),
        (lambda: dj.Eager(True), r"Eager.rounds \(outer_delay\) must be an integer"),
        (lambda: dj.Streaming(0), "Streaming.fragments must be an int >= 1"),
        (lambda: dj.Streaming({"w": 0, "b": 2}), "Streaming.fragments indices must cover"),
        (lambda: dj.Streaming(2, overlap_steps=-1), "Streaming.overlap_steps must be an int"),
        (lambda: dj.Streaming(2, merge_alpha=1.5), r"Streaming.merge_alpha must be in \[0, 1\]"),
        (lambda: dj.Streaming(2, merge_alpha=float("nan")), "Streaming.merge_alpha"),
        (lambda: dj.Weights(drop_probability=2.0), r"Weights.drop_probability must be in"),
        (lambda: dj.Weights(drop_seed=-1), "Weights.drop_seed must be an integer >= 0"),
        (lambda: dj.Weights(worker_steps=[0, 2]), "Weights.worker_steps must be >= 1"),
        (lambda: dj.Weights(worker_steps=[1.5]), "Weights.worker_steps must be integers"),
        (lambda: dj.Weights(weighting="softmax"), "Weights.weighting must be"),
        (lambda: dj.Weights(anomaly="yes"), "Weights.anomaly must be an AnomalySkip"),
        (lambda: dj.Weights(exclude_nonfinite=1), "Weights.exclude_nonfinite must be a bool"),
        (lambda: dj.StateSync(mu=0), "StateSync.mu must be an integer >= 1"),
        (lambda: dj.StateSync(), "StateSync needs at least one field"),
        (lambda: dj.DiLoCo(compression="int8,top_k=3"), "top_k is only used by 'sparseloco'"),
        (lambda: dj.DiLoCo(compression="int9"), "compression: unknown kind"),
        (lambda: dj.DiLoCo(inner="adamw"), r"DiLoCo.inner \(inner_optimizer\) must be an optax"),
        (lambda: dj.DiLoCo(schedule=2), "DiLoCo.schedule must be a Streaming"),
        (lambda: dj.DiLoCo(delay=1), "DiLoCo.delay must be a Delayed"),
        (lambda: dj.DiLoCo(weights=None), "DiLoCo.weights must be a Weights"),
        (
            lambda: dj.DiLoCo(delay=dj.Eager(1), weights=dj.Weights(drop_probability=0.1)),
            "Eager can't be combined with Weights that leave a worker out or weigh it",
        ),
        (
            lambda: dj.DiLoCo(delay=dj.Eager(1), weights=dj.Weights(weighting=dj.NormSoftmax())),
            "Eager can't be combined",
        ),
    ],
)
def test_each_part_refuses_bad_fields_when_built(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(overlap_steps=1), "overlap_steps and merge_alpha need fragments"),
        (dict(merge_alpha=0.5), "overlap_steps and merge_alpha need fragments"),
        (dict(temperature=-1.0), "temperature applies to weighting='norm_softmax' only"),
        (dict(temperature=float("nan")), "temperature applies to weighting='norm_softmax'"),
        (dict(weighting="norm_softmax", temperature=-1.0), "NormSoftmax.temperature"),
        (dict(eager=True), r"Eager.rounds \(outer_delay\) must be >= 1"),
        (dict(outer_delay=-1), r"Delayed.rounds \(outer_delay\)"),
        (dict(eager="yes", outer_delay=1), "eager must be a bool"),
        (dict(outer_clip=0.0), r"max_norm \(outer_clip\) must be a number > 0"),
        (dict(state_sync={"mu": 0}), "StateSync.mu must be an integer >= 1"),
    ],
)
def test_shorthand_refusals_name_the_part(options, match):
    rounds = make_data(np.random.default_rng(0), 1, M, H)
    with pytest.raises(ValueError, match=match):
        dj.train_diloco(
            linear_loss, PARAMS, rounds, num_rounds=1, num_workers=M, inner_steps=H, **options
        )


def test_run_rules_that_need_params_or_h_name_the_field():
    rounds = make_data(np.random.default_rng(0), 1, M, H)
    run = dict(num_rounds=1, num_workers=M, inner_steps=H)
    cases = [
        (dj.DiLoCo(schedule=dj.Streaming(3)), "Streaming.fragments must be between 1 and"),
        (dj.DiLoCo(schedule=dj.Streaming(2, overlap_steps=2)), "Streaming.overlap_steps"),
        (dj.DiLoCo(weights=dj.Weights(worker_steps=(1, 2, 3))), "one entry per worker"),
        (dj.DiLoCo(weights=dj.Weights(worker_steps=(1, 5))), r"inner_steps=4\]"),
        (dj.DiLoCo(state_sync=dj.StateSync(momentum=2)), "StateSync field 'momentum'"),
    ]
    for method, match in cases:
        with pytest.raises(ValueError, match=match):
            dj.train_diloco(linear_loss, PARAMS, rounds, method=method, **run)


def test_method_and_shorthand_together_or_unknown_keywords_are_refused():
    rounds = make_data(np.random.default_rng(0), 1, M, H)
    run = dict(num_rounds=1, num_workers=M, inner_steps=H)
    with pytest.raises(ValueError, match="either method= or the keyword shorthand, not both"):
        dj.train_diloco(linear_loss, PARAMS, rounds, method=dj.DiLoCo(), fragments=2, **run)
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        dj.train_diloco(linear_loss, PARAMS, rounds, fragmnts=2, **run)
    with pytest.raises(ValueError, match="method must be a diloco_jax.DiLoCo"):
        dj.train_diloco(linear_loss, PARAMS, rounds, method={"fragments": 2}, **run)


@pytest.mark.parametrize(
    "shorthand, method",
    [
        (dict(fragments=2), dj.DiLoCo(schedule=dj.Streaming(2))),
        (dict(outer_delay=1, eager=True), dj.DiLoCo(delay=dj.Eager(1))),
        (dict(compression="int8"), dj.DiLoCo(compression="int8")),
        (
            dict(weighting="norm_softmax", temperature=0.5, drop_probability=0.5, drop_seed=3),
            dj.DiLoCo(
                weights=dj.Weights(drop_probability=0.5, drop_seed=3, weighting=dj.NormSoftmax(0.5))
            ),
        ),
        (dict(state_sync={"mu": 2}), dj.DiLoCo(state_sync=dj.StateSync(mu=2))),
        (dict(exclude_nonfinite=True), dj.DiLoCo()),  # the default, resolved
    ],
)
def test_shorthand_builds_the_same_spec_and_the_same_run(shorthand, method):
    assert method_from_options(None, shorthand, caller="test") == method
    rounds = make_data(np.random.default_rng(1), 3, M, H)
    run = dict(num_rounds=3, num_workers=M, inner_steps=H, backend="vmap")
    a = dj.train_diloco(linear_loss, PARAMS, rounds, **shorthand, **run)
    b = dj.train_diloco(linear_loss, PARAMS, rounds, method=method, **run)
    jax.tree.map(np.testing.assert_array_equal, a.state, b.state)
    assert a.history == b.history


def test_outer_clip_shorthand_is_the_chained_clip():
    rounds = make_data(np.random.default_rng(2), 3, M, H)
    run = dict(num_rounds=3, num_workers=M, inner_steps=H, backend="vmap")
    a = dj.train_diloco(linear_loss, PARAMS, rounds, outer_clip=0.01, **run)
    chained = optax.chain(dj.clip_outer_norm(0.01), dj.default_outer_optimizer())
    b = dj.train_diloco(linear_loss, PARAMS, rounds, method=dj.DiLoCo(outer=chained), **run)
    jax.tree.map(np.testing.assert_array_equal, a.params, b.params)


def test_a_spec_is_a_stable_value():
    a = dj.DiLoCo(
        schedule=dj.Streaming({"w": 0, "b": 1}, overlap_steps=1, merge_alpha=0.5),
        compression="int4,ef=1",
        weights=dj.Weights(worker_steps=[4, 2], weighting="steps"),
        delay=dj.Delayed(2),
        state_sync=dj.StateSync({"nu": 8}, mu=4),
    )
    b = dj.DiLoCo(
        schedule=dj.Streaming({"b": 1, "w": 0}, overlap_steps=1, merge_alpha=0.5),
        compression=dj.compression.parse_compression("int4,ef=1"),
        weights=dj.Weights(worker_steps=(4, 2), weighting="steps", exclude_nonfinite=False),
        delay=dj.Delayed(2),
        state_sync=dj.StateSync(mu=4, nu=8),
    )
    assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
    assert a != dj.DiLoCo() and dj.Delayed(1) != dj.Eager(1)
    assert repr(dj.DiLoCo()) == "DiLoCo()"
    assert repr(dj.DiLoCo(inner=INNER)) == "DiLoCo(inner=<optax>)"  # no addresses
    assert "0x" not in repr(a)
    assert json.loads(json.dumps(a.fingerprint())) == a.fingerprint()
    assert a.schedule.assignment == {"b": 1, "w": 0}


def test_a_checkpoint_follows_the_spec(tmp_path):
    rounds = make_data(np.random.default_rng(3), 4, M, H)
    run = dict(num_workers=M, inner_steps=H, backend="vmap", checkpoint_dir=tmp_path)
    method = dj.DiLoCo(schedule=dj.Streaming(2, overlap_steps=1))
    dj.train_diloco(linear_loss, PARAMS, rounds, num_rounds=2, method=method, **run)
    # The same spec through the shorthand resumes; another spec's run is refused.
    resumed = dj.train_diloco(
        linear_loss, PARAMS, rounds, num_rounds=4, fragments=2, overlap_steps=1, **run
    )
    full = dj.train_diloco(
        linear_loss, PARAMS, rounds, num_rounds=4, method=method, num_workers=M, inner_steps=H,
        backend="vmap",
    )  # fmt: skip
    jax.tree.map(np.testing.assert_array_equal, resumed.params, full.params)
    with pytest.raises(ValueError, match="fragments"):
        dj.train_diloco(linear_loss, PARAMS, rounds, num_rounds=4, fragments=2, **run)


def test_a_state_is_checked_against_its_method():
    state = dj.init_state(PARAMS, M, dj.DiLoCo(compression="int8,ef=1"))
    batch = make_data(np.random.default_rng(4), 1, M, H)[0]
    with pytest.raises(
        ValueError, match=r"state was built for another method.*\[\"parts\['compression'\]\"\]"
    ):
        dj.diloco_round(linear_loss, state, batch, dj.DiLoCo())
    with pytest.raises(ValueError, match=r"another number of workers \(3\)"):
        dj.diloco_round(linear_loss, state, make_data(np.random.default_rng(4), 1, 3, H)[0],
                        dj.DiLoCo(compression="int8,ef=1"))  # fmt: skip
    new, _ = dj.diloco_round(linear_loss, state, batch, dj.DiLoCo(compression="int8,ef=1"))
    assert int(new.round) == 1


def test_no_method_option_in_the_explicit_signatures():
    for fn in (dj.train_diloco, dj.diloco_round, dj.init_state):
        named = set(inspect.signature(fn).parameters)
        assert not named & set(SHORTHAND), (fn.__name__, named & set(SHORTHAND))
        assert "method" in named


def test_each_refusal_is_written_once():
    sources = "".join(p.read_text() for p in pathlib.Path(dj.__file__).parent.rglob("*.py"))
    for message in (
        "need fragments",
        "Eager can't be combined",
        "temperature applies to weighting",
        "NormSoftmax.temperature must be",
        "must be a multiple of the number of fragments",
        "Weights.drop_probability must be in",
        "is not one field of the inner optimizer state",
        "state was built for another method",
    ):
        assert sources.count(message) == 1, message


def test_round_wire_bytes_sum_the_parts_by_hand():
    # 4 float32 leaves' elements (w: 3, b: 1) = 16 bytes; M = 4: ring factor 2 (M-1)/M = 1.5.
    exact = dj.DiLoCo(weights=dj.Weights(exclude_nonfinite=False))
    assert exact.round_wire_bytes(PARAMS, 4) == 1.5 * 4 + 1.5 * 16  # loss + deltas
    weighted = dj.DiLoCo()  # exclusion on: the weight rides in the all-reduce
    assert weighted.round_wire_bytes(PARAMS, 4) == 1.5 * 4 + 1.5 * (16 + 4)
    softmax = dj.DiLoCo(weights=dj.Weights(weighting=dj.NormSoftmax(), exclude_nonfinite=False))
    assert softmax.round_wire_bytes(PARAMS, 4) == 1.5 * 4 + 1.5 * (16 + 4) + 1.5 * 4
    # Two fragments (w: 12 bytes, b: 4 bytes), each its own all-reduce.
    streamed = dj.DiLoCo(schedule=dj.Streaming(2), weights=dj.Weights(exclude_nonfinite=False))
    assert streamed.round_wire_bytes(PARAMS, 4) == 1.5 * 4 + 1.5 * 12 + 1.5 * 4
    assert exact.round_wire_bytes(PARAMS, 1) == 0


def test_train_sync_and_async_take_the_parts_that_apply():
    steps = [
        {k: v[:, h] for k, v in r.items()}
        for r in make_data(np.random.default_rng(5), 1, M, H)
        for h in range(H)
    ]  # noqa: E501
    a = dj.train_sync(linear_loss, PARAMS, steps, num_steps=H, num_workers=M, optimizer=INNER)
    b = dj.train_sync(
        linear_loss, PARAMS, steps, num_steps=H, num_workers=M, method=dj.DiLoCo(inner=INNER)
    )
    jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
    with pytest.raises(ValueError, match="train_sync takes DiLoCo.inner"):
        dj.train_sync(linear_loss, PARAMS, steps, num_steps=H, num_workers=M,
                      method=dj.DiLoCo(schedule=dj.Streaming(2)))  # fmt: skip
    with pytest.raises(ValueError, match="either optimizer= or method="):
        dj.train_sync(linear_loss, PARAMS, steps, num_steps=H, num_workers=M, optimizer=INNER,
                      method=dj.DiLoCo(inner=INNER))  # fmt: skip
    rounds = make_data(np.random.default_rng(6), 2, M, H)
    run = dict(num_workers=M, inner_steps=H, num_updates=2, step_seconds=(1.0, 1.0))
    x = dj.train_async(
        linear_loss, PARAMS, rounds, inner_optimizer=INNER, outer_optimizer=OUTER, **run
    )
    y = dj.train_async(
        linear_loss, PARAMS, rounds, method=dj.DiLoCo(inner=INNER, outer=OUTER), **run
    )
    jax.tree.map(np.testing.assert_array_equal, x.params, y.params)
    with pytest.raises(ValueError, match=r"train_async takes DiLoCo.inner and DiLoCo.outer only"):
        dj.train_async(linear_loss, PARAMS, rounds, method=dj.DiLoCo(compression="int8"), **run)

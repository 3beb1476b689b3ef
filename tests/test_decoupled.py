"""Decoupled DiLoCo (`train_async(..., server=dj.DecoupledDiLoCo(...))`): learners that never
wait and a syncer merging a quorum. Checked against a NumPy event simulation written here
from the paper's rules (Adam inner steps, token weights, RDA), its degenerate cases
(synchronous DiLoCo and Streaming DiLoCo), its schedule by hand, and its refusals."""

import math

import jax
import numpy as np
import optax
import pytest
from reference import linear_loss, make_data, np_adam, precision

import diloco_jax as dj
from diloco_jax import decoupled
from diloco_jax.decoupled import merge_weights, rda

INNER_LR, OUTER_LR, MOMENTUM = 0.05, 0.7, 0.9
W0, B0 = [0.3, -0.2, 0.1], 0.5


def _np_rda(deltas, weights):
    norms = [np.linalg.norm(d) for d in deltas]
    units = [d / n if n > 0 else np.zeros_like(d) for d, n in zip(deltas, norms, strict=True)]
    direction = sum(w * u for w, u in zip(weights, units, strict=True))
    length = np.linalg.norm(direction)
    radius = sum(w * n for w, n in zip(weights, norms, strict=True))
    return radius * direction / length if length > 0 else np.zeros_like(direction)


def _np_decoupled(rounds, seconds, h, p_count, quorum, grace, tokens, merge, num_syncs,
                  merge_times=None):  # fmt: skip
    """float64 Decoupled DiLoCo on the linear model [w0, w1, w2, b], stepped in time order:
    at each instant, learners first push, then the syncer merges, then learners take the
    broadcasts that reached them and start their next Adam step. Fragments follow the
    params' leaf order (b, w): with P = 2, b is fragment 0 and w fragment 1. `merge_times`
    ({(p, k): seconds}) sets syncs' merge times in place of the quorum and grace."""
    m_count, stride = len(seconds), h // p_count
    frags = [[3], [0, 1, 2]] if p_count == 2 else [[0, 1, 2, 3]]
    theta = np.array([*W0, B0], np.float64)
    params = [theta.copy() for _ in range(m_count)]
    adam = [(np.zeros(4), np.zeros(4)) for _ in range(m_count)]
    counts = [[0] * p_count for _ in range(m_count)]
    losses = [[] for _ in range(m_count)]
    velocity = [np.zeros(len(f)) for f in frags]
    inbox = [[] for _ in range(m_count)]
    merges = []
    for p in range(p_count):
        for k in range(num_syncs):
            step = k * h + (p + 1) * stride
            times = sorted(step * s for s in seconds)
            at = (merge_times or {}).get((p, k), times[quorum - 1] + grace)
            merges.append((at, p, k))
    merges = sorted(merges)[:num_syncs]
    horizon = merges[-1][0]
    events = [(t, 1, p, k) for t, p, k in merges]
    for m, s in enumerate(seconds):
        last = math.floor(horizon / s) + 1
        events += [(j * s, 0, m, j) for j in range(1, last + 1)]  # push point after step j
        events += [(j * s, 2, m, j) for j in range(last)]  # start of step j + 1
    pushes, out = {}, []
    for time, kind, a, b in sorted(events):
        if kind == 0:
            m, j = a, b
            for p in range(p_count):
                k, rest = divmod(j - (p + 1) * stride, h)
                if rest == 0 and k >= 0:
                    c = counts[m][p]
                    pushes.setdefault((p, k), {})[m] = (
                        params[m][frags[p]].copy(),
                        c,
                        np.mean(losses[m][-c:]),
                    )
        elif kind == 1:
            p, k = a, b
            got = pushes.get((p, k), {})
            merged = sorted(got)
            raw = [(got[m][1] * tokens[m]) ** 2 / got[m][1] for m in merged]
            weights = [w / sum(raw) for w in raw]
            deltas = [theta[frags[p]] - got[m][0] for m in merged]
            delta = sum(w * d for w, d in zip(weights, deltas, strict=True))
            if merge == "rda":  # per leaf: w by RDA, b (average_leaves) averaged
                w_at = [i for i, j in enumerate(frags[p]) if j < 3]
                if w_at:
                    delta[w_at] = _np_rda([d[w_at] for d in deltas], weights)
            velocity[p] = delta + MOMENTUM * velocity[p]
            theta[frags[p]] -= OUTER_LR * (delta + MOMENTUM * velocity[p])
            for m in range(m_count):
                inbox[m].append((time, p, theta[frags[p]].copy()))
            full = [0.0] * m_count
            for m, w in zip(merged, weights, strict=True):
                full[m] = w
            out.append((time, p, merged, full, np.mean([got[m][2] for m in merged])))
        else:
            m, j = a, b
            for _, p, values in [x for x in inbox[m] if x[0] <= time]:
                params[m][frags[p]] = values
                counts[m][p] = 0
            inbox[m] = [x for x in inbox[m] if x[0] > time]
            batch = rounds[j // h]
            x = batch["x"][m, j % h].astype(np.float64)
            y = batch["y"][m, j % h].astype(np.float64)
            err = x @ params[m][:3] + params[m][3] - y
            grad = np.append(x.T @ err / len(err), err.mean())
            losses[m].append(0.5 * np.mean(err**2))
            upd, mo, ve = np_adam(grad, *adam[m], j + 1, INNER_LR)
            adam[m] = (mo, ve)
            params[m] = params[m] + upd
            counts[m] = [c + 1 for c in counts[m]]
    return theta, out


def _params(dtype):
    return {"w": np.asarray(W0, dtype), "b": dtype(B0)}


def _run(rounds, seconds, h, num_syncs, dtype=np.float32, **spec):
    return dj.train_async(
        linear_loss, _params(dtype), rounds, num_workers=len(seconds), inner_steps=h,
        num_updates=num_syncs, step_seconds=seconds, inner_optimizer=optax.adam(INNER_LR),
        outer_optimizer=optax.sgd(OUTER_LR, momentum=MOMENTUM, nesterov=True),
        server=dj.DecoupledDiLoCo(**spec),
    )  # fmt: skip


REFERENCE_CASES = [
    # seconds, H, P, quorum, grace, tokens, merge
    ((1.0, 1.5, 4.0), 2, 1, 2, 0.0, (1.0, 1.0, 1.0), "average"),
    ((1.0, 1.5, 4.0), 4, 2, 2, 0.75, (1.0, 2.0, 1.0), "average"),
    ((0.5, 1.25, 1.0, 2.0), 2, 2, 1, 1.5, (2.0, 1.0, 1.0, 3.0), "rda"),
    ((1.0, 1.0, 3.0), 2, 1, 3, 0.0, (1.0, 1.0, 1.0), "rda"),
]


@pytest.mark.parametrize(("dtype", "tol"), [("float64", 1e-12), ("float32", 3e-5)])
@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_matches_the_numpy_reference(case, dtype, tol):
    seconds, h, p_count, quorum, grace, tokens, merge = case
    num_syncs = 7
    rounds = make_data(np.random.default_rng(3), 40, len(seconds), h)
    want, syncs = _np_decoupled(rounds, seconds, h, p_count, quorum, grace, tokens, merge,
                                num_syncs)  # fmt: skip
    spec = {"quorum": quorum, "grace_seconds": grace, "fragments": p_count, "merge": merge,
            "tokens_per_step": tokens}  # fmt: skip
    if merge == "rda":
        spec["average_leaves"] = ("'b'",)
    with precision(dtype):
        result = _run(rounds, seconds, h, num_syncs, np.dtype(dtype).type, **spec)
        got = np.append(np.asarray(result.params["w"]), result.params["b"])
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    hist = result.history
    assert [(x["time"], x["fragment"], x["merged"]) for x in hist] == [
        (t, p, merged) for t, p, merged, _, _ in syncs
    ]
    np.testing.assert_allclose([x["weights"] for x in hist], [s[3] for s in syncs], rtol=1e-12)
    np.testing.assert_allclose(
        [x["loss"] for x in hist], [s[4] for s in syncs], rtol=max(tol, 3e-6)
    )  # float32 losses
    lates = [len(seconds) - len(s[2]) for s in syncs]
    assert [x["late"] for x in hist] == lates
    assert hist[-1]["late_total"] == sum(lates)


def test_a_record_merging_a_sync_after_a_later_one_replays_to_the_reference():
    # A real run merges each sync once its quorum is in, so fragment 1's sync 0 (pushes after
    # step 4) can be merged after fragment 0's sync 1 (step 6), by when the replay has stepped
    # every learner past step 4: the pushes it merges are the ones made at step 4.
    seconds, h, num_syncs = (1.0, 1.5), 4, 4
    late = {(1, 0): 10.0}  # its pushes came at 4 s and 6 s; merged after sync (0, 1) at 9 s
    rounds = make_data(np.random.default_rng(5), 10, 2, h)
    want, syncs = _np_decoupled(rounds, seconds, h, 2, 2, 0.0, (1.0, 1.0), "average",
                                num_syncs, merge_times=late)  # fmt: skip
    assert [(p, t) for t, p, *_ in syncs] == [(0, 3.0), (0, 9.0), (1, 10.0), (1, 12.0)]
    merges, count = [], {0: 0, 1: 0}
    for u, (t, p, merged, _, _) in enumerate(syncs):
        k = count[p]
        count[p] += 1
        merges.append(decoupled.Merge(
            update=u, fragment=p, index=k, step=k * h + (p + 1) * h // 2, time=t,
            merged=tuple(merged), boundaries=tuple(math.ceil(t / s) for s in seconds),
            total_steps=0, pushes=((0, 0), (0, 0)),
        ))  # fmt: skip
    spec = dj.DecoupledDiLoCo(quorum=2, grace_seconds=0.0, fragments=2, merge="average")
    with precision("float64"):
        replay = dj.train_async(
            linear_loss, _params(np.float64), rounds, num_workers=2, inner_steps=h,
            num_updates=num_syncs, arrivals=merges, inner_optimizer=optax.adam(INNER_LR),
            outer_optimizer=optax.sgd(OUTER_LR, momentum=MOMENTUM, nesterov=True),
            server=spec,
        )  # fmt: skip
        got = np.append(np.asarray(replay.params["w"]), replay.params["b"])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # Control: merging fragment 1's sync 0 in its step order lands elsewhere.
    in_order, _ = _np_decoupled(rounds, seconds, h, 2, 2, 0.0, (1.0, 1.0), "average", num_syncs)
    assert not np.allclose(in_order, want, rtol=1e-6)


def _diloco(rounds, schedule=None):
    outer = optax.sgd(OUTER_LR, momentum=MOMENTUM, nesterov=True)
    return dj.train_diloco(
        linear_loss, _params(np.float32), rounds, num_rounds=len(rounds),
        num_workers=rounds[0]["x"].shape[0], inner_steps=rounds[0]["x"].shape[1],
        method=dj.DiLoCo(inner=optax.adam(INNER_LR), outer=outer, schedule=schedule),
        backend="vmap",
    )  # fmt: skip


def test_full_quorum_no_grace_equal_speeds_is_synchronous_diloco():
    m, h, r = 3, 3, 4
    rounds = make_data(np.random.default_rng(1), r, m, h)
    diloco = _diloco(rounds)
    result = _run(rounds, (0.25,) * m, h, r, quorum=m)
    for name in ("w", "b"):
        np.testing.assert_allclose(result.params[name], diloco.params[name], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
        [x["loss"] for x in result.history], [x["loss"] for x in diloco.history], rtol=1e-5
    )
    assert all(x["weights"] == pytest.approx([1 / 3] * 3) for x in result.history)
    assert [x["time"] for x in result.history] == [0.75 * (k + 1) for k in range(r)]
    assert [x["late"] for x in result.history] == [0] * r


def test_full_quorum_with_two_fragments_is_streaming_diloco():
    m, h, r = 2, 4, 3
    rounds = make_data(np.random.default_rng(2), r, m, h)
    streaming = _diloco(rounds, dj.Streaming(2))
    result = _run(rounds, (1.0,) * m, h, 2 * r, quorum=m, fragments=2)
    for name in ("w", "b"):
        np.testing.assert_allclose(
            result.params[name], streaming.params[name], rtol=1e-5, atol=1e-7
        )
    # b syncs after steps 2, 6, 10; w after 4, 8, 12.
    assert [(x["time"], x["fragment"]) for x in result.history] == [
        (2.0, 0), (4.0, 1), (6.0, 0), (8.0, 1), (10.0, 0), (12.0, 1)
    ]  # fmt: skip


def test_the_schedule_by_hand():
    # Step times (1, 1, 3) s, H = 2, quorum 2: sync k closes at 2 (k + 1) with learners 0
    # and 1; learner 2 pushes for sync k at 6 (k + 1), after it closed (late).
    spec = dj.DecoupledDiLoCo(quorum=2)
    syncs = spec.schedule((1.0, 1.0, 3.0), 2, 3)
    assert [(s.time, s.merged, s.step) for s in syncs] == [
        (2.0, (0, 1), 2), (4.0, (0, 1), 4), (6.0, (0, 1), 6)
    ]  # fmt: skip
    # Quorum 1 with a 4.5 s grace: sync 0 closes at 6.5 and takes learner 2's push at 6.
    syncs = dj.DecoupledDiLoCo(quorum=1, grace_seconds=4.5).schedule((1.0, 1.0, 3.0), 2, 2)
    assert [(s.time, s.merged) for s in syncs] == [(6.5, (0, 1, 2)), (8.5, (0, 1))]
    # Adaptive: pushes at 2, 4, 6; the quorum waited 4 - 2 = 2 s, all of tau s_q = 1 x 2 s:
    # no grace left.
    syncs = dj.DecoupledDiLoCo(quorum=2, adaptive_grace=0.5, overlap_steps=1).schedule(
        (1.0, 2.0, 3.0), 2, 1
    )
    assert [(s.time, s.merged) for s in syncs] == [(4.0 + 0.5 * (2.0 - 2.0), (0, 1))]
    syncs = dj.DecoupledDiLoCo(quorum=2, adaptive_grace=0.5, overlap_steps=1).schedule(
        (1.0, 1.5, 2.5), 2, 1
    )  # pushes at 2, 3, 5: wait 1, slack 1.5 - 1, grace 0.25
    assert [(s.time, s.merged) for s in syncs] == [(3.25, (0, 1))]


def test_weights_are_tokens_squared_over_steps():
    np.testing.assert_allclose(merge_weights([4, 6, 0], [2, 3, 0]), [8 / 20, 12 / 20, 0])
    # Equal speeds, tokens (1, 2, 3) per step: w ∝ c t^2 -> 1 : 4 : 9.
    rounds = make_data(np.random.default_rng(4), 2, 3, 2)
    result = _run(rounds, (1.0,) * 3, 2, 2, quorum=3, tokens_per_step=(1.0, 2.0, 3.0))
    assert result.history[0]["weights"] == pytest.approx([1 / 14, 4 / 14, 9 / 14])


def test_rda_keeps_the_mean_norm_and_the_mean_direction():
    d = np.array([[3.0, 0.0], [0.0, 1.0]], np.float32)
    got = np.asarray(rda(d, np.array([0.5, 0.5], np.float32)))
    np.testing.assert_allclose(got, 2.0 * np.array([1, 1]) / math.sqrt(2), rtol=1e-6)
    zeros = rda(np.zeros((2, 2), np.float32), np.array([0.5, 0.5], np.float32))
    np.testing.assert_allclose(np.asarray(zeros), [0, 0])


def test_bytes_count_every_push_late_ones_too():
    rounds = make_data(np.random.default_rng(5), 8, 3, 2)
    result = _run(rounds, (1.0, 1.0, 3.0), 2, 3, quorum=2)
    # Every push sends all 4 float32 params (16 B); by t = 6 learners 0 and 1 pushed 3 times,
    # learner 2 once (at 6, late for sync 0).
    assert result.history[-1]["worker_bytes"] == [48, 48, 16]
    assert [x["late"] for x in result.history] == [1, 1, 1]
    assert result.history[-1]["total_steps"] == 6 + 6 + 2


def test_same_inputs_give_bit_identical_results_and_leave_params_alone():
    rounds = make_data(np.random.default_rng(6), 10, 3, 2)
    params = _params(np.float32)
    before = {k: np.array(v, copy=True) for k, v in params.items()}
    a = _run(rounds, (1.0, 1.5, 4.0), 2, 5, quorum=2, grace_seconds=0.5)
    b = _run(rounds, (1.0, 1.5, 4.0), 2, 5, quorum=2, grace_seconds=0.5)
    for name in ("w", "b"):
        np.testing.assert_array_equal(a.params[name], b.params[name])
        np.testing.assert_array_equal(params[name], before[name])
    assert a.history == b.history


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"quorum": 0}, "DecoupledDiLoCo.quorum"),
        ({"grace_seconds": -1.0}, "DecoupledDiLoCo.grace_seconds"),
        ({"adaptive_grace": 1.5, "overlap_steps": 1}, "DecoupledDiLoCo.adaptive_grace"),
        ({"adaptive_grace": 0.5}, "overlap_steps >= 1"),
        ({"adaptive_grace": 0.5, "overlap_steps": 1, "grace_seconds": 1.0}, "not both"),
        ({"overlap_steps": 1}, "adaptive_grace"),
        ({"merge": "median"}, "DecoupledDiLoCo.merge"),
        ({"average_leaves": ("embed",)}, "merge='rda'"),
        ({"merge": "rda", "average_leaves": "embed"}, "DecoupledDiLoCo.average_leaves"),
        ({"tokens_per_step": (1.0, 0.0)}, "DecoupledDiLoCo.tokens_per_step"),
        ({"fragments": 0}, "DecoupledDiLoCo.fragments"),
    ],
)
def test_bad_fields_name_themselves(spec, message):
    with pytest.raises(ValueError, match=message):
        dj.DecoupledDiLoCo(**spec)


@pytest.mark.parametrize(
    ("spec", "options", "message"),
    [
        ({"quorum": 4}, {}, "at most num_workers"),
        ({"tokens_per_step": (1.0,)}, {}, "tokens_per_step must hold num_workers"),
        ({"fragments": 3}, {}, "Streaming.fragments must be between 1 and"),
        ({"fragments": 2}, {"inner_steps": 3}, "multiple of DecoupledDiLoCo.fragments"),
        ({}, {"dynamic_steps": True}, "dynamic_steps"),
        ({}, {"grace_seconds": 1.0}, "grace_seconds belongs to the single server"),
    ],
)
def test_run_level_refusals(spec, options, message):
    rounds = make_data(np.random.default_rng(0), 4, 3, options.get("inner_steps", 2))
    kwargs = {"num_workers": 3, "inner_steps": 2, "num_updates": 2,
              "step_seconds": (1.0, 1.0, 1.0), **options}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        dj.train_async(linear_loss, _params(np.float32), rounds,
                       server=dj.DecoupledDiLoCo(**spec), **kwargs)  # fmt: skip


def test_too_few_rounds_name_data():
    rounds = make_data(np.random.default_rng(0), 1, 2, 2)
    with pytest.raises(ValueError, match="data has 1 rounds"):
        _run(rounds, (1.0, 1.0), 2, 3, quorum=2)


def test_a_run_killed_and_resumed_from_its_checkpoint_equals_the_uninterrupted_run(tmp_path):
    """Checkpoints every 3 syncs; a crash after sync 7 resumes from the one after 6 (learners
    mid-way, broadcasts they have yet to apply, a slow learner's pushes late) and ends bit for
    bit as the run that never stopped, its history too; a finished run of 9 resumed for 14
    equals 14 at once; another spec's checkpoints are refused."""
    rounds = make_data(np.random.default_rng(5), 14, 3, 4)
    seconds = (1.0, 1.7, 4.2)
    spec = dict(quorum=2, grace_seconds=0.7, fragments=2, merge="rda",
                tokens_per_step=(1.0, 2.0, 1.5))  # fmt: skip

    def loss_with_aux(params, batch):
        loss = linear_loss(params, batch)
        return loss, {"half": loss / 2}

    def run(updates, server=None, **options):
        return dj.train_async(
            loss_with_aux, _params(np.float32), rounds, num_workers=3, inner_steps=4,
            num_updates=updates, step_seconds=seconds, inner_optimizer=optax.adam(INNER_LR),
            outer_optimizer=optax.sgd(OUTER_LR, momentum=MOMENTUM, nesterov=True),
            has_aux=True, eval_fn=lambda p: {"eval_loss": (p["w"] ** 2).sum()}, eval_every=3,
            server=server or dj.DecoupledDiLoCo(**spec), **options,
        )  # fmt: skip

    full = run(14)
    assert any(x["late"] for x in full.history)  # the slow learner misses syncs
    crash = tmp_path / "crash"

    def die_after_7(entry):
        if entry["update"] == 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(14, checkpoint_dir=crash, checkpoint_every=3, callback=die_after_7)
    assert dj.checkpoint.latest_step(crash) == 6
    resumed = run(14, checkpoint_dir=crash, checkpoint_every=3)
    jax.tree.map(np.testing.assert_array_equal, resumed.state, full.state)
    assert resumed.history == full.history
    assert (resumed.elapsed_seconds, resumed.utilization) == (
        full.elapsed_seconds, full.utilization,
    )  # fmt: skip
    longer = tmp_path / "longer"
    run(9, checkpoint_dir=longer, checkpoint_every=4)
    again = run(14, checkpoint_dir=longer, checkpoint_every=4)
    jax.tree.map(np.testing.assert_array_equal, again.state, full.state)
    assert again.history == full.history
    with pytest.raises(ValueError, match="checkpoint_dir"):  # another spec: another run
        run(14, server=dj.DecoupledDiLoCo(**{**spec, "quorum": 3}), checkpoint_dir=longer)

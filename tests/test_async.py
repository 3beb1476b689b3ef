"""train_async / async_schedule / dynamic_local_steps against hand-built schedules and NumPy
references written here, and against train_diloco where they must agree."""

import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import assert_cli_refuses, linear_loss, make_data

import diloco_jax as dj
from diloco_jax import async_train
from diloco_jax.lm.cli import main

# Step times (1, 2, 3) s and H = 2: jobs of 2, 4 and 6 s. Worker 0 arrives at 2, 4, 6, ...,
# worker 1 at 4, 8, 12, worker 2 at 6, 12. Ties share a window, applied in worker order,
# and everyone in it restarts from theta after the whole window.
# (worker, job, start_update, arrival time, staleness) of the first 11 server updates:
HAND_SCHEDULE = [
    (0, 0, 0, 2.0, 0),
    (0, 1, 1, 4.0, 0),
    (1, 0, 0, 4.0, 2),  # started at 0 from theta_0; updates 0 and 1 came in meanwhile
    (0, 2, 3, 6.0, 0),
    (2, 0, 0, 6.0, 4),
    (0, 3, 5, 8.0, 0),
    (1, 1, 3, 8.0, 3),  # restarted at t=4 after updates 0..2
    (0, 4, 7, 10.0, 0),
    (0, 5, 8, 12.0, 0),
    (1, 2, 7, 12.0, 2),
    (2, 1, 5, 12.0, 5),
]


def make_rounds(num_rounds, m, h, seed=0):
    return make_data(np.random.default_rng(seed), num_rounds, m, h)


PARAMS = {"w": np.array([0.1, -0.2, 0.3], np.float32), "b": np.float32(0.05)}


# ---------------------------------------------------------------------------- the schedule


def test_hand_built_schedule_order_times_and_staleness():
    schedule = dj.async_schedule((1.0, 2.0, 3.0), 2, len(HAND_SCHEDULE))
    got = [(e.worker, e.job, e.start_update, e.time, e.staleness) for e in schedule.events]
    assert got == HAND_SCHEDULE
    assert [e.update for e in schedule.events] == list(range(len(HAND_SCHEDULE)))
    assert all(e.steps == 2 for e in schedule.events)
    # Each job started when its worker's previous one arrived (no grace: at once).
    assert [e.start for e in schedule.events][:5] == [0.0, 2.0, 0.0, 4.0, 0.0]
    assert schedule.elapsed_seconds == 12.0
    assert schedule.utilization == 1.0  # nobody ever waits without a grace window


def test_grace_window_applies_its_arrivals_before_anyone_restarts():
    # grace 1.5: t=2 opens [2, 3.5] (w0 alone, restarts at 3.5, next arrival 5.5);
    # t=4 opens [4, 5.5]: w1 (4) then w0 (5.5), both restart at 5.5 (w1 -> 9.5, w0 -> 7.5);
    # t=6 opens [6, 7.5]: w2 (6) then w0 (7.5), both restart at 7.5.
    schedule = dj.async_schedule((1.0, 2.0, 3.0), 2, 5, grace_seconds=1.5)
    got = [(e.worker, e.start, e.time, e.start_update, e.staleness) for e in schedule.events]
    assert got == [
        (0, 0.0, 2.0, 0, 0),
        (1, 0.0, 4.0, 0, 1),
        (0, 3.5, 5.5, 1, 1),
        (2, 0.0, 6.0, 0, 3),
        (0, 5.5, 7.5, 3, 1),
    ]
    # Busy until 7.5: w0 2 + 2 + 2, w1 4 + 2 (from 5.5), w2 6 (restarts at 7.5) = 18 of 22.5.
    assert schedule.elapsed_seconds == 7.5
    assert schedule.utilization == pytest.approx(18 / 22.5, rel=1e-12)


def test_zero_updates_is_an_empty_schedule():
    schedule = dj.async_schedule((1.0, 2.0), 3, 0)
    assert schedule == dj.async_train.AsyncSchedule((), 0.0, 0.0)


@pytest.mark.parametrize(
    "seconds, h",
    [((0.58, 0.75, 1.51, 3.33), 25), ((0.58, 0.75, 1.51, 3.33), 50), ((3.0, 1.0, 2.0), 7)],
)
def test_dynamic_local_steps_match_numpy(seconds, h):
    v = 1.0 / np.asarray(seconds)
    want = np.maximum(1, np.floor(h * v / v.max())).astype(int)
    assert dj.dynamic_local_steps(seconds, h) == tuple(int(x) for x in want)


def test_dynamic_local_steps_by_hand():
    assert dj.dynamic_local_steps((1.0, 2.0, 3.0), 2) == (2, 1, 1)  # floor(2/3) = 0 -> 1
    assert dj.dynamic_local_steps((2.0, 2.0), 5) == (5, 5)
    assert dj.dynamic_local_steps((0.5, 100.0), 1) == (1, 1)
    # 39 x 0.1 / 1.3 is 3 exactly, 2.9999999999999996 in floats: counted as 3.
    assert dj.dynamic_local_steps((0.1, 1.3), 39) == (39, 3)


def test_dynamic_schedule_uses_the_dylu_step_counts():
    # (1, 2, 3) with H = 4: steps (4, 2, 1), jobs of 4, 4 and 3 s.
    schedule = dj.async_schedule((1.0, 2.0, 3.0), 4, 6, dynamic_steps=True)
    got = [(e.worker, e.steps, e.time) for e in schedule.events]
    assert got == [(2, 1, 3.0), (0, 4, 4.0), (1, 2, 4.0), (2, 1, 6.0), (0, 4, 8.0), (1, 2, 8.0)]


# ---------------------------------------------------------------------------- training


def reference_async(rounds, events, num_workers, steps):
    """NumPy float64 async DiLoCo on the linear model: inner SGD(0.1, momentum 0.5) whose
    trace stays with its worker, outer SGD(0.6, momentum 0.5); each event (worker, job,
    start_update) runs from theta after start_update updates."""
    thetas = [{k: np.asarray(v, np.float64) for k, v in PARAMS.items()}]
    traces = [{k: np.zeros_like(v) for k, v in thetas[0].items()} for _ in range(num_workers)]
    velocity = {k: np.zeros_like(v) for k, v in thetas[0].items()}
    losses = []
    for m, job, start_update, *_ in events:
        start = thetas[start_update]
        w, b = start["w"].copy(), start["b"].copy()
        t = traces[m]
        job_losses = []
        for h in range(steps):
            x = rounds[job]["x"][m, h].astype(np.float64)
            y = rounds[job]["y"][m, h].astype(np.float64)
            err = x @ w + b - y
            job_losses.append(0.5 * np.mean(err**2))
            grads = {"w": x.T @ err / len(y), "b": np.mean(err)}
            t = {k: grads[k] + 0.5 * t[k] for k in t}
            w, b = w - 0.1 * t["w"], b - 0.1 * t["b"]
        traces[m] = t
        losses.append(np.mean(job_losses))
        delta = {"w": start["w"] - w, "b": start["b"] - b}
        velocity = {k: delta[k] + 0.5 * velocity[k] for k in delta}
        thetas.append({k: thetas[-1][k] - 0.6 * velocity[k] for k in delta})
    return thetas, losses


def test_training_follows_the_hand_schedule_against_numpy():
    rounds = make_rounds(6, 3, 2)
    result = dj.train_async(
        linear_loss,
        PARAMS,
        rounds,
        num_workers=3,
        inner_steps=2,
        num_updates=len(HAND_SCHEDULE),
        step_seconds=(1.0, 2.0, 3.0),
        inner_optimizer=optax.sgd(0.1, momentum=0.5),
        outer_optimizer=optax.sgd(0.6, momentum=0.5),
    )
    thetas, losses = reference_async(rounds, HAND_SCHEDULE, 3, 2)
    for name in PARAMS:
        np.testing.assert_allclose(result.params[name], thetas[-1][name], rtol=1e-5, atol=1e-6)
    hist = result.history
    assert [(h["worker"], h["time"], h["staleness"]) for h in hist] == [
        (w, t, s) for w, _, _, t, s in HAND_SCHEDULE
    ]
    assert [h["update"] for h in hist] == list(range(11))
    np.testing.assert_allclose([h["loss"] for h in hist], losses, rtol=1e-5)
    assert [h["steps"] for h in hist] == [2] * 11
    assert [h["total_steps"] for h in hist] == [2 * (u + 1) for u in range(11)]
    # |theta| = 4 float32: 16 bytes per job, counted for the worker that sent it.
    assert hist[-1]["worker_bytes"] == [16 * 6, 16 * 3, 16 * 2]
    assert hist[-1]["bytes_communicated"] == round(16 * 11 / 3)
    assert hist[-1]["wire_bytes"] == hist[-1]["bytes_communicated"]
    assert hist[2]["worker_bytes"] == [32, 16, 0]
    assert result.elapsed_seconds == 12.0 and result.utilization == 1.0
    assert result.state.update == 11
    assert jax.tree.leaves(result.state.inner_opt_state)[0].shape[0] == 3


def diloco_and_async(data, m, h, r, grace, **async_kwargs):
    inner = optax.adam(0.05)
    diloco = dj.train_diloco(
        linear_loss,
        PARAMS,
        data,
        num_rounds=r,
        num_workers=m,
        inner_steps=h,
        inner_optimizer=inner,
        outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True),
        backend="vmap",
    )
    result = dj.train_async(
        linear_loss,
        PARAMS,
        data,
        num_workers=m,
        inner_steps=h,
        num_updates=m * r,
        step_seconds=(0.25,) * m,
        grace_seconds=grace,
        inner_optimizer=inner,
        outer_optimizer=dj.delayed_nesterov(0.7, 0.9, buffer_size=m, c=0.0),
        **async_kwargs,
    )
    return diloco, result


@pytest.mark.parametrize("grace", [0.0, 0.1])
def test_equal_speeds_with_delayed_nesterov_is_diloco(grace):
    m, h, r = 3, 3, 4
    diloco, result = diloco_and_async(make_rounds(r, m, h, seed=1), m, h, r, grace)
    for name in PARAMS:
        np.testing.assert_allclose(result.params[name], diloco.params[name], rtol=1e-5, atol=1e-7)
    for a, b in zip(
        jax.tree.leaves(result.state.inner_opt_state),
        jax.tree.leaves(diloco.state.inner_opt_state),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # Round k of DiLoCo is window k: the M workers in order, all from theta_k.
    hist = result.history
    assert [x["worker"] for x in hist] == list(range(m)) * r
    assert [x["staleness"] for x in hist] == list(range(m)) * r
    per_round = [np.mean([x["loss"] for x in hist[k * m : (k + 1) * m]]) for k in range(r)]
    np.testing.assert_allclose(per_round, [x["loss"] for x in diloco.history], rtol=1e-5)
    step = 3 * 0.25 + grace  # H steps, then the window closes
    assert [x["time"] for x in hist[::m]] == pytest.approx([k * step + 0.75 for k in range(r)])
    assert result.utilization == pytest.approx(0.75 * r / (0.75 * r + grace * (r - 1)))


def test_equal_speeds_with_a_sampler_is_diloco():
    m, h, r = 2, 3, 3
    rounds = make_rounds(r, m, h, seed=2)
    arrays = jax.tree.map(lambda *xs: jnp.stack(xs), *rounds)  # [R, M, H, ...]

    def sample(arrays, round_index, worker, step):
        return jax.tree.map(lambda x: x[round_index, worker, step], arrays)

    diloco, result = diloco_and_async(dj.Sampler(arrays, sample), m, h, r, grace=0.5)
    for name in PARAMS:
        np.testing.assert_allclose(result.params[name], diloco.params[name], rtol=1e-5, atol=1e-7)


def test_one_worker_with_outer_sgd_one_is_plain_optax_steps():
    h, u = 3, 4
    rounds = make_rounds(u, 1, h, seed=3)
    inner = optax.sgd(0.1, momentum=0.5)
    result = dj.train_async(
        linear_loss,
        PARAMS,
        rounds,
        num_workers=1,
        inner_steps=h,
        num_updates=u,
        step_seconds=(2.0,),
        inner_optimizer=inner,
        outer_optimizer=optax.sgd(1.0),
    )
    params = jax.tree.map(jnp.asarray, PARAMS)
    state = inner.init(params)
    for j in range(u):
        for s in range(h):
            batch = jax.tree.map(lambda x, j=j, s=s: x[0, s], rounds[j])
            grads = jax.grad(linear_loss)(params, batch)
            updates, state = inner.update(grads, state, params)
            params = optax.apply_updates(params, updates)
    for name in PARAMS:
        np.testing.assert_allclose(result.params[name], params[name], rtol=1e-6, atol=1e-7)
    assert [x["time"] for x in result.history] == [6.0, 12.0, 18.0, 24.0]
    assert all(x["staleness"] == 0 for x in result.history)


def test_zero_updates_returns_the_params_and_no_history():
    result = dj.train_async(
        linear_loss,
        PARAMS,
        [],
        num_workers=2,
        inner_steps=2,
        num_updates=0,
        step_seconds=(1.0, 2.0),
    )
    assert result.history == []
    for name in PARAMS:
        np.testing.assert_array_equal(result.params[name], PARAMS[name])
    assert result.elapsed_seconds == 0.0 and result.utilization == 0.0
    assert jax.tree.leaves(result.state.inner_opt_state)[0].shape[0] == 2


def test_dylu_is_deterministic_leaves_params_alone_and_compiles_once_per_job_length():
    def loss(params, batch):  # its own function: its own compilation cache
        return linear_loss(params, batch)

    params = {"w": jnp.asarray(PARAMS["w"]), "b": jnp.asarray(PARAMS["b"])}
    before = jax.tree.map(np.array, params)
    inner, outer = optax.adam(0.05), dj.delayed_nesterov(0.5, buffer_size=3, c=0.1)
    seen = []

    def run():
        return dj.train_async(
            loss,
            params,
            make_rounds(6, 3, 4, seed=4),
            num_workers=3,
            inner_steps=4,
            num_updates=10,
            step_seconds=(1.0, 2.0, 3.0),
            dynamic_steps=True,
            inner_optimizer=inner,
            outer_optimizer=outer,
            eval_fn=lambda p: {"eval_loss": jnp.sum(p["w"] ** 2)},
            eval_every=4,
            callback=seen.append,
        )

    a, b = run(), run()
    for name in params:
        np.testing.assert_array_equal(a.params[name], b.params[name])
        np.testing.assert_array_equal(params[name], before[name])
    assert a.history == b.history
    assert seen == a.history + b.history
    assert {x["steps"] for x in a.history} == {4, 2, 1}
    # eval_every = 4 steps per worker: the applied steps (1, 4, 2, 1, 4, ...: totals 1, 5, 7,
    # 8, 12, ...) first reach 3 x 4 = 12 at update 4, never 24; update 9 is the last.
    assert [x["update"] for x in a.history if "eval_loss" in x] == [4, 9]
    np.testing.assert_allclose(a.history[-1]["eval_loss"], np.sum(np.asarray(a.params["w"]) ** 2))
    run_job, _ = async_train._programs(loss, inner, outer)
    assert run_job._cache_size() == 3  # one program per job length: 4, 2 and 1 steps


@pytest.mark.parametrize("grace, every", [(0.0, 3), (1.5, 2)])
def test_resume_is_bit_identical_and_may_run_longer(grace, every, tmp_path):
    """A run of 8 updates checkpointed every `every`, resumed and asked for 12 (DyLU, Adam
    inner state, Delayed Nesterov's buffer, jobs in flight across the cut) equals 12 at once."""
    inner, outer = optax.adam(0.05), dj.delayed_nesterov(0.5, buffer_size=3, c=0.1)
    seen = []

    def run(num_updates, **options):
        return dj.train_async(
            linear_loss, PARAMS, make_rounds(8, 3, 4, seed=5), num_workers=3, inner_steps=4,
            num_updates=num_updates, step_seconds=(1.0, 1.7, 3.0), grace_seconds=grace,
            dynamic_steps=True, inner_optimizer=inner, outer_optimizer=outer,
            eval_fn=lambda p: {"eval_loss": jnp.sum(p["w"] ** 2)}, eval_every=2, **options,
        )  # fmt: skip

    full = run(12)
    # Some job that runs across the cut after update 8 started before it.
    assert any(e["update"] >= 8 and e["update"] - e["staleness"] < 8 for e in full.history)
    run(8, checkpoint_dir=tmp_path, checkpoint_every=every)
    assert dj.checkpoint.latest_step(tmp_path) == 8
    resumed = run(12, checkpoint_dir=tmp_path, checkpoint_every=every, callback=seen.append)
    jax.tree.map(np.testing.assert_array_equal, resumed.state, full.state)
    # The 8-update run evaluated after its last update (7); the 12-update one did not (its
    # steps reach a multiple of M x eval_every = 6 at updates 2, 5, 8, 10).
    cut = dict(resumed.history[7])
    assert "eval_loss" in cut and "eval_loss" not in full.history[7]
    del cut["eval_loss"]
    assert [*resumed.history[:7], cut, *resumed.history[8:]] == full.history
    assert seen == full.history[8:]
    assert [e["update"] for e in full.history if "eval_loss" in e] == [2, 5, 8, 10, 11]
    assert (resumed.elapsed_seconds, resumed.utilization) == (
        full.elapsed_seconds,
        full.utilization,
    )
    with pytest.raises(ValueError, match="more than the num_updates = 5"):
        run(5, checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="step_seconds"):  # another schedule: another run
        dj.train_async(
            linear_loss, PARAMS, make_rounds(8, 3, 4, seed=5), num_workers=3, inner_steps=4,
            num_updates=12, step_seconds=(1.0, 1.0, 3.0), checkpoint_dir=tmp_path,
        )  # fmt: skip


# ---------------------------------------------------------------------------- bad input


def call(**overrides):
    kwargs = (
        dict(
            num_workers=3,
            inner_steps=2,
            num_updates=4,
            step_seconds=(1.0, 2.0, 3.0),
        )
        | overrides
    )
    data = kwargs.pop("data", make_rounds(4, 3, 2))
    return dj.train_async(linear_loss, PARAMS, data, **kwargs)


@pytest.mark.parametrize(
    "overrides, name",
    [
        (dict(step_seconds=(1.0, 2.0)), "step_seconds"),
        (dict(step_seconds=(1.0, 2.0, 3.0, 4.0)), "step_seconds"),
        (dict(step_seconds=(1.0, 0.0, 3.0)), "step_seconds"),
        (dict(step_seconds=(1.0, -2.0, 3.0)), "step_seconds"),
        (dict(step_seconds=(1.0, math.nan, 3.0)), "step_seconds"),
        (dict(step_seconds=(1.0, math.inf, 3.0)), "step_seconds"),
        (dict(step_seconds=("1", "2", "3")), "step_seconds"),
        (dict(step_seconds=2.0), "step_seconds"),
        (dict(num_updates=-1), "num_updates"),
        (dict(num_updates=2.0), "num_updates"),
        (dict(grace_seconds=-0.5), "grace_seconds"),
        (dict(grace_seconds=math.nan), "grace_seconds"),
        (dict(inner_steps=0), "inner_steps"),
        (dict(num_workers=0, step_seconds=()), "num_workers"),
        (dict(eval_every=0), "eval_every"),
        (dict(dynamic_steps="yes"), "dynamic_steps"),
        (dict(backend="pmap"), "backend"),
        (dict(data=make_rounds(1, 3, 2)), "data"),  # 4 updates need 2 jobs of worker 0
        (dict(data=make_rounds(4, 3, 3)), "data"),  # H = 3 rounds for inner_steps = 2
        (dict(data=object()), "data"),
        (dict(inner_optimizer="adam"), "inner_optimizer"),
    ],
)
def test_bad_input_names_the_argument(overrides, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        call(**overrides)


@pytest.mark.parametrize(
    "args, name",
    [
        (((1.0, 0.0), 2, 3), "step_seconds"),
        (((), 2, 3), "step_seconds"),
        (((1.0,), 0, 3), "inner_steps"),
        (((1.0,), 2, -1), "num_updates"),
    ],
)
def test_schedule_bad_input_names_the_argument(args, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        dj.async_schedule(*args)
    with pytest.raises(ValueError, match="^grace_seconds"):
        dj.async_schedule((1.0,), 2, 3, grace_seconds=-1.0)


# ---------------------------------------------------------------------------- LM and CLI

TEXT = "".join(
    f"Paragraph {i}: the quick brown fox jumps over the lazy dog.\n\n" for i in range(400)
)


def _async_cli(tmp_path):
    """(argv of a micro async run of M = 2, H = 3, R = 2 at (1, 2) s per step into
    tmp_path/run, the run folder)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 3)
    out = tmp_path / "run"
    argv = ["train", "--preset", "micro", "--algo", "async", "--data", f"text:{corpus}"]
    argv += ["--workers", "2", "--inner-steps", "3", "--rounds", "2", "--step-seconds", "1,2"]
    return [*argv, "--no-progress", "--out", str(out)], out


def _async_records(out):
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["run"] == "async"]


@pytest.mark.slow
def test_cli_async_run_takes_diloco_total_steps(tmp_path, capsys):
    argv, out = _async_cli(tmp_path)
    argv += ["--dynamic-steps", "--outer-optimizer", "delayed_nesterov", "--dn-c", "0.1"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    runs = _async_records(out)
    # DyLU at (1, 2) s per step with H = 3: jobs of 3 and 1 steps; the run stops at the
    # first update that reaches DiLoCo's 2 x 3 x 2 = 12 inner steps.
    assert summary["job_steps"] == [3, 1]
    assert runs[-1]["total_steps"] >= 12 > runs[-2]["total_steps"]
    assert summary["steps_per_worker"] == runs[-1]["total_steps"] / 2
    assert summary["communication_rounds"] == len(runs)
    assert summary["simulated_seconds"] == runs[-1]["time"]
    assert [r["update"] for r in runs if "eval_loss" in r][-1] == len(runs) - 1
    assert summary["outer"] == "delayed_nesterov 0.7" and summary["utilization"] == 1.0
    assert "async: eval loss" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize(
    "server",
    [[], ["--server", "halos,regions=0/1,local_updates=1"],
     ["--server", "decoupled,quorum=1,grace_seconds=0.5"]],
    ids=["one", "halos", "decoupled"],
)  # fmt: skip
def test_cli_async_run_resumes_from_its_checkpoint(tmp_path, capsys, server):
    argv, out = _async_cli(tmp_path)
    argv += ["--checkpoint-every", "1", *server]
    assert main(argv) == 0
    straight = _async_records(out)
    # A crash before the last checkpoint: every round (M = 2 updates) was saved; drop the last.
    run_dir = out / "checkpoints" / "run"
    steps = dj.checkpoint.all_steps(run_dir)
    assert steps[0] == 2 and len(steps) >= 2
    assert all(b - a <= 2 for a, b in itertools.pairwise(steps))  # every round (M updates)
    dj.checkpoint.discard_after(run_dir, steps[-2])
    assert main(argv) == 0
    resumed = _async_records(out)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert resumed[-1]["eval_loss"] == straight[-1]["eval_loss"]
    # Resumed, not run again: the updates before the cut keep their first run's wall clock.
    cut = steps[-2]
    assert [r["wall_seconds"] for r in resumed[:cut]] == [r["wall_seconds"] for r in straight[:cut]]
    assert resumed[cut]["wall_seconds"] != straight[cut]["wall_seconds"]
    # Another --rounds is another learning-rate schedule: not a resume of these checkpoints.
    assert_cli_refuses(
        [*argv, "--rounds", "3"], "holds checkpoints of another run (rounds 2 -> 3)", capsys
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--algo", "async", "--step-seconds", "1,x"], "--step-seconds"),
        (["--algo", "diloco", "--step-seconds", "1,2"], "need --algo async"),
        (["--dynamic-steps"], "need --algo async"),
        (["--algo", "async", "--step-seconds", "1,2,3"], "step_seconds"),
        (["--algo", "async", "--step-seconds", "1,0"], "step_seconds"),
        (["--algo", "async", "--dn-c", "0.1"], "dn_buffer and dn_c"),
        (["--algo", "async", "--backend", "pmap"], "--backend"),
        (["--algo", "async", "--checkpoint-every", "0"], "--checkpoint-every"),
        # --server: train_async's other servers, "NAME[,field=value...]", async only.
        (["--algo", "diloco", "--server", "halos,regions=0/1"], "need --algo async"),
        (["--algo", "async", "--server", "nope"], "server must start with one of"),
        (["--algo", "async", "--server", "halos"], "server halos needs regions="),
        (["--algo", "async", "--server", "halos,regions=0/0/1"], "hold num_workers = 2 regions"),
        (["--algo", "async", "--server", "halos,regions=0/1,local_updates=0"], "local_updates"),
        (["--algo", "async", "--server", "decoupled,quorum=3"], "quorum must be at most"),
        (["--algo", "async", "--server", "decoupled,speed=3"], "takes field=value items"),
        (["--algo", "async", "--server", "decoupled,quorum=x"], "server field quorum"),
        (["--algo", "async", "--server", "decoupled,quorum=1,quorum=2"], "'quorum' twice"),
        (["--algo", "async", "--server", "decoupled", "--dynamic-steps"], "never stop"),
        # CGAD / Adam-Decay: their gate's fields, only with them, and an age to gate.
        (["--outer-optimizer", "cgad", "--age-decay", "0.1", "--age-cutoff", "4"], "is 0 without"),
        (["--algo", "async", "--outer-optimizer", "cgad", "--age-decay", "0.1"], "age_cutoff"),
        (["--algo", "async", "--outer-optimizer", "adam_decay"], "needs age_decay"),
        (["--algo", "async", "--age-decay", "0.1"], "age_decay applies to"),
        (
            ["--algo", "async", "--outer-optimizer", "adam_decay", "--age-decay", "-1"],
            "age_decay must be a finite number >= 0",
        ),
        (
            ["--algo", "async", "--outer-optimizer", "adam_decay", "--age-decay", "1"]
            + ["--age-cutoff", "3"],
            "age_cutoff applies to outer_optimizer 'cgad' only",
        ),
    ],
)
def test_cli_async_mistakes_are_one_line_exit_2(argv, message, tmp_path, capsys):
    out = tmp_path / "never"
    argv = ["train", "--preset", "micro", *argv, "--out", str(out)]
    assert_cli_refuses(argv, message, capsys, out)


@pytest.mark.parametrize(
    "server, check",
    [
        # HALoS: worker m's arrivals go to its region's LPS, every one pushed (K = 1).
        pytest.param(
            "halos,regions=1/0,local_updates=1",
            lambda r: r["region"] == 1 - r["worker"],
            marks=pytest.mark.slow,
        ),
        # Decoupled DiLoCo, K = 1, no grace: the faster learner (1 s a step) alone each sync.
        ("decoupled,quorum=1", lambda r: r["merged"] == [0] and r["late"] == 1),
    ],
)
def test_cli_async_runs_the_server_it_is_given(server, check, tmp_path):
    argv, out = _async_cli(tmp_path)
    assert main([*argv, "--server", server]) == 0
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text())["config"]
    assert summary["server"] == config["server"] == server
    runs = _async_records(out)
    assert runs and all(check(r) for r in runs)
    assert math.isfinite(summary["final_eval_loss"])


def test_cli_async_run_with_cgad_gates_by_staleness(tmp_path):
    argv, out = _async_cli(tmp_path)
    argv += ["--outer-optimizer", "cgad", "--age-decay", "0.1", "--age-cutoff", "4"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outer"] == "cgad 0.001 (age decay 0.1, cutoff 4)"
    # At (1, 2) s per step the slow worker's jobs arrive stale: the gate has ages to read.
    assert max(r["staleness"] for r in _async_records(out)) >= 1
    assert math.isfinite(summary["final_eval_loss"])


@pytest.mark.parametrize(
    "text, want",
    [
        (
            "halos,regions=0/0/1/1,local_updates=2,merge_weight=0.5,worker_seconds=0.1,"
            "region_seconds=0.05/0.2",
            dj.HALoS((0, 0, 1, 1), 2, 0.5, worker_seconds=0.1, region_seconds=(0.05, 0.2)),
        ),
        ("halos,regions=1/0/0/1,region_seconds=3", dj.HALoS((1, 0, 0, 1), region_seconds=3.0)),
        (
            "decoupled,quorum=2,grace_seconds=1.5,fragments=5,merge=rda,"
            "average_leaves=embed/norm,tokens_per_step=1/1/2/2",
            dj.DecoupledDiLoCo(
                2,
                1.5,
                fragments=5,
                merge="rda",
                average_leaves=("embed", "norm"),
                tokens_per_step=(1.0, 1.0, 2.0, 2.0),
            ),  # fmt: skip
        ),
        (
            "decoupled, adaptive_grace = 0.5, overlap_steps = 2",
            dj.DecoupledDiLoCo(adaptive_grace=0.5, overlap_steps=2),
        ),
        ("decoupled", dj.DecoupledDiLoCo()),
    ],
)
def test_a_server_text_reads_as_its_part_field_by_field(text, want):
    from diloco_jax.lm.config import make_config, server_of

    assert server_of(make_config("quick", server=text)) == want


@pytest.mark.parametrize("algo", ["diloco", "sync"])
def test_the_lm_apps_run_refuses_a_server_it_would_not_use(algo):
    from diloco_jax.lm import experiment
    from diloco_jax.lm.config import ConfigError, make_config

    cfg = make_config("micro", server="decoupled", inner_steps=3, rounds=2)
    corpus = experiment.load_corpus(cfg)
    with pytest.raises(ConfigError, match="it needs algo 'async'"):
        experiment.run(cfg, corpus, algo, 2)

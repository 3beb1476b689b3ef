"""Asynchronous DiLoCo's syncer (`diloco_jax.arrival_syncer.ArrivalSyncer`), called in one
process as the gRPC service calls it: each delta applied the moment it arrives with its age
(against NumPy), the arrival log and its replay by `train_async(arrivals=...)`, DyLU's step
counts from measured speeds, late and removed workers, a restart that takes a job handed out
before its checkpoint, and the refusals of the task and of a log that can't be replayed."""

import dataclasses
import json
import time

import jax
import numpy as np
import optax
import pytest
from elastic_linear import INNER_STEPS, PARAMS, batch, make_task
from reference import linear_loss

import diloco_jax as dj
from diloco_jax.arrival_syncer import ArrivalSyncer, make_syncer
from diloco_jax.async_train import AsyncEvent
from diloco_jax.elastic import arrivals
from diloco_jax.elastic_task import Elastic
from diloco_jax.syncer import Syncer

LR = 0.5


def aged_sgd(lr):
    """θ ← θ - lr Δ / (1 + age): an outer rule whose step shows the age it was given."""

    def update(updates, state, params=None, *, age=0, **extra):
        return jax.tree.map(lambda g: -lr * g / (1 + age), updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def _task(workers=3, updates=6, outer=None, **fields):
    task = make_task()
    method = dj.DiLoCo(inner=task.method.inner, outer=outer or aged_sgd(LR))
    return dataclasses.replace(task, num_workers=workers, num_rounds=updates, method=method,
                               algo="async", **fields)  # fmt: skip


def _syncer(tmp_path, task=None, **options):
    defaults = dict(heartbeat_interval=0.05, heartbeat_timeout=0.3)
    return ArrivalSyncer(task or _task(), Elastic(**{**defaults, **options}), tmp_path)


def _delta(value):
    return [np.float32(value), np.full(3, value, np.float32)]  # leaves of {"b", "w"}


def _theta(s):
    return np.r_[s.theta["b"], s.theta["w"]].astype(np.float64)


def test_each_delta_is_applied_as_it_arrives_with_its_age(tmp_path):
    s = _syncer(tmp_path)
    inc = [s.join(m, None)["incarnation"] for m in range(3)]
    jobs = {m: s.next_round(m, inc[m], -1, 0.1) for m in (0, 1)}
    assert [jobs[m]["steps"] for m in (0, 1)] == [INNER_STEPS] * 2
    assert s.push(0, inc[0], jobs[0]["serial"], _delta(0.1), 1.0)["status"] == "ok"  # age 0
    jobs[2] = s.next_round(2, inc[2], -1, 0.1)  # starts after update 0
    assert s.push(1, inc[1], jobs[1]["serial"], _delta(0.2), 2.0)["status"] == "ok"  # age 1
    np.testing.assert_array_equal(jobs[2]["theta"][0], np.float32(PARAMS["b"] - LR * 0.1))
    again = s.next_round(0, inc[0], -1, 0.1)  # worker 0's second job, position 1
    assert again["position"] == 1 and again["round"] == 1
    assert s.push(2, inc[2], jobs[2]["serial"], _delta(0.4), 3.0)["status"] == "ok"  # age 1
    assert s.push(0, inc[0], again["serial"], _delta(-0.3), 4.0)["status"] == "ok"  # age 1
    theta = np.r_[PARAMS["b"], PARAMS["w"]].astype(np.float64)
    for value, age in ((0.1, 0), (0.2, 1), (0.4, 1), (-0.3, 1)):
        theta = theta - LR * value / (1 + age)
    np.testing.assert_allclose(_theta(s), theta, rtol=1e-6)
    lines = [json.loads(x) for x in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert [(x["worker"], x["position"], x["start_update"], x["staleness"]) for x in lines] == [
        (0, 0, 0, 0), (1, 0, 0, 1), (2, 0, 1, 1), (0, 1, 2, 1)
    ]  # fmt: skip
    assert lines[-1]["positions"] == [2, 1, 1] and s.positions == [2, 1, 1]
    events = arrivals(tmp_path)
    assert [(e.update, e.worker, e.job, e.steps, e.start_update, e.staleness) for e in events] == [
        (0, 0, 0, 3, 0, 0), (1, 1, 0, 3, 0, 1), (2, 2, 0, 3, 1, 1), (3, 0, 1, 3, 2, 1)
    ]  # fmt: skip
    assert all(e.start <= e.time for e in events)


def test_the_log_replays_on_the_simulated_clock(tmp_path):
    """Workers that really run their phases (elastic_linear's batches, AdamW) against the
    syncer in an interleaving of their own: train_async replaying the log lands on the
    syncer's θ, with Delayed Nesterov reading the ages."""
    outer = dj.delayed_nesterov(0.6, 0.5, buffer_size=2)
    task = _task(updates=7, outer=outer)
    s = _syncer(tmp_path, task)
    inc = [s.join(m, None)["incarnation"] for m in range(3)]
    optimizer = task.method.inner_optimizer
    states = [optimizer.init(PARAMS) for _ in range(3)]

    def run(m):
        job = s.next_round(m, inc[m], -1, 0.1)
        theta = {"b": job["theta"][0], "w": job["theta"][1]}
        params, state = theta, states[m]
        for h in range(job["steps"]):
            step = {k: v[h] for k, v in batch(m, job["position"]).items()}
            grads = jax.grad(linear_loss)(params, step)
            updates, state = optimizer.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        states[m] = state
        delta = jax.tree.map(lambda a, b: np.asarray(a - b), theta, params)
        return job["serial"], [delta["b"], delta["w"]]

    held = {m: run(m) for m in range(3)}
    for m in (1, 0, 0, 2, 1, 0, 2):  # pushes in this order, each worker then runs again
        serial, leaves = held[m]
        assert s.push(m, inc[m], serial, leaves, 0.0)["status"] == "ok"
        if s.done is None:
            held[m] = run(m)
    assert s.done == "finished"
    # Workers in the middle of a job hear the end in a heartbeat; the syncer waits for that.
    assert not s.all_told()
    assert [s.heartbeat(m, inc[m])["status"] for m in range(3)] == ["done"] * 3
    assert s.all_told()
    rounds = [
        jax.tree.map(lambda *x: np.stack(x), *(batch(m, j) for m in range(3))) for j in range(4)
    ]
    replay = dj.train_async(
        linear_loss, PARAMS, rounds, num_workers=3, inner_steps=INNER_STEPS, num_updates=7,
        arrivals=arrivals(tmp_path), inner_optimizer=task.method.inner, outer_optimizer=outer,
    )  # fmt: skip
    for name in ("w", "b"):
        np.testing.assert_allclose(replay.params[name], s.theta[name], rtol=1e-6, atol=1e-7)
    # By hand: every worker starts at 0; each push sends its worker on from the θ after it.
    assert [x["staleness"] for x in replay.history] == [0, 1, 0, 3, 3, 2, 2]


def test_dylu_steps_follow_the_measured_speeds(tmp_path):
    s = _syncer(tmp_path, _task(dynamic_steps=True))
    inc = [s.join(m, None)["incarnation"] for m in range(3)]
    jobs = {m: s.next_round(m, inc[m], -1, 0.1) for m in range(3)}
    # Worker 0 takes 0.1 s a step, worker 1 0.25 s: v = 10 and 4 steps/s.
    s.push(0, inc[0], jobs[0]["serial"], _delta(0.0), 0.0, compute_s=1.0, steps_s=0.3)
    s.push(1, inc[1], jobs[1]["serial"], _delta(0.0), 0.0, compute_s=1.0, steps_s=0.75)
    steps = [s.next_round(m, inc[m], -1, 0.1)["steps"] for m in range(3)]
    assert steps == [3, 1, 3]  # floor(3 x 4 / 10) = 1; worker 2 not measured yet: H
    # One fast phase among slow ones leaves worker 1's count: the median of its last phases.
    for per_step in (0.25, 0.1):
        job = s.next_round(1, inc[1], -1, 0.1)
        s.push(1, inc[1], job["serial"], _delta(0.0), 0.0, steps_s=per_step * job["steps"])
    assert s.next_round(1, inc[1], -1, 0.1)["steps"] == 1  # median(0.25, 0.25, 0.1) = 0.25


def test_late_and_removed_workers_are_not_applied(tmp_path):
    s = _syncer(tmp_path)
    inc = [s.join(m, None)["incarnation"] for m in range(3)]
    first = s.next_round(0, inc[0], -1, 0.1)
    second = s.next_round(0, inc[0], -1, 0.1)  # asked again: the first job is gone
    assert s.push(0, inc[0], first["serial"], _delta(0.1), 0.0)["status"] == "late"
    assert s.push(0, inc[0], second["serial"], _delta(0.1), 0.0)["status"] == "ok"
    assert s.push(0, inc[0], second["serial"], _delta(0.1), 0.0)["status"] == "late"
    job = s.next_round(1, inc[1], -1, 0.1)
    time.sleep(0.35)
    s.heartbeat(0, inc[0])
    s.heartbeat(2, inc[2])
    s.tick()  # worker 1 silent past the heartbeat timeout: removed, its job dropped
    assert 1 not in s.members and 1 not in s.rule.jobs
    assert s.push(1, inc[1], job["serial"], _delta(5.0), 0.0)["status"] == "rejoin"
    assert s.round == 1 and s.positions == [1, 0, 0]
    nan = s.next_round(2, inc[2], -1, 0.1)
    assert s.push(2, inc[2], nan["serial"], _delta(np.nan), 0.0)["status"] == "ok"
    assert s.round == 1 and s.positions == [1, 0, 0]  # left out; position 0 runs again


def test_a_job_outlasting_the_round_timeout_removes_its_worker(tmp_path):
    s = _syncer(tmp_path, round_timeout=0.2)
    inc = [s.join(m, None)["incarnation"] for m in range(3)]
    s.next_round(2, inc[2], -1, 0.1)
    for _ in range(6):
        time.sleep(0.05)
        for m in range(3):
            s.heartbeat(m, inc[m])
        s.tick()
    assert 2 not in s.members and set(s.members) == {0, 1}


def test_a_restarted_syncer_takes_a_job_handed_out_before_its_checkpoint(tmp_path):
    s = _syncer(tmp_path)
    inc = [s.join(m, None)["incarnation"] for m in range(3)]
    held = s.next_round(1, inc[1], -1, 0.1)
    job = s.next_round(0, inc[0], -1, 0.1)
    s.push(0, inc[0], job["serial"], _delta(0.1), 0.0)  # update 0, checkpointed
    after = s.next_round(0, inc[0], -1, 0.1)  # handed out after the checkpoint: lost
    s.flush()
    again = _syncer(tmp_path)
    assert again.round == 1 and again.positions == [1, 0, 0]
    assert again.push(1, inc[1], held["serial"], _delta(0.2), 0.0)["status"] == "ok"
    assert again.push(0, inc[0], after["serial"], _delta(0.3), 0.0)["status"] == "late"
    theta = np.r_[PARAMS["b"], PARAMS["w"]] - LR * 0.1 - LR * 0.2 / 2  # age 1
    np.testing.assert_allclose(_theta(again), theta, rtol=1e-6)


def test_the_task_picks_its_syncer_and_refuses_what_async_cant_replay(tmp_path):
    options = Elastic(heartbeat_interval=0.05, heartbeat_timeout=0.3)
    assert type(make_syncer(make_task(), options, tmp_path / "a")) is Syncer
    assert type(make_syncer(_task(), options, tmp_path / "b")) is ArrivalSyncer
    task = make_task()
    with pytest.raises(ValueError, match="ElasticTask.algo must be one of"):
        dataclasses.replace(task, algo="sync")
    with pytest.raises(ValueError, match="dynamic_steps .* needs algo='async'"):
        dataclasses.replace(task, dynamic_steps=True)
    with pytest.raises(ValueError, match="algo='async' takes DiLoCo.inner and DiLoCo.outer"):
        dataclasses.replace(_task(), method=dj.DiLoCo(outer_state_dtype="bfloat16"))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"update": 1}, "its update must be 0"),
        ({"worker": 3}, r"its worker must be in \[0, 3\)"),
        ({"steps": 4}, r"its steps must be in \[1, inner_steps = 3\]"),
        ({"start_update": 1, "staleness": -1}, "its start_update must be in"),
        ({"staleness": 1}, "staleness update - start_update"),
    ],
)
def test_a_log_that_cant_be_replayed_is_refused(change, message):
    event = AsyncEvent(0, 0, 0, 3, 0.0, 1.0, 0, 0)._replace(**change)
    rounds = [{"x": np.zeros((3, 3, 4, 3), np.float32), "y": np.zeros((3, 3, 4), np.float32)}]
    with pytest.raises(ValueError, match=message):
        dj.train_async(linear_loss, PARAMS, rounds, num_workers=3, inner_steps=3,
                       num_updates=1, arrivals=[event])  # fmt: skip
    with pytest.raises(ValueError, match="takes no step_seconds"):
        dj.train_async(linear_loss, PARAMS, rounds, num_workers=3, inner_steps=3,
                       num_updates=1, arrivals=[event], step_seconds=(1.0,) * 3)  # fmt: skip


def test_a_replay_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    """A replay of 8 updates checkpointed, then resumed for 12 of the same log, equals the
    12 at once (jobs in flight across the cut start from their recorded θ)."""
    log = dj.async_schedule((1.0, 1.7, 3.0), 3, 16, dynamic_steps=True).events
    rounds = [
        jax.tree.map(lambda *x: np.stack(x), *(batch(m, j) for m in range(3))) for j in range(16)
    ]
    outer = dj.delayed_nesterov(0.5, buffer_size=3, c=0.1)

    def run(num_updates, **options):
        return dj.train_async(
            linear_loss, PARAMS, rounds, num_workers=3, inner_steps=INNER_STEPS,
            num_updates=num_updates, arrivals=log, inner_optimizer=optax.adam(0.05),
            outer_optimizer=outer, **options,
        )  # fmt: skip

    full = run(12)
    assert any(e.update >= 8 and e.start_update < 8 for e in log[:12])  # across the cut
    run(8, checkpoint_dir=tmp_path, checkpoint_every=3)
    resumed = run(12, checkpoint_dir=tmp_path, checkpoint_every=3)
    jax.tree.map(np.testing.assert_array_equal, resumed.state, full.state)
    assert resumed.history == full.history
    with pytest.raises(ValueError, match="arrivals holds 16 updates; num_updates = 17"):
        run(17)

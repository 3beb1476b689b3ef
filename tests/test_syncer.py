"""The elastic syncer's rules, in one process (`diloco_jax.syncer.Syncer`, called as the gRPC
service calls it): the mean and the outer step against NumPy, positions, the quorum, the grace
window, silent and stuck workers, a round reopened when its quorum is lost, non-finite and
malformed deltas, checkpoints and their fallback; and the task's and options' refusals."""

import json
import os
import struct
import time
import zlib

import numpy as np
import optax
import pytest
from elastic_linear import PARAMS, make_task

import diloco_jax as dj
from diloco_jax import wire
from diloco_jax.elastic import main
from diloco_jax.elastic_task import Elastic, ElasticTask, load_task
from diloco_jax.elastic_worker import Kept
from diloco_jax.syncer import Syncer

LR, MOMENTUM = 0.7, 0.9  # elastic_linear's outer Nesterov
SECRET = b"the run's secret for these tests"


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    """The run's secret, as `run` hands it to the processes it starts."""
    monkeypatch.setenv("DILOCO_JAX_SECRET", SECRET.decode())


def _syncer(tmp_path, workers=3, rounds=4, clock=time.monotonic, **options):
    task = make_task()
    task = ElasticTask(task.loss_fn, task.params, task.batches, workers, task.inner_steps, rounds,
                       task.method)  # fmt: skip
    defaults = dict(heartbeat_interval=0.05, heartbeat_timeout=0.3)
    return Syncer(task, Elastic(**{**defaults, **options}), tmp_path, clock=clock)


def _join_all(syncer, workers):
    return [syncer.join(m, None)["incarnation"] for m in range(workers)]


def _delta(value):
    return [np.float32(value), np.full(3, value, np.float32)]  # leaves of {"b", "w"}


def _push(syncer, m, inc, value):
    serial = syncer.serial
    return syncer.push(m, inc, serial, _delta(value), loss=float(m))["status"]


def _nesterov(theta, means):
    """θ after outer Nesterov SGD steps on each mean delta (float64)."""
    trace = np.zeros_like(theta)
    for d in means:
        trace = d + MOMENTUM * trace
        theta = theta - LR * (d + MOMENTUM * trace)
    return theta


def test_a_sync_takes_the_mean_and_the_outer_step(tmp_path):
    s = _syncer(tmp_path)
    incs = _join_all(s, 3)
    assert s.rule.is_open and s.rule.participants == {0, 1, 2}
    for m, value in enumerate((0.1, 0.2, 0.6)):
        assert _push(s, m, incs[m], value) == "ok"
    assert s.round == 1 and s.positions == [1, 1, 1]
    for m, value in enumerate((0.3, -0.3, 0.9)):
        _push(s, m, incs[m], value)
    theta0 = np.r_[PARAMS["b"], PARAMS["w"]].astype(np.float64)
    expected = _nesterov(theta0, [0.3, 0.3])
    got = np.r_[s.theta["b"], s.theta["w"]]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    lines = [json.loads(x) for x in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert [x["included"] for x in lines] == [[0, 1, 2]] * 2
    assert lines[1]["loss"] == 1.0 and lines[1]["positions"] == [2, 2, 2]
    reply = s.next_round(1, incs[1], after=-1, timeout=0.1)
    assert reply["status"] == "round" and reply["round"] == 2 and reply["position"] == 2
    np.testing.assert_array_equal(reply["theta"][1], s.theta["w"])


def test_a_resumed_syncer_continues_from_its_newest_intact_checkpoint(tmp_path):
    s = _syncer(tmp_path)
    incs = _join_all(s, 3)
    for r in range(3):
        for m in range(3):
            _push(s, m, incs[m], 0.1 * (r + 1))
    theta, positions = dict(s.theta), list(s.positions)
    s.flush()  # the newest checkpoint is written while the next round runs
    assert sorted(p.name for p in tmp_path.glob("sync-*.ckpt")) == [
        "sync-00000002.ckpt", "sync-00000003.ckpt",
    ]  # fmt: skip
    again = _syncer(tmp_path)
    assert again.round == 3 and again.positions == positions
    np.testing.assert_array_equal(again.theta["w"], theta["w"])
    # The round opens again once each member of the last sync is back: two reattach with
    # their incarnations, a new process of the third joins (as after a whole-cluster restart).
    serial = again.serial
    assert again.join(1, incs[1])["incarnation"] == incs[1]
    assert again.heartbeat(2, incs[2])["status"] == "ok"
    again.tick()
    assert not again.rule.is_open
    new = again.join(0, None)["incarnation"]
    assert new != incs[0]
    again.tick()
    assert again.rule.is_open and again.rule.participants == {0, 1, 2}
    assert again.serial == serial + 1
    # A worker that had pushed to the dead syncer is asked for its delta again; the new
    # process is given the round.
    assert again.next_round(1, incs[1], after=again.serial, timeout=0.1)["status"] == "push_again"
    reply = again.next_round(0, new, after=-1, timeout=0.1)
    assert reply["status"] == "round" and reply["round"] == 3 and reply["position"] == 3
    # The newest checkpoint torn: the one before it, and history cut back to it.
    newest = tmp_path / "sync-00000003.ckpt"
    newest.write_bytes(newest.read_bytes()[:-5])
    third = _syncer(tmp_path)
    assert third.round == 2
    assert len((tmp_path / "history.jsonl").read_text().splitlines()) == 2


def test_rounds_after_a_lost_checkpoint_never_reuse_a_serial_of_the_lost_process(tmp_path):
    s = _syncer(tmp_path, rounds=6)
    incs = _join_all(s, 3)
    for r in range(3):
        for m in range(3):
            _push(s, m, incs[m], 0.1 * (r + 1))
    s.flush()
    lost = s.serial  # round 3's, from the θ after sync 2
    (tmp_path / "sync-00000003.ckpt").unlink()  # killed before sync 2's checkpoint was on disk
    again = _syncer(tmp_path, rounds=6)
    assert again.round == 2 and len((tmp_path / "history.jsonl").read_text().splitlines()) == 2
    for m in range(3):
        again.join(m, incs[m])
    again.tick()
    assert again.rule.is_open and again.serial == lost - 1  # round 2 again, from the same θ
    for m in range(3):  # other deltas than the lost sync's: another θ after it
        assert _push(again, m, incs[m], -0.5) == "ok"
    assert again.round == 3 and again.serial > lost
    # A push the lost process's round 3 asked for is late, not merged into this round 3.
    assert again.push(0, incs[0], lost, _delta(0.3), loss=0.0)["status"] == "late"


def test_a_resumed_syncer_opens_without_a_member_that_does_not_come_back(tmp_path):
    s = _syncer(tmp_path)
    incs = _join_all(s, 3)
    for m in range(3):
        _push(s, m, incs[m], 0.1)
    s.flush()
    again = _syncer(tmp_path, join_timeout=0.4, min_workers=2)
    for m in (0, 1):
        assert again.heartbeat(m, incs[m])["status"] == "ok"
    again.tick()
    assert not again.rule.is_open  # worker 2 may still come back
    time.sleep(0.45)
    for m in (0, 1):
        again.heartbeat(m, incs[m])
    again.tick()  # join_timeout passed with the quorum back: on without worker 2
    assert again.rule.is_open and again.rule.participants == {0, 1} and again.round == 1


def test_a_resumed_syncer_does_not_await_a_member_it_removed(tmp_path):
    s = _syncer(tmp_path)
    incs = _join_all(s, 3)
    for m in range(3):
        _push(s, m, incs[m], 0.1)
    s.flush()
    # join_timeout far away: only the removal of the silent worker 2 can open the round.
    again = _syncer(tmp_path, join_timeout=60.0, min_workers=2)
    deadline = time.monotonic() + 5.0
    while not again.rule.is_open and time.monotonic() < deadline:
        for m in (0, 1):
            again.heartbeat(m, incs[m])
        again.tick()
        time.sleep(0.05)
    # Restored members get a heartbeat timeout more to come back: 2 x 0.3 s of silence.
    assert time.monotonic() - (deadline - 5.0) < 2.0
    assert again.rule.is_open and again.rule.participants == {0, 1} and 2 not in again.members


def test_the_grace_window_closes_without_a_late_worker(tmp_path):
    s = _syncer(tmp_path, min_workers=2, grace_seconds=0.2)
    incs = _join_all(s, 3)
    _push(s, 0, incs[0], 0.1)
    _push(s, 1, incs[1], 0.2)
    s.tick()
    assert s.round == 0  # within the grace window
    time.sleep(0.25)
    s.heartbeat(2, incs[2])
    s.tick()
    assert s.round == 1 and s.positions == [1, 1, 0]
    assert s.push(2, incs[2], s.serial - 1, _delta(0.3), 0.0)["status"] == "late"
    reply = s.next_round(2, incs[2], after=s.serial - 1, timeout=0.1)
    assert reply["round"] == 1 and reply["position"] == 0  # still a member, data not advanced


def test_a_silent_worker_is_removed_and_joins_the_next_round(tmp_path):
    s = _syncer(tmp_path, min_workers=2)
    incs = _join_all(s, 3)
    _push(s, 0, incs[0], 0.1)
    _push(s, 1, incs[1], 0.2)
    time.sleep(0.35)
    for m in (0, 1):
        s.heartbeat(m, incs[m])
    s.tick()
    assert 2 not in s.members and s.round == 1 and s.positions == [1, 1, 0]
    assert s.heartbeat(2, incs[2])["status"] == "rejoin"
    assert s.next_round(2, incs[2], after=0, timeout=0.1)["status"] == "rejoin"
    new = s.join(2, None)["incarnation"]
    assert new != incs[2] and 2 not in s.rule.participants  # joined mid-round: from the next one
    assert s.next_round(2, new, after=-1, timeout=0.1)["status"] == "pending"
    assert s.next_round(2, new, after=-1, timeout=0.1)["status"] == "pending"
    _push(s, 0, incs[0], 0.1)
    _push(s, 1, incs[1], 0.1)
    reply = s.next_round(2, new, after=-1, timeout=0.1)
    assert reply["status"] == "round" and reply["round"] == 2 and reply["position"] == 0


def test_a_worker_removed_from_an_open_round_is_not_waited_for_after_it_rejoins(tmp_path):
    s = _syncer(tmp_path, min_workers=2)
    incs = _join_all(s, 3)
    time.sleep(0.35)
    for m in (0, 1):
        s.heartbeat(m, incs[m])
    s.tick()  # worker 2 removed inside round 0
    new = s.join(2, None)["incarnation"]  # its restarted process, before round 0 closes
    assert s.next_round(2, new, after=-1, timeout=0.1)["status"] == "pending"
    _push(s, 0, incs[0], 0.1)
    _push(s, 1, incs[1], 0.1)
    assert s.round == 1 and s.positions == [1, 1, 0]  # closed without waiting for it
    assert s.next_round(2, new, after=-1, timeout=0.1)["round"] == 1


def test_a_stuck_worker_is_removed_after_the_round_timeout(tmp_path):
    s = _syncer(tmp_path, min_workers=2, round_timeout=0.2, heartbeat_timeout=5.0)
    incs = _join_all(s, 3)
    _push(s, 0, incs[0], 0.1)
    _push(s, 1, incs[1], 0.2)
    time.sleep(0.25)
    s.tick()
    assert s.round == 1 and 2 not in s.members


def test_a_round_that_loses_its_quorum_is_opened_again(tmp_path):
    s = _syncer(tmp_path, min_workers=2)
    incs = _join_all(s, 2)  # round 0 waits for all 3 ...
    s.started -= 1e9  # ... until the join timeout, then starts with 0 and 1
    s.tick()
    assert s.rule.participants == {0, 1}
    late = s.join(2, None)["incarnation"]
    _push(s, 0, incs[0], 0.1)
    serial = s.serial
    time.sleep(0.35)
    s.heartbeat(0, incs[0])
    s.heartbeat(2, late)
    s.tick()  # worker 1 silent: 1 delta + 0 waiting < 2; workers 0 and 2 are here
    assert s.round == 0 and s.serial == serial + 1 and s.rule.participants == {0, 2}
    assert not s.rule.pushed  # worker 0 runs round 0 again, from the same θ and position
    assert s.next_round(0, incs[0], after=serial, timeout=0.1)["position"] == 0


def test_too_few_workers_for_the_quorum_timeout_end_the_run(tmp_path):
    s = _syncer(tmp_path, min_workers=2, quorum_timeout=0.2)
    incs = _join_all(s, 3)
    time.sleep(0.35)
    s.heartbeat(0, incs[0])
    s.tick()
    s.heartbeat(0, incs[0])
    time.sleep(0.25)
    s.heartbeat(0, incs[0])
    s.tick()
    assert s.done.startswith("fewer than min_workers=2 workers for 0.2 s (1 live workers)")
    assert s.next_round(0, incs[0], after=-1, timeout=0.1)["status"] == "abort"


def test_a_nonfinite_delta_is_left_out_and_its_data_not_counted(tmp_path):
    s = _syncer(tmp_path)
    incs = _join_all(s, 3)
    _push(s, 0, incs[0], 0.1)
    _push(s, 1, incs[1], np.nan)
    _push(s, 2, incs[2], 0.3)
    assert s.positions == [1, 0, 1]
    theta0 = np.r_[PARAMS["b"], PARAMS["w"]].astype(np.float64)
    np.testing.assert_allclose(np.r_[s.theta["b"], s.theta["w"]], _nesterov(theta0, [0.2]),
                               rtol=1e-6)  # fmt: skip
    line = json.loads((tmp_path / "history.jsonl").read_text())
    assert line["included"] == [0, 2] and line["nonfinite"] == [1]


def test_a_delta_unlike_theta_is_refused(tmp_path):
    s = _syncer(tmp_path)
    incs = _join_all(s, 3)
    reply = s.push(0, incs[0], s.serial, [np.float32(0), np.zeros(4, np.float32)], 0.0)
    assert (
        reply["status"] == "refused"
        and "leaf 1 is float32[4], expected float32[3]" in (reply["reason"])
    )
    with pytest.raises(ValueError, match=r"worker must be in \[0, 3\)"):
        s.join(3, None)


def test_files_keep_arrays_exactly_and_refuse_torn_and_edited_bytes(tmp_path):
    import ml_dtypes

    path = tmp_path / "x.ckpt"
    arrays = [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.float32(2.5),
        np.ones(4, ml_dtypes.bfloat16),
        np.zeros((0, 3)),
        np.array([True, False]),
        np.arange(3, dtype=">f4"),  # kept with its byte order
    ]
    wire.write_file(path, {"a": arrays, "round": 7, "members": {"0": "x"}})
    back = wire.read_file(path)
    assert back["round"] == 7 and back["members"] == {"0": "x"}
    for x, y in zip(arrays, back["a"], strict=True):
        assert y.dtype == x.dtype and y.shape == np.shape(x)
        np.testing.assert_array_equal(y, x)
    # The arrays are their raw bytes after the header, in order.
    data = path.read_bytes()
    assert data.endswith(b"".join(np.ascontiguousarray(x).tobytes() for x in arrays))
    for cut in (bytearray(data[:-1]), bytearray(data)):
        cut[-1] ^= 1
        path.write_bytes(bytes(cut))
        with pytest.raises(ValueError, match="checksum mismatch"):
            wire.read_file(path)
    # A file of the earlier format (CRC-32, then the whole message as msgpack) still reads.
    body = wire.pack({"a": np.arange(3)})
    path.write_bytes(struct.pack("<I", zlib.crc32(body)) + body)
    np.testing.assert_array_equal(wire.read_file(path)["a"], np.arange(3))


def test_the_syncer_on_a_clock_the_test_sets_keeps_grace_and_round_timeout_to_the_second(
    tmp_path,
):
    """No sleeping: the syncer's clock is the test's. With K = 2 and grace 3 s, a sync closes
    3 s after its second push, not before. Without grace and with a round timeout of 20 s, a
    worker with no delta 20 s after the opening is removed, not before, and the sync closes
    without it."""

    def line(folder, k):
        return json.loads((folder / "history.jsonl").read_text().splitlines()[k])

    now = [1000.0]
    s = _syncer(tmp_path / "grace", clock=lambda: now[0], min_workers=2, grace_seconds=3.0,
                heartbeat_timeout=1e6, heartbeat_interval=1.0)  # fmt: skip
    incs = _join_all(s, 3)
    assert s.rule.is_open and s.rule.opened_at == 1000.0
    now[0] = 1001.0
    assert _push(s, 0, incs[0], 0.1) == "ok"
    now[0] = 1002.0
    assert _push(s, 1, incs[1], 0.2) == "ok"  # the quorum, at 1002
    now[0] = 1004.999
    s.tick()
    assert s.round == 0
    now[0] = 1005.0
    s.tick()
    assert s.round == 1 and line(tmp_path / "grace", 0)["included"] == [0, 1]
    assert s.rule.opened_at == 1005.0 and s.rule.participants == {0, 1, 2}

    now[0] = 2000.0
    s = _syncer(tmp_path / "timeout", clock=lambda: now[0], min_workers=2, round_timeout=20.0,
                heartbeat_timeout=1e6, heartbeat_interval=1.0)  # fmt: skip
    incs = _join_all(s, 3)
    for m in (0, 2):
        assert _push(s, m, incs[m], 0.3) == "ok"
    now[0] = 2020.0  # 20 s into the round: not past it
    s.tick()
    assert 1 in s.members and s.round == 0
    now[0] = 2020.5
    s.tick()
    assert 1 not in s.members and s.round == 1  # removed; the sync closed with 0 and 2
    assert line(tmp_path / "timeout", 0)["included"] == [0, 2]


def test_kept_files_recycle_the_oldest_they_retire_and_keep_the_newest(tmp_path):
    """`wire.write_kept` writes each file over the oldest one it retires (the same inode: the
    kernel's pages reused), keeps the newest `keep` by name, and a shorter file written over
    a longer one reads back whole."""

    def write(n: int, size: int) -> None:
        wire.write_kept(tmp_path / f"s-{n}.ckpt", {"n": n, "x": np.full(size, n, np.float32)},
                        "s-*.ckpt", keep=2)  # fmt: skip

    write(1, 1000)
    write(2, 1000)
    first = os.stat(tmp_path / "s-1.ckpt").st_ino
    write(3, 10)  # retires s-1: written over it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s-2.ckpt", "s-3.ckpt"]
    assert os.stat(tmp_path / "s-3.ckpt").st_ino == first
    back = wire.read_file(tmp_path / "s-3.ckpt")
    assert back["n"] == 3
    np.testing.assert_array_equal(back["x"], np.full(10, 3, np.float32))
    (tmp_path / "s-0.ckpt").write_bytes(b"an older one, left by a crash")
    write(4, 5)  # retires s-0 and s-2: s-0 recycled, s-2 deleted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s-3.ckpt", "s-4.ckpt"]
    np.testing.assert_array_equal(wire.read_file(tmp_path / "s-4.ckpt")["x"], np.full(5, 4.0))
    write(4, 7)  # the same name again: replaced, its predecessor kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s-3.ckpt", "s-4.ckpt"]
    np.testing.assert_array_equal(wire.read_file(tmp_path / "s-4.ckpt")["x"], np.full(7, 4.0))


@pytest.mark.parametrize(
    "method, reason",
    [
        (dj.DiLoCo(schedule=dj.Streaming(2)), "fragments"),
        (dj.DiLoCo(delay=dj.Delayed(1)), "delay"),
        (dj.DiLoCo(state_sync=dj.StateSync(mu=4)), "DES-LOC"),
        (dj.DiLoCo(weights=dj.Weights(drop_probability=0.1)), "simulated drops"),
        (dj.DiLoCo(weights=dj.Weights(weighting="steps")), "weighting"),
    ],
)
def test_a_method_that_cant_run_elastically_is_refused_with_its_reason(method, reason):
    task = make_task()
    with pytest.raises(ValueError, match=f"can't run elastically: .*{reason}"):
        ElasticTask(task.loss_fn, task.params, task.batches, 4, 3, 2, method)


def test_the_methods_that_run_elastically():
    task = make_task()
    for method in (
        dj.DiLoCo(inner=dj.muon_inner_optimizer(0.01)),  # MuLoCo
        dj.DiLoCo(outer=optax.chain(dj.clip_outer_norm(1.0), dj.default_outer_optimizer())),
        dj.DiLoCo(outer_state_dtype="bfloat16"),
        dj.DiLoCo(compression="int4,ef=1"),
        dj.DiLoCo(compression="topk:0.5,ef=1"),
    ):
        ElasticTask(task.loss_fn, task.params, task.batches, 4, 3, 2, method)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(min_workers=0), "min_workers must be an integer >= 1"),
        (dict(heartbeat_timeout=0.1, heartbeat_interval=0.2), "must exceed heartbeat_interval"),
        (dict(round_timeout=-1.0), "round_timeout must be finite and > 0"),
        (dict(grace_seconds=float("inf")), "grace_seconds must be finite"),
        (dict(inner_state="peer"), "inner_state must be 'checkpoint' or 'fresh'"),
    ],
)
def test_options_out_of_range_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        Elastic(**options)


def test_min_workers_above_the_workers_is_refused():
    with pytest.raises(ValueError, match=r"min_workers must be at most .* \(4\), got 5"):
        Elastic(min_workers=5).checked(4)


def test_load_task_names_a_bad_spec():
    with pytest.raises(ValueError, match="module:function"):
        load_task("elastic_linear")
    with pytest.raises(ValueError, match="can't be loaded"):
        load_task("elastic_linear:nothing")
    assert load_task("elastic_linear:make_task").num_workers == 4


def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    assert main(["syncer", "--task", "nowhere:task", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("diloco-jax elastic: task 'nowhere:task' can't be loaded")
    argv = ["run", "--task", "elastic_linear:make_task", "--out", str(tmp_path / "o"),
            "--min-workers", "9"]  # fmt: skip
    assert main(argv) == 2
    assert "min_workers must be at most" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before any folder or process


TASK = "elastic_linear:make_task"  # 4 workers


@pytest.mark.parametrize(
    "argv, message",
    [
        (["syncer", "--task", TASK, "--dir", "{tmp}/s", "--port", "70000"],
         "--port must be in [0, 65535], got 70000"),
        (["syncer", "--task", TASK, "--dir", "{tmp}/s", "--port", "-3"],
         "--port must be in [0, 65535], got -3"),
        (["run", "--task", TASK, "--out", "{tmp}/s", "--port", "65536"],
         "--port must be in [0, 65535], got 65536"),
        (["run", "--task", TASK, "--out", "/dev/null/x"],
         "--out '/dev/null/x' can't be created: Not a directory"),
        (["syncer", "--task", TASK, "--dir", "/dev/null/x"],
         "--dir '/dev/null/x' can't be created: Not a directory"),
        (["worker", "--task", TASK, "--worker", "0", "--syncer", "127.0.0.1:9", "--dir",
          "/dev/null/x"], "--dir '/dev/null/x/worker-0' can't be created: Not a directory"),
        (["worker", "--task", TASK, "--worker", "4", "--syncer", "127.0.0.1:9", "--dir",
          "{tmp}/s"], "--worker must be in [0, 4), got 4"),
        (["worker", "--task", TASK, "--worker", "0", "--syncer", "127.0.0.1", "--dir",
          "{tmp}/s"], "--syncer must be HOST:PORT, got '127.0.0.1'"),
        (["worker", "--task", TASK, "--worker", "0", "--syncer", "h:99999", "--dir",
          "{tmp}/s"], "--syncer's port must be in [0, 65535], got 99999"),
        (["worker", "--task", TASK, "--worker", "0", "--syncer", "h:1", "--dir", "{tmp}/s",
          "--syncer-timeout", "0"], "--syncer-timeout must be > 0, got 0.0"),
        (["worker", "--task", TASK, "--worker", "0", "--syncer", "h:1", "--dir", "{tmp}/s",
          "--num-processes", "2", "--process-id", "2"], "--process-id in [0, --num-processes)"),
        (["syncer", "--task", "broken_task:make", "--dir", "{tmp}/s"],
         "task 'broken_task:make' can't be loaded: SyntaxError"),
        (["run", "--task", "raising_task:make", "--out", "{tmp}/s"],
         "task 'raising_task:make' can't be loaded: RuntimeError: no data here"),
    ],
)  # fmt: skip
def test_cli_bad_flags_are_one_line_exit_2_and_create_nothing(tmp_path, argv, message, capsys,
                                                               monkeypatch):  # fmt: skip
    (tmp_path / "broken_task.py").write_text("def make(:\n")
    (tmp_path / "raising_task.py").write_text(
        "def make():\n    raise RuntimeError('no data here')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diloco-jax elastic: ") and message in err[0], err
    assert not (tmp_path / "s").exists()


def test_a_worker_gives_up_on_an_unreachable_syncer_after_its_syncer_timeout(tmp_path, capsys):
    port = _free_port()  # nobody serves there
    argv = ["worker", "--task", TASK, "--worker", "1", "--syncer", f"127.0.0.1:{port}",
            "--dir", str(tmp_path), "--syncer-timeout", "0.5"]  # fmt: skip
    started = time.monotonic()
    assert main(argv) == 1
    assert time.monotonic() - started < 20  # the default would be 60 s
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("diloco-jax elastic: worker 1: the syncer at 127.0.0.1:")
    assert "did not answer Join for 0.5 s (UNAVAILABLE" in err


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(tmp_path, inner_state):
    from diloco_jax.elastic_worker import Worker

    worker = Worker(make_task(), 1, "127.0.0.1:9", tmp_path, SECRET)  # never connects here
    worker.options, worker.rejoined = Elastic(inner_state=inner_state), True
    return worker


def test_a_rejoining_worker_takes_its_inner_state_of_its_position(tmp_path):
    import jax

    worker = _worker(tmp_path, "checkpoint")
    state = jax.tree.map(lambda x: np.full_like(x, 7), worker.opt_like)
    worker._keep(3, Kept(state, None))  # as after its third phase; a new process finds it
    again = _worker(tmp_path, "checkpoint")
    loaded = again._state(3).inner
    assert all(np.all(x == 7) for x in jax.tree.leaves(loaded))
    # No state of that position on disk: it starts the inner optimizer afresh.
    missing = _worker(tmp_path, "checkpoint")._state(2).inner
    assert all(np.all(x == 0) for x in jax.tree.leaves(missing))


def test_inner_state_fresh_starts_a_rejoining_worker_afresh(tmp_path):
    import jax

    worker = _worker(tmp_path, "fresh")
    worker._keep(3, Kept(jax.tree.map(lambda x: np.full_like(x, 7), worker.opt_like), None))
    assert all(np.all(x == 0) for x in jax.tree.leaves(worker._state(3).inner))  # fresh
    assert all(np.all(x == 7) for x in jax.tree.leaves(worker._state(3).inner))  # its own


def test_a_worker_that_heard_the_end_stops_calling_a_syncer_gone_after_it(tmp_path):
    """The end heard in one call (a heartbeat during a phase) answers a later call the syncer,
    gone since (it exits once its members heard the end), cannot: at once, not after
    syncer_timeout (a worker failed so in CI, its push retried while its heartbeat heard)."""
    from diloco_jax.rpc import SyncerClient, SyncerLost, serve

    s = _syncer(tmp_path, workers=2, rounds=1)
    incs = _join_all(s, 2)
    server, port = serve(s, 0, SECRET)
    client = SyncerClient(f"127.0.0.1:{port}", SECRET, syncer_timeout=5.0)
    try:
        assert client.once("Heartbeat", {"worker": 0, "incarnation": incs[0]}, 5.0) == {
            "status": "ok"
        }
        assert client.ended is None
        for m in range(2):
            assert _push(s, m, incs[m], 0.1) == "ok"  # the one round: the run is done
        heard = client.once("Heartbeat", {"worker": 0, "incarnation": incs[0]}, 5.0)
        assert heard["status"] == "done" and client.ended == heard
        server.stop(grace=None).wait()
        started = time.monotonic()
        me = {"worker": 0, "incarnation": incs[0], "after": 0, "timeout": 1.0}
        assert client.call("Next", me) == heard
        assert time.monotonic() - started < 2.0
        stranger = SyncerClient(f"127.0.0.1:{port}", SECRET, syncer_timeout=0.3)  # heard nothing
        with pytest.raises(SyncerLost, match="did not answer Next"):
            stranger.call("Next", me)
        stranger.close()
    finally:
        server.stop(grace=None)
        client.close()


def test_a_call_the_syncer_side_cancelled_is_retried_and_a_refusal_is_not():
    """CANCELLED (how a SIGKILLed or stopping syncer's call reads at times; a worker exited so
    in CI) is retried like UNAVAILABLE; INVALID_ARGUMENT is the syncer's answer, raised."""
    from concurrent import futures

    import grpc

    from diloco_jax.rpc import SERVICE, SyncerClient

    answers = [grpc.StatusCode.CANCELLED, grpc.StatusCode.CANCELLED, None,
               grpc.StatusCode.INVALID_ARGUMENT]  # fmt: skip

    def heartbeat(request, context):
        code = answers.pop(0)
        if code is not None:
            context.abort(code, "ended by the server")
        return wire.pack({"status": "ok"})

    handlers = {
        "Epoch": grpc.unary_unary_rpc_method_handler(lambda request, context: b"epoch"),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(heartbeat),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = SyncerClient(f"127.0.0.1:{port}", SECRET, syncer_timeout=5.0)
    try:
        assert client.call("Heartbeat", {"worker": 0, "incarnation": 1}) == {"status": "ok"}
        assert len(answers) == 1  # two cancelled tries, then the answer
        with pytest.raises(grpc.RpcError) as refused:
            client.call("Heartbeat", {"worker": 0, "incarnation": 1})
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and answers == []
    finally:
        server.stop(grace=None)
        client.close()


def test_checkpoints_are_written_one_at_a_time_and_a_failed_write_is_raised_after():
    from diloco_jax.syncer import _Writer

    writer, order = _Writer(), []

    def slow(name):
        time.sleep(0.2)
        order.append(name)

    writer.submit(lambda: slow("first"))
    assert order == []  # returned before the write ended
    writer.submit(lambda: slow("second"))  # waits for the first
    assert order == ["first"]
    writer.flush()
    assert order == ["first", "second"]

    def fail():
        raise OSError("disk full")

    writer.submit(fail)
    with pytest.raises(OSError, match="disk full"):
        writer.flush()
    writer.flush()  # raised once


def test_a_checkpoint_that_fails_to_write_ends_the_run_with_the_syncers_line(tmp_path, monkeypatch):
    import diloco_jax.syncer as syncer_lib

    def full(path, message, pattern, keep):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(syncer_lib.wire, "write_kept", full)
    s = _syncer(tmp_path, rounds=1)
    incs = _join_all(s, 3)
    for m in range(3):
        _push(s, m, incs[m], 0.1)
    assert s.done == "the syncer failed: OSError: [Errno 28] No space left on device"
    assert not (tmp_path / "final.msgpack").exists()  # no result without its checkpoint
    assert s.heartbeat(0, incs[0])["status"] == "abort"


def test_a_worker_holding_theta_from_before_a_compressed_sync_gets_the_codes_of_its_mean(
    tmp_path, monkeypatch
):
    """int8 two-stage: after a sync, a worker that holds θ and the outer state of the version
    before gets only the encoded mean and θ's checksum, and makes the syncer's θ bit for bit
    (its own outer step); one holding θ of this version gets the checksum alone; one holding
    nothing, or an older θ, gets θ and the outer state whole; a worker whose θ differs from
    the syncer's is caught by the checksum."""
    from elastic_linear import make_compressed_task

    from diloco_jax.elastic_worker import Held, Worker

    monkeypatch.setenv("ELASTIC_COMPRESSION", "int8,ef=1")
    monkeypatch.setenv("ELASTIC_WORKERS", "2")
    task = make_compressed_task()
    s = Syncer(task, Elastic(heartbeat_interval=0.05, heartbeat_timeout=30), tmp_path / "s")
    incs = _join_all(s, 2)
    s.tick()
    first = s.next_round(0, incs[0], -1, 1.0)
    assert first["status"] == "round" and first["round"] == 0
    assert set(first) >= {"theta", "outer"} and "reply" not in first  # whole: nothing held
    # θ_0 is the task's: a worker holding it (as a new one does) gets its checksum alone.
    held_0 = s.next_round(1, incs[1], -1, 1.0, held=0)
    assert held_0["checksum"] == wire.checksum(task.params) and "theta" not in held_0
    worker = Worker(task, 0, "127.0.0.1:9", tmp_path / "w", SECRET)  # never connects here
    theta_0 = wire.tree_like(task.params, first["theta"], "θ")
    outer_0 = wire.tree_like(worker.outer_like, first["outer"], "outer")
    for m in range(2):
        delta = {"b": np.float32(0.1 * (m + 1)), "w": np.asarray([0.2, -0.1, m], np.float32)}
        leaves, _ = worker.merge.encode(delta, worker.merge.residual_like)
        assert s.push(m, incs[m], first["serial"], leaves, loss=0.0)["status"] == "ok"
    assert s.round == 1
    after = s.next_round(0, incs[0], first["serial"], 1.0, held=0)
    assert "theta" not in after and set(after) >= {"reply", "checksum"}
    worker.held = Held(0, theta_0, outer_0, wire.checksum(theta_0))
    made = worker._theta_from_held(dict(after))
    assert made is not None and worker.theta_from == "reply"
    for got, want in zip(made["theta"], wire.leaves(s.theta), strict=True):
        np.testing.assert_array_equal(got, want)  # bit for bit
    for got, want in zip(wire.leaves(worker.held.outer_state), wire.leaves(s.outer_state),
                         strict=True):  # fmt: skip
        np.testing.assert_array_equal(got, want)
    # Nothing held, or θ of another version: θ and the outer state whole.
    for held in (-1, 5):
        whole = s.next_round(1, incs[1], first["serial"], 1.0, held=held)
        assert set(whole) >= {"theta", "outer"} and "reply" not in whole
    # A θ one ulp off the syncer's (other hardware, say) is caught: θ whole is asked for.
    off = {**theta_0, "b": np.nextafter(theta_0["b"], np.float32(1))}
    worker.held = Held(0, off, outer_0, wire.checksum(off))
    assert worker._theta_from_held(dict(after)) is None

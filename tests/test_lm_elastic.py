"""`diloco-jax train --elastic`: the LM app's DiLoCo run as a syncer and worker processes
(`diloco_jax.lm.elastic`). Its final θ equals `train_diloco`'s on the same windows from the
same θ_0, and each phase's windows are the shard's own tokens, keyed by (worker, position)."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import diloco_jax as dj
from diloco_jax.decoupled import replay_rounds
from diloco_jax.elastic import arrivals, final_params, history, mean_worker_params
from diloco_jax.lm import cli, experiment
from diloco_jax.lm import elastic as lm_elastic


def _windows_by_hand(tokens, start, length, seed, worker, position, cfg):
    rng = np.random.default_rng([seed, worker, position])
    offsets = rng.integers(0, length - cfg.seq_len, size=(cfg.inner_steps, cfg.batch_size))
    rows = [[tokens[start + o : start + o + cfg.seq_len + 1] for o in step] for step in offsets]
    return np.asarray(rows, np.int32)


@pytest.mark.parametrize("sharding", ["iid", "non_iid"])
def test_a_phases_windows_are_its_shards_tokens_by_worker_and_position(sharding):
    cfg = cli.parse(["train", "--preset", "micro", "--sharding", sharding]).cfg
    tokens = np.arange(1000, dtype=np.int32) % 251
    starts, lengths = np.asarray([0, 600]), np.asarray([600, 400])
    for worker, position in ((0, 0), (1, 0), (1, 3)):
        got = lm_elastic.phase_windows(cfg, tokens, starts, lengths, worker, position)
        whole = _windows_by_hand(tokens, starts[worker], lengths[worker], cfg.seed, worker,
                                 position, cfg)  # fmt: skip
        assert got["inputs"].shape == (cfg.inner_steps, cfg.batch_size, cfg.seq_len)
        np.testing.assert_array_equal(got["inputs"], whole[..., :-1])
        np.testing.assert_array_equal(got["targets"], whole[..., 1:])
    again = lm_elastic.phase_windows(cfg, tokens, starts, lengths, 1, 3)
    other = lm_elastic.phase_windows(cfg, tokens, starts, lengths, 1, 4)
    np.testing.assert_array_equal(again["inputs"], got["inputs"])  # repeatable
    assert not np.array_equal(other["inputs"], got["inputs"])  # a new position, new windows


def _train(argv: list[str]) -> str:
    """`diloco-jax` with `argv` in a process of its own (each of its workers on one device);
    what it printed, once it exited 0."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "-m", "diloco_jax.lm.cli", *argv], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "method_flags",
    [
        [],  # AdamW inner steps, Nesterov outer steps
        # MuLoCo's Muon inner steps, EDiT's clip of the mean delta, a bfloat16 outer state
        ["--inner-optimizer", "muon", "--outer-clip", "0.001", "--outer-state-dtype", "bfloat16"],
        # int4 codes and scales pushed, each worker's error-feedback residual kept beside its
        # inner state
        ["--compression", "int4,ef=1"],
    ],
    ids=["adamw", "muon-clip-bf16", "int4-ef"],
)
def test_train_elastic_equals_train_diloco_on_the_same_windows(tmp_path, monkeypatch,
                                                               method_flags):  # fmt: skip
    out = tmp_path / "run"
    argv = ["train", "--elastic", "--preset", "micro", "--rounds", "3", "--out", str(out),
            "--no-progress", *method_flags]  # fmt: skip
    printed = _train(argv)
    assert "diloco (elastic): eval loss" in printed
    assert "3 of 3 syncs with every worker" in printed
    syncs = history(out / "elastic" / "syncer")
    assert [s["included"] for s in syncs] == [[0, 1]] * 3
    # The same task in this process, and train_diloco on its windows from its θ_0.
    monkeypatch.setenv(lm_elastic.ENV, str(out / "elastic" / lm_elastic.SPEC_FILE))
    task = lm_elastic.task()
    real = final_params(out / "elastic" / "syncer", task)
    # The flags reached the workers' method (an ignored flag would pass the equality too).
    muon = "MuonState" in str(jax.tree.structure(task.method.inner.init(task.params)))
    assert muon == ("muon" in method_flags)
    assert task.method.outer_state_dtype == ("bfloat16" if "bfloat16" in method_flags else None)
    compressed = "--compression" in method_flags
    assert task.method.compression.kind == ("int4" if compressed else "none")
    data = [
        jax.tree.map(lambda *x: np.stack(x), *(task.batches(m, r) for m in range(2)))
        for r in range(3)
    ]

    def simulated(method):
        return dj.train_diloco(
            task.loss_fn, task.params, data, num_rounds=3, num_workers=2, inner_steps=4,
            method=method, backend="sequential",
        ).params  # fmt: skip

    expected = simulated(task.method)
    if compressed:
        # A worker's Δ differs from the compiled round's in its last bits, and int4 rounds
        # the odd element that sits on a code's edge the other way: one code step there,
        # carried on by the error feedback. Every other element agrees, and the run is far
        # from the uncompressed one.
        got, want = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
                     for t in (real, expected))  # fmt: skip
        plain = dataclasses.replace(task.method, compression=dj.Compression())
        exact = np.concatenate([np.ravel(x) for x in jax.tree.leaves(simulated(plain))])
        assert np.mean(np.isclose(got, want, rtol=2e-5, atol=2e-6)) > 0.95
        assert np.linalg.norm(got - want) < 0.1 * np.linalg.norm(got - exact)
    else:
        for got, want in zip(jax.tree.leaves(real), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    # θ_0 is the pretrained params (micro pretrains 2 steps), not a fresh init.
    cfg = cli.parse(argv).cfg
    _, init, _ = experiment.init_model(cfg)
    assert not np.allclose(jax.tree.leaves(task.params)[0], jax.tree.leaves(init)[0])
    summary = json.loads((out / "summary.json").read_text())
    corpus = experiment.load_corpus(cfg)
    # The summary states the loss of the θ the run ended with (under int4 one code step from
    # the compiled round's at the odd element, so it is checked against the run's own θ).
    eval_loss = jax.jit(experiment.make_eval_fn(task.loss_fn, corpus))(real)["eval_loss"]
    assert summary["final_eval_loss"] == pytest.approx(float(eval_loss), rel=1e-6)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines if x["run"] == "diloco"] == [0, 1, 2]


@pytest.mark.slow
def test_train_elastic_async_equals_its_replay_on_the_same_windows(tmp_path, monkeypatch):
    """--algo async --dynamic-steps with Delayed Nesterov: M x R updates on the real clock,
    and train_async replaying the run's arrival log on the same windows gives its θ."""
    out = tmp_path / "run"
    argv = ["train", "--elastic", "--algo", "async", "--dynamic-steps", "--outer-optimizer",
            "delayed_nesterov", "--preset", "micro", "--rounds", "3", "--out", str(out),
            "--no-progress"]  # fmt: skip
    printed = _train(argv)
    assert "async (elastic): eval loss" in printed and "6 updates of" in printed
    monkeypatch.setenv(lm_elastic.ENV, str(out / "elastic" / lm_elastic.SPEC_FILE))
    task = lm_elastic.task()
    assert task.algo == "async" and task.dynamic_steps and task.num_rounds == 6
    # --outer-optimizer reached the syncer's rule (an ignored flag would pass the equality).
    assert "DelayedNesterovState" in str(jax.tree.structure(task.method.outer.init(task.params)))
    events = arrivals(out / "elastic" / "syncer")
    data = [
        jax.tree.map(lambda *x: np.stack(x), *(task.batches(m, j) for m in range(2)))
        for j in range(1 + max(e.job for e in events))
    ]
    expected = dj.train_async(
        task.loss_fn, task.params, data, num_workers=2, inner_steps=4,
        num_updates=len(events), arrivals=events, method=task.method,
    ).params  # fmt: skip
    real = final_params(out / "elastic" / "syncer", task)
    for got, want in zip(jax.tree.leaves(real), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["update"] for x in lines if x["run"] == "async"] == list(range(6))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["updates"] == 6 and summary["inner_steps"] == sum(e.steps for e in events)


@pytest.mark.slow
def test_train_elastic_decoupled_equals_its_replay_on_the_same_windows(tmp_path, monkeypatch):
    """--algo async --server decoupled,...: learner processes that never wait, R x P merges on
    the real clock, and train_async with the same server replaying the run's merges on the
    same windows gives its Θ."""
    out = tmp_path / "run"
    argv = ["train", "--elastic", "--algo", "async", "--server",
            "decoupled,quorum=1,grace_seconds=0.2,fragments=2", "--preset", "micro", "--rounds",
            "2", "--out", str(out), "--no-progress"]  # fmt: skip
    printed = _train(argv)
    assert "async (elastic): eval loss" in printed and "4 merges" in printed
    monkeypatch.setenv(lm_elastic.ENV, str(out / "elastic" / lm_elastic.SPEC_FILE))
    task = lm_elastic.task()
    assert task.server == dj.DecoupledDiLoCo(quorum=1, grace_seconds=0.2, fragments=2)
    merges = arrivals(out / "elastic" / "syncer")
    data = [
        jax.tree.map(lambda *x: np.stack(x), *(task.batches(m, j) for m in range(2)))
        for j in range(replay_rounds(merges, 4))
    ]
    expected = dj.train_async(
        task.loss_fn, task.params, data, num_workers=2, inner_steps=4,
        num_updates=len(merges), server=task.server, arrivals=merges, method=task.method,
    ).params  # fmt: skip
    real = final_params(out / "elastic" / "syncer", task)
    for got, want in zip(jax.tree.leaves(real), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["update"] for x in lines if x["run"] == "async"] == list(range(4))


@pytest.mark.slow
def test_train_elastic_halos_equals_its_replay_on_the_same_windows(tmp_path, monkeypatch):
    """--algo async --server halos,...: a syncer per region and a global one, M x R / K global
    updates on the real clock, and train_async with the same server replaying the run's record
    on the same windows gives its θ_G."""
    out = tmp_path / "run"
    argv = ["train", "--elastic", "--algo", "async", "--server",
            "halos,regions=0/1,local_updates=1,merge_weight=0.5", "--preset", "micro",
            "--rounds", "2", "--out", str(out), "--no-progress"]  # fmt: skip
    printed = _train(argv)
    assert "async (elastic): eval loss" in printed and "4 global updates" in printed
    monkeypatch.setenv(lm_elastic.ENV, str(out / "elastic" / lm_elastic.SPEC_FILE))
    task = lm_elastic.task()
    assert task.server == dj.HALoS(regions=(0, 1), local_updates=1, merge_weight=0.5)
    record = arrivals(out / "elastic" / "syncer")
    assert len(record.pushes) == 4 and record.merges
    data = [
        jax.tree.map(lambda *x: np.stack(x), *(task.batches(m, j) for m in range(2)))
        for j in range(1 + max(a.job for a in record.arrivals))
    ]
    expected = dj.train_async(
        task.loss_fn, task.params, data, num_workers=2, inner_steps=4,
        num_updates=len(record.arrivals), server=task.server, arrivals=record,
        method=task.method,
    ).params  # fmt: skip
    real = final_params(out / "elastic" / "syncer", task)
    for got, want in zip(jax.tree.leaves(real), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_updates"] == 4 and summary["updates"] == len(record.arrivals)


@pytest.mark.slow
@pytest.mark.parametrize(
    "gossip_flags",
    [["--gossip-group-size", "2"], ["--gasloc", "alpha=0.8,gamma=0.5"]],
    ids=["noloco", "gasloc"],
)
def test_train_elastic_with_gossip_equals_train_diloco(tmp_path, monkeypatch, gossip_flags):
    """NoLoCo and GASLoC on worker processes that exchange with each other: the mean of the
    workers' θ_m equals train_diloco's params on the same windows, and the summary states its
    loss."""
    out = tmp_path / "run"
    argv = ["train", "--elastic", "--preset", "micro", "--rounds", "3", "--out", str(out),
            "--no-progress", *gossip_flags]  # fmt: skip
    printed = _train(argv)
    assert "diloco (elastic): eval loss" in printed and "3 syncs, each worker" in printed
    monkeypatch.setenv(lm_elastic.ENV, str(out / "elastic" / lm_elastic.SPEC_FILE))
    task = lm_elastic.task()
    kind = "GASLoC" if "--gasloc" in gossip_flags else "NoLoCo"
    assert type(task.method.gossip).__name__ == kind  # the flag reached the workers
    data = [
        jax.tree.map(lambda *x: np.stack(x), *(task.batches(m, r) for m in range(2)))
        for r in range(3)
    ]
    expected = dj.train_diloco(
        task.loss_fn, task.params, data, num_rounds=3, num_workers=2, inner_steps=4,
        method=task.method, backend="sequential",
    ).params  # fmt: skip
    real = mean_worker_params(out / "elastic" / "workers", task)
    for got, want in zip(jax.tree.leaves(real), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert not np.allclose(jax.tree.leaves(real)[0], jax.tree.leaves(task.params)[0])
    summary = json.loads((out / "summary.json").read_text())
    corpus = experiment.load_corpus(cli.parse(argv).cfg)
    eval_loss = jax.jit(experiment.make_eval_fn(task.loss_fn, corpus))(real)["eval_loss"]
    assert summary["final_eval_loss"] == pytest.approx(float(eval_loss), rel=1e-6)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["included"] for x in lines if x["run"] == "diloco"] == [[0, 1]] * 3

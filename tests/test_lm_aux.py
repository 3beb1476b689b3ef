"""The LM's train metrics beside the loss (its loss_fn's aux, e.g. accuracy): in metrics.jsonl,
in TensorBoard (train/NAME) and on the progress bar, for every trainer the CLI runs."""

import json

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import diloco_jax as dj
from diloco_jax.lm import config as config_lib
from diloco_jax.lm import experiment, tblog
from diloco_jax.lm import model as model_lib
from diloco_jax.lm.cli import main
from diloco_jax.lm.runlog import RunLog, aux_metrics

TEXT = "".join(
    f"Paragraph {i}: the quick brown fox jumps over the lazy dog.\n\n" for i in range(400)
)


def _argv(tmp_path, *extra):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 3)
    out = tmp_path / "run"
    argv = ["train", "--preset", "micro", "--data", f"text:{corpus}", "--workers", "2"]
    argv += ["--inner-steps", "2", "--rounds", "2", "--pretrain-steps", "1", "--tensorboard"]
    return [*argv, *extra, "--out", str(out)], out


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _scalars(folder, tag):
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _expected(records):
    return [(tblog.x_step(r), float(np.float32(r["accuracy"]))) for r in records]


@pytest.mark.slow
def test_train_reports_accuracy_in_metrics_tensorboard_and_progress_bar(tmp_path, capsys):
    argv, out = _argv(tmp_path)
    assert main(argv) == 0  # with the progress bar
    records = _records(out)
    by_run = {name: [r for r in records if r["run"] == name] for name in ("pretrain", "diloco")}
    assert [len(v) for v in by_run.values()] == [1, 2]
    for name, rows in by_run.items():
        for r in rows:
            assert isinstance(r["accuracy"], float) and 0.0 <= r["accuracy"] <= 1.0, r
            workers = 1 if name == "pretrain" else 2
            assert len(r["worker_accuracy"]) == workers
            assert r["accuracy"] == pytest.approx(np.mean(r["worker_accuracy"]), rel=1e-6)
        events = _scalars(out / "tensorboard" / name, "train/accuracy")
        assert events == _expected(rows)
    # The bar shows the accuracy next to the loss.
    err = capsys.readouterr().err
    assert "loss=" in err and "accuracy=" in err, err
    last = by_run["diloco"][-1]
    assert f"accuracy={last['accuracy']:.3f}" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_train_loss"] == last["loss"]  # the summary is as it was


@pytest.mark.slow
def test_async_and_sync_runs_report_accuracy(tmp_path):
    # train_async records only the mean (no worker_ list): the CLI names the loss's metrics.
    argv, out = _argv(tmp_path, "--algo", "async", "--step-seconds", "1,2", "--no-progress")
    assert main(argv) == 0
    rows = [r for r in _records(out) if r["run"] == "async"]
    assert rows and all(0.0 <= r["accuracy"] <= 1.0 for r in rows)
    assert not any("worker_accuracy" in r for r in rows)
    assert _scalars(out / "tensorboard" / "async", "train/accuracy") == _expected(rows)
    (tmp_path / "sync").mkdir()
    argv, out = _argv(tmp_path / "sync", "--algo", "sync", "--no-progress")
    assert main(argv) == 0
    rows = [r for r in _records(out) if r["run"] == "sync"]
    assert len(rows) == 4 and all(len(r["worker_accuracy"]) == 2 for r in rows)
    assert _scalars(out / "tensorboard" / "sync", "train/accuracy") == _expected(rows)


def test_aux_metrics_are_any_number_with_a_worker_list_or_a_named_one():
    record = {
        "steps": 2,
        "loss": 2.0,
        "worker_loss": [2.0, 2.0],
        "accuracy": 0.25,
        "worker_accuracy": [0.0, 0.5],
        "grad_norm": 3,
        "worker_grad_norm": [3, 3],
        "flag": True,
        "worker_flag": [True, True],
        "mean_only": 0.5,
        "worker_bytes": [1, 2],
        "eval_loss": 1.0,
    }
    assert aux_metrics(record) == {"accuracy": 0.25, "grad_norm": 3.0}
    assert aux_metrics(record, ["mean_only", "absent"]) == {
        "accuracy": 0.25,
        "grad_norm": 3.0,
        "mean_only": 0.5,
    }
    tags = tblog.scalars(record, ["mean_only"])
    assert {k: v for k, v in tags.items() if k.startswith("train/")} == {
        "train/loss": 2.0,
        "train/accuracy": 0.25,
        "train/grad_norm": 3.0,
        "train/mean_only": 0.5,
    }


def test_progress_bar_postfix_shows_each_aux_metric(tmp_path):
    record = {"steps": 1, "loss": 2.5, "accuracy": 0.125, "worker_accuracy": [0.125]}
    record |= {"mean_only": 0.75, "workers": 1, "tokens_per_worker": 1, "bytes_communicated": 0}
    with RunLog(tmp_path / "metrics.jsonl", 2, "x", True, aux=["mean_only"]) as log:
        log(record)
        postfix = log._bar.postfix
    assert postfix.startswith("loss=2.500, accuracy=0.125, mean_only=0.750, "), postfix


def test_aux_names_are_the_loss_fns_metrics():
    cfg = config_lib.make_config("micro")
    assert experiment.aux_names(cfg) == ("accuracy",)


def test_eval_fn_takes_the_loss_with_or_without_aux():
    model_cfg = model_lib.PRESETS["micro"]
    params = model_lib.init_params(model_cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 3, model_cfg.seq_len + 1), 0, 256)
    evals = {"inputs": np.asarray(tokens[..., :-1]), "targets": np.asarray(tokens[..., 1:])}
    corpus = experiment.Corpus(np.zeros(1, np.int32), np.zeros(1, np.int64), evals, {})
    got = [
        jax.jit(experiment.make_eval_fn(model_lib.make_loss_fn(model_cfg, has_aux=a), corpus))(
            params
        )
        for a in (False, True)
    ]
    assert set(got[1]) == {"eval_loss"} and got[1]["eval_loss"].shape == ()
    assert np.asarray(got[0]["eval_loss"]) == np.asarray(got[1]["eval_loss"])


@pytest.mark.slow
def test_diloco_with_the_accuracy_trains_the_same_bits():
    model_cfg = model_lib.PRESETS["micro"]
    params = model_lib.init_params(model_cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(2), (2, 2, 2, 2, model_cfg.seq_len + 1), 0, 256)
    rounds = [{"inputs": t[..., :-1], "targets": t[..., 1:]} for t in tokens]  # R, M, H, B
    kw = dict(num_rounds=2, num_workers=2, inner_steps=2, backend="vmap")
    plain = dj.train_diloco(model_lib.make_loss_fn(model_cfg), params, rounds, **kw)
    aux = dj.train_diloco(
        model_lib.make_loss_fn(model_cfg, has_aux=True), params, rounds, has_aux=True, **kw
    )
    jax.tree.map(np.testing.assert_array_equal, aux.params, plain.params)
    for a, p in zip(aux.history, plain.history, strict=True):
        assert 0.0 <= a.pop("accuracy") <= 1.0 and len(a.pop("worker_accuracy")) == 2
        assert a == p

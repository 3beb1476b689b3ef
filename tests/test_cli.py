"""The diloco-jax CLI end to end on the micro preset, and its handling of user mistakes."""

import json
import math
import os
import subprocess
import sys

import jax
import matplotlib.colors
import matplotlib.image
import numpy as np
import orbax.checkpoint as ocp
import pytest
from reference import assert_cli_refuses

from diloco_jax.lm.cli import main

TEXT = "".join(
    f"Paragraph {i}: the quick brown fox jumps over the lazy dog.\n\n" for i in range(400)
)


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_train_writes_config_metrics_and_summary(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 3)
    out = tmp_path / "run"
    umask = os.umask(0o002)  # issue 40, finding 8: the run's files follow the umask
    try:
        code = main(
            [
                "train",
                "--preset",
                "micro",
                "--algo",
                "diloco",
                "--data",
                f"text:{corpus}",
                "--workers",
                "2",
                "--inner-steps",
                "3",
                "--rounds",
                "2",
                "--dtype",
                "bfloat16",
                "--checkpoint-every",
                "1",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
    finally:
        os.umask(umask)
    assert code == 0
    for name in ("config.json", "metrics.jsonl", "summary.json"):
        assert (out / name).stat().st_mode & 0o777 == 0o664, name
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["inner_steps"] == 3 and config["data"]["spec"] == f"text:{corpus}"
    assert config["data"]["sha256"] and config["num_params"] > 0
    # Mixed precision: bf16 compute, float32 master weights (the default param_dtype).
    assert config["model"]["dtype"] == "bfloat16" and config["model"]["param_dtype"] == "float32"
    assert config["implementations"] == {"attention": "xla", "embedding": "gather"}  # CPU
    records = _read_jsonl(out / "metrics.jsonl")
    pre = [r for r in records if r["run"] == "pretrain"]
    main_run = [r for r in records if r["run"] == "diloco"]
    assert len(pre) == 2 and [r["round"] for r in main_run] == [0, 1]
    assert all("eval_loss" in r for r in main_run)
    # The loss's aux metric, next-token accuracy (bf16 compute: float32 logits), per worker too.
    assert all(0 <= r["accuracy"] <= 1 and len(r["worker_accuracy"]) == 2 for r in main_run)
    # DiLoCo sends one float32 delta of every parameter per round.
    assert main_run[-1]["bytes_communicated"] == 2 * 4 * config["num_params"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_eval_ppl"] == pytest.approx(math.exp(summary["final_eval_loss"]))
    # Checkpoints hold float32 params and optimizer state (ints: step counts, the round).
    for name in ("pretrain", "run"):
        saved = out / "checkpoints" / name
        step = max(int(p.name) for p in saved.iterdir() if p.name.isdigit())
        fingerprint = json.loads((saved / str(step) / "metadata" / "metadata").read_text())
        assert set(fingerprint["dtypes"].values()) == {"float32"}
        state = ocp.StandardCheckpointer().metadata(saved / str(step) / "state").item_metadata
        dtypes = {str(leaf.dtype) for leaf in jax.tree.leaves(state)}
        assert "float32" in dtypes and dtypes <= {"float32", "int32"}, dtypes
    # MFU fields: micro's 6N + attention by hand (D 32, F 128, 1 layer, 2 heads x 16, T 32).
    n = 1 * (4 * 32 * 32 + 2 * 32 * 128) + 256 * 32
    assert summary["model_flops_per_token"] == 6 * n + 12 * 1 * 32 * 32
    # backend "auto" puts the 2 workers on 2 of conftest's fake CPU devices; a CPU's peak is
    # its measured matmul rate whatever the device count.
    assert summary["devices"] == min(2, jax.device_count()) and summary["peak_flops"] > 0
    tokens_per_second = 2 * 6 * 4 * 32 / summary["wall_seconds"]  # M x H R x B x L
    assert summary["tokens_per_second"] == pytest.approx(tokens_per_second)
    achieved = summary["model_flops_per_token"] * tokens_per_second
    assert summary["mfu"] == pytest.approx(achieved / summary["peak_flops"])
    printed = capsys.readouterr().out
    assert "diloco: eval loss" in printed and "diloco: MFU " in printed
    assert f"model micro: {config['num_params']:,} parameters" in printed


@pytest.mark.slow
def test_train_with_eager_updates_over_fragments(tmp_path):
    """--outer-delay/--eager with --fragments (Streaming DiLoCo, the eager paper's Table 3)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 3)
    out = tmp_path / "run"
    argv = ["train", "--preset", "micro", "--data", f"text:{corpus}", "--workers", "2"]
    argv += ["--inner-steps", "2", "--rounds", "2", "--fragments", "2", "--outer-delay", "1"]
    assert main([*argv, "--eager", "--out", str(out), "--no-progress"]) == 0
    config = json.loads((out / "config.json").read_text())["config"]
    assert (config["fragments"], config["outer_delay"], config["eager"]) == (2, 1, True)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outer"] == "nesterov 0.7, eager 1" and math.isfinite(summary["final_eval_loss"])
    # Every fragment's float32 delta is sent once a round (later): 2 rounds of DiLoCo's bytes.
    num_params = json.loads((out / "config.json").read_text())["num_params"]
    assert summary["bytes_communicated"] == 2 * 4 * num_params


@pytest.mark.slow
def test_train_with_edit_weighting_anomaly_skip_and_a_bf16_outer_state(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 3)
    out = tmp_path / "run"
    argv = ["train", "--preset", "micro", "--data", f"text:{corpus}", "--workers", "2"]
    argv += ["--inner-steps", "2", "--rounds", "2", "--weighting", "norm_softmax"]
    argv += ["--temperature", "2", "--anomaly-skip", "--outer-state-dtype", "bfloat16"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    config = json.loads((out / "config.json").read_text())["config"]
    assert config["outer_state_dtype"] == "bfloat16"
    assert (config["weighting"], config["temperature"], config["anomaly_skip"]) == (
        "norm_softmax",
        2.0,
        True,
    )
    # The fault options' metrics: nobody is an outlier before EDiT's warm-up rounds.
    records = [r for r in _read_jsonl(out / "metrics.jsonl") if r["run"] == "diloco"]
    assert [r["excluded_workers"] for r in records] == [[], []]


@pytest.mark.slow
def test_checkpoints_resume_only_the_run_that_wrote_them(tmp_path, capsys):
    """A checkpointed rerun must be the run the checkpoints belong to, as the checkpoints
    themselves record it: also after another run into the same OUT rewrote its config.json,
    and with every other file of the run deleted (finding 6 of issue 40: with run.json and
    config.json gone, another --inner-lr resumed silently)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 3)
    out = tmp_path / "run"
    argv = ["train", "--preset", "micro", "--data", f"text:{corpus}", "--workers", "2"]
    argv += ["--inner-steps", "2", "--pretrain-steps", "1", "--no-progress", "--out", str(out)]
    checkpointed = [*argv, "--checkpoint-every", "1"]
    assert main([*checkpointed, "--rounds", "1"]) == 0
    for name in ("run", "pretrain"):
        saved = json.loads((out / "checkpoints" / name / "1" / "metadata" / "metadata").read_text())
        assert saved["run"]["config"]["rounds"] == 1 and saved["run"]["algo"] == "diloco"
        assert "mesh" not in saved["run"]["config"]  # a resume may change where it runs
    assert main([*argv, "--rounds", "2"]) == 0  # no checkpoints: runs, rewrites config.json
    assert_cli_refuses([*checkpointed, "--rounds", "2"], "(rounds 1 -> 2)", capsys)
    for name in ("config.json", "checkpoints/run.json", "metrics.jsonl", "summary.json"):
        (out / name).unlink(missing_ok=True)
    assert_cli_refuses(
        [*checkpointed, "--rounds", "1", "--inner-lr", "0.01"], "(inner-lr 0.003 -> 0.01)", capsys
    )
    sync = [*checkpointed, "--rounds", "1", "--algo", "sync"]
    assert_cli_refuses(sync, "(algo 'diloco' -> 'sync')", capsys)


@pytest.mark.slow
def test_compare_writes_summary_table_and_plots(tmp_path):
    out = tmp_path / "cmp"
    assert main(["compare", "--preset", "micro", "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    assert set(runs) == {"diloco", "sync_1worker", "sync_data_parallel"}
    cfg = summary["config"]["config"]
    m, h, r = cfg["workers"], cfg["inner_steps"], cfg["rounds"]
    n = summary["config"]["num_params"]
    for name, run in runs.items():
        for key in (
            "final_eval_loss",
            "final_eval_ppl",
            "bytes_communicated",
            "tokens_seen",
            "wall_seconds",
        ):
            assert math.isfinite(run[key]), (name, key)
        assert run["steps_per_worker"] == h * r
    assert runs["diloco"]["bytes_communicated"] == r * n * 4
    assert runs["sync_data_parallel"]["bytes_communicated"] == h * r * n * 4
    assert runs["sync_1worker"]["bytes_communicated"] == 0
    tokens = h * r * cfg["batch_size"] * cfg["seq_len"]
    assert runs["sync_1worker"]["tokens_seen"] == tokens
    assert runs["diloco"]["tokens_seen"] == runs["sync_data_parallel"]["tokens_seen"] == m * tokens
    table = (out / "summary.md").read_text()
    for name in runs:
        assert table.count(f"\n| {name} |") == (2 if name != "sync_1worker" else 1)
    assert "## Simulated network" in table
    network = summary["network"]["runs"]
    assert (
        network["diloco"]["steps_per_sync"] == h
        and network["sync_data_parallel"]["steps_per_sync"] == 1
    )
    for bandwidth in ("100 Gbit/s", "10 Gbit/s", "1 Gbit/s", "100 Mbit/s"):
        assert (
            network["diloco"][bandwidth]["utilization"]
            > network["sync_data_parallel"][bandwidth]["utilization"]
        )
    for run in runs.values():
        assert run["mfu"] == pytest.approx(
            run["model_flops_per_token"] * run["tokens_per_second"] / run["peak_flops"]
        )
    assert "| tokens/s | MFU |" in table
    for png in ("eval_loss_vs_tokens.png", "eval_loss_vs_bytes.png"):
        image = matplotlib.image.imread(out / png)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
        # Each run in its own colour, the same in both images (C0, C1, C2 in run order).
        for i, _ in enumerate(runs):
            rgb = np.asarray(matplotlib.colors.to_rgb(f"C{i}"))
            painted = np.all(np.abs(image[..., :3] - rgb) < 1.5 / 255, axis=-1)
            assert painted.sum() > 50, (png, i)
    records = _read_jsonl(out / "metrics.jsonl")
    assert {rec["run"] for rec in records} == {"pretrain", *runs}
    assert all(0 <= rec["accuracy"] <= 1 for rec in records)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--workers", "0"], "workers must be an integer >= 1"),
        (["train", "--workers", "two"], "invalid int value"),
        (["compare", "--inner-steps", "-3"], "inner_steps"),
        (["train", "--preset", "huge"], "invalid choice"),
        (["train", "--sharding", "random"], "invalid choice"),
        (["train", "--outer-optimizer", "lamb"], "invalid choice"),
        (["train", "--outer-lr", "-1"], "outer_lr"),
        (["train", "--inner-lr", "nan"], "inner_lr"),
        (["train", "--model", "gpt5"], "model must be one of"),
        (["train", "--preset", "micro", "--seq-len", "4096"], "exceeds model"),
        (["train", "--backend", "tpu"], "backend must be one of"),
        (["train", "--dtype", "float16"], "invalid choice"),
        (["train", "--param-dtype", "int8"], "invalid choice"),
        (["train", "--attention", "cudnn"], "attention='cudnn' needs dtype bfloat16"),
        (["train", "--embedding", "hash"], "invalid choice"),
        pytest.param(
            ["train", "--attention", "cudnn", "--dtype", "bfloat16"],
            "attention='cudnn' needs an NVIDIA GPU",
            marks=pytest.mark.skipif(
                jax.devices()[0].platform == "gpu", reason="cudnn can run here"
            ),
        ),
        (["train", "--data", "text:/no/such/file.txt"], "--data text:/no/such/file.txt"),
        (["train", "--data", "s3://bucket"], "unknown data spec"),
        (
            ["compare", "--preset", "micro", "--sharding", "non_iid", "--workers", "5000"],
            "--data bundled",
        ),
        (["train", "--frobnicate"], "unrecognized arguments"),
        (["train", "--eager"], "Eager.rounds (outer_delay) must be >= 1"),
        (["train", "--outer-clip", "0"], "(outer_clip) must be a number > 0"),
        (["train", "--outer-state-dtype", "int8"], "outer_state_dtype must be a floating dtype"),
        (
            ["train", "--algo", "sync", "--outer-state-dtype", "bfloat16"],
            "--outer-state-dtype needs --algo diloco",
        ),
        (["train", "--outer-state-memory", "gpu"], "invalid choice"),
        (
            ["train", "--algo", "sync", "--shard-outer-over-workers"],
            "--shard-outer-over-workers needs --algo diloco",
        ),
        (["train", "--state-sync", "mu"], "state_sync must look like"),
        (["train", "--fragments", "3", "--inner-steps", "25"], "must be a multiple"),
        (["train", "--merge-alpha", "0.5"], "need fragments"),
        (["compare", "--outer-delay", "3"], "(outer_delay) must be at most 2"),
        (["train", "--state-sync", "mu=5,mu=6"], "state_sync names 'mu' twice"),
        (["train", "--compression", "sparseloco,top_k=0"], "top_k"),
        (["train", "--compression", "sparseloco,beta=1"], "beta"),
        (["train", "--algo", "sync", "--fragments", "5"], "--fragments needs --algo diloco"),
        (["train", "--algo", "sync", "--anomaly-skip"], "--anomaly-skip needs --algo diloco"),
        (["train", "--weighting", "softmax"], "invalid choice"),
        (["train", "--temperature", "0.5"], "temperature applies to weighting='norm_softmax' only"),
        (
            ["train", "--weighting", "norm_softmax", "--temperature", "0"],
            "temperature must be a finite number > 0",
        ),
        (
            ["train", "--outer-delay", "1", "--eager", "--weighting", "norm_softmax"],
            "Eager can't be combined with Weights",
        ),
        (["train", "--algo", "async", "--outer-delay", "1"], "--outer-delay needs --algo diloco"),
        (
            ["train", "--algo", "async", "--eager", "--outer-delay", "1"],
            "--outer-delay needs --algo diloco",
        ),
        (["compare", "--outer-optimizer", "delayed_nesterov"], "needs --algo async"),
        (["train", "--outer-optimizer", "heloco"], "heloco needs --algo async"),
        (["train", "--outer-optimizer", "sgd", "--outer-momentum", "0.5"], "outer_momentum"),
        (
            [
                "train",
                "--algo",
                "async",
                "--outer-optimizer",
                "delayed_nesterov",
                "--dn-buffer",
                "0",
            ],
            "dn_buffer must be an integer >= 1",
        ),
        ([], "required"),
        # Issue 40, finding 4: every number within what holds it, before anything is written.
        (["train", "--inner-steps", "99999999999999999999"], "inner_steps must be at most"),
        (["train", "--seed", "99999999999999999999999"], "seed must be at most 4,294,967,295"),
        (["train", "--inner-steps", "65536", "--rounds", "32768"], "inner_steps x rounds"),
        (["train", "--checkpoint-every", "2147483648"], "--checkpoint-every must be in"),
        (["train", "--connect-timeout", "nan"], "--connect-timeout must be in"),
        # micro: 20,576 float32 params and their two AdamW moments per worker, 247 KB.
        (["train", "--preset", "micro", "--workers", "1000000"], "--workers 1000000 (each"),
        # Finding 8: drops with probability 1 would train nothing.
        (["train", "--drop-probability", "1"], "drop_probability must be below 1"),
        # NoLoCo: groups need M a power of 2; its own rules, and DiLoCo's alone.
        (
            ["train", "--workers", "6", "--gossip-group-size", "2"],
            "NoLoCo needs num_workers a power of 2",
        ),
        (["train", "--gossip-group-size", "3"], "NoLoCo.group_size must be a power of 2"),
        (
            ["train", "--gossip-group-size", "2", "--fragments", "5"],
            "NoLoCo (gossip=) can't be combined with schedule",
        ),
        (
            ["train", "--algo", "sync", "--gossip-group-size", "2"],
            "--gossip-group-size needs --algo diloco",
        ),
        # --elastic: the parts its runtime can't run, each with its reason.
        (["train", "--elastic", "--algo", "sync"], "--elastic runs --algo diloco or async, got"),
        (
            ["train", "--elastic", "--algo", "async", "--step-seconds", "1,2,3,4"],
            "--elastic runs without --step-seconds: its workers run at their own speeds",
        ),
        (
            [
                "train",
                "--elastic",
                "--algo",
                "async",
                "--server",
                "halos,regions=0/0/1/1,region_seconds=0.5",
            ],
            "runs without worker_seconds and region_seconds: on processes the hops are the",
        ),
        (
            [
                "train",
                "--elastic",
                "--algo",
                "async",
                "--server",
                "halos,regions=0/0/0/1",
                "--min-workers",
                "2",
            ],
            "--min-workers must be at most the smallest region's workers (1)",
        ),
        (
            [
                "train",
                "--elastic",
                "--algo",
                "async",
                "--server",
                "decoupled,quorum=2",
                "--min-workers",
                "2",
            ],
            "takes its quorum and grace from the server",
        ),
        (["train", "--gasloc", "beta=1"], "gasloc takes alpha=A and gamma=G, got 'beta=1'"),
        (["train", "--gasloc", "alpha=x"], "gasloc: alpha must be a number, got 'x'"),
        (["train", "--algo", "sync", "--gasloc", "alpha=1"], "--gasloc needs --algo diloco"),
        (["train", "--gasloc", "gamma=1"], "GASLoC.gamma must be a finite number in [0, 1)"),
        (["train", "--min-workers", "2"], "--min-workers needs --elastic"),
        (["train", "--restart-workers"], "--restart-workers needs --elastic"),
        (["train", "--elastic", "--min-workers", "5"], "--min-workers must be in [1, --workers=4]"),
        (["train", "--elastic", "--mesh", "workers=4"], "--elastic runs without --mesh"),
        (["train", "--elastic", "--checkpoint-every", "2"], "--elastic runs without --checkpoint"),
        (
            ["train", "--elastic", "--outer-delay", "1"],
            "--elastic can't run this method: a delay or eager updates",
        ),
        (
            ["train", "--elastic", "--fragments", "5"],
            "--elastic can't run this method: fragments (Streaming DiLoCo)",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(argv, message, tmp_path, capsys):
    out = tmp_path / "never"
    assert_cli_refuses([*argv, "--out", str(out)] if argv else argv, message, capsys, out)


def test_out_empty_is_refused_not_the_working_folder(tmp_path, capsys, monkeypatch):
    """Issue 40, finding 4: `--out ''` wrote the run into the working folder."""
    monkeypatch.chdir(tmp_path)
    assert_cli_refuses(["train", "--out", ""], "--out must name a folder, got ''", capsys)
    assert not any(tmp_path.iterdir())


def test_a_coordinator_that_is_not_there_is_one_line_within_the_connect_timeout(tmp_path, capsys):
    """Issue 40, finding 8: process 1 of a run whose process 0 never started waited JAX's 300
    s and died blaming "another task". Now it says what is wrong, within --connect-timeout."""
    import socket
    import time

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "never"
    argv = ["train", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    argv += ["--process-id", "1", "--connect-timeout", "2", "--out", str(out)]
    start = time.monotonic()
    assert_cli_refuses(argv, f"no coordinator at 127.0.0.1:{port} after 2 s", capsys, out)
    assert time.monotonic() - start < 10


def test_out_that_is_a_file_is_rejected(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("keep me")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--preset", "micro", "--out", str(target)])
    assert exit_info.value.code == 2 and "is not a folder" in capsys.readouterr().err
    assert target.read_text() == "keep me"


def test_module_entry_point_reports_bad_flag():
    done = subprocess.run(
        [sys.executable, "-m", "diloco_jax", "train", "--workers", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "diloco-jax: error: workers must be an integer >= 1, got 0"
    ]

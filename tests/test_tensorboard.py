"""--tensorboard: event files under OUT/tensorboard/RUN/ whose scalars equal metrics.jsonl,
read back with TensorBoard's own event reader."""

import hashlib
import json

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from diloco_jax.lm import tblog
from diloco_jax.lm import tokenizer as tok_lib
from diloco_jax.lm.cli import main
from diloco_jax.lm.runlog import RunLog

# What the issue asks TensorBoard to show, by metrics.jsonl field.
FIELDS = {
    "loss": "train/loss",
    "accuracy": "train/accuracy",  # the LM loss's aux metric (any such metric: train/NAME)
    "eval_loss": "eval/loss",
    "eval_bits_per_byte": "eval/bits_per_byte",
    "outer_grad_norm": "diloco/outer_grad_norm",
    "bytes_communicated": "communication/bytes_communicated",
    "wire_bytes": "communication/wire_bytes",
    "tokens_per_second": "throughput/tokens_per_second",
    "mfu": "throughput/mfu",
}


def _events(folder) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _expected(records) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard stores scalars as float32: each field's value at its record's steps."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for field, tag in FIELDS.items():
            if r.get(field) is not None:
                out.setdefault(tag, []).append((r["steps"], float(np.float32(r[field]))))
    return out


@pytest.mark.slow
def test_train_with_bpe_and_tensorboard_on_a_text_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(tok_lib.CACHE_ENV, str(tmp_path / "cache"))
    folder = tmp_path / "my_texts"
    folder.mkdir()
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    for i in range(12):
        lines = [" ".join(rng.choice(words, size=10)) for _ in range(60)]
        (folder / f"notes{i:02d}.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    argv = ["train", "--preset", "micro", "--data", f"text:{folder}", "--tokenizer", "bpe:300",
            "--tensorboard", "--workers", "2", "--inner-steps", "2", "--rounds", "2",
            "--pretrain-steps", "0", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    diloco = [r for r in records if r["run"] == "diloco"]
    assert len(diloco) == 2 and _events(out / "tensorboard" / "diloco") == _expected(diloco)
    assert {"outer_grad_norm", "eval_bits_per_byte", "mfu", "accuracy"} <= set(diloco[-1])
    # config.json records the tokenizer: its vocabulary (the model's) and its file's checksum.
    config = json.loads((out / "config.json").read_text())
    tok = config["tokenizer"]
    assert tok["vocab_size"] == config["model"]["vocab_size"] == 300
    cached = next((tmp_path / "cache" / "tokenizers").iterdir())
    assert tok["sha256"] == hashlib.sha256(cached.read_bytes()).hexdigest()
    assert tok["train_sha256"] in cached.name


RECORDS = [
    {"steps": 1, "loss": 2.5, "bytes_communicated": 0, "wire_bytes": 0, "mfu": None},
    {"steps": 2, "loss": 2.25, "eval_loss": 2.0, "outer_grad_norm": 0.1, "mfu": 0.5,
     "bytes_communicated": 682_598_401, "wire_bytes": 3, "tokens_per_second": 10.0},
]  # fmt: skip


def test_runlog_writes_tensorboard_and_a_rerun_replaces_it(tmp_path):
    folder = tblog.run_dir(tmp_path, "diloco")
    assert folder == tmp_path / "tensorboard" / "diloco"
    for _ in range(2):  # the second run into the same folder replaces the first
        with RunLog(tmp_path / "metrics.jsonl", 2, "x", False, folder) as log:
            for r in RECORDS:
                log(dict(r, workers=1, tokens_per_worker=1))
    assert len(list(folder.iterdir())) == 1
    assert _events(folder) == _expected(RECORDS)
    # float32, as TensorBoard stores it: 682,598,401 bytes read back as 682,598,400.
    assert _events(folder)["communication/bytes_communicated"][-1] == (2, 682_598_400.0)


def test_write_history_rewrites_a_folder(tmp_path):
    tblog.write_history(tmp_path / "a", RECORDS)
    tblog.write_history(tmp_path / "a", RECORDS[1:])
    assert _events(tmp_path / "a") == _expected(RECORDS[1:])


@pytest.mark.parametrize("value", [None, True, "x", [1.0]])
def test_scalars_skips_what_is_not_a_number(value):
    assert tblog.scalars({"steps": 1, "loss": value, "eval_loss": 1}) == {"eval/loss": 1.0}


def test_async_updates_are_placed_at_the_mean_steps_per_worker(tmp_path):
    # An async record's "steps" is the finished job's length; the x axis is the workers'
    # mean steps so far (8 / 4 = 2.0, 9 / 4 = 2.25 -> 2, 14 / 4 = 3.5 -> 4 rounding to even).
    records = [
        {"steps": 4, "steps_per_worker": 2.0, "loss": 1.0},
        {"steps": 1, "steps_per_worker": 2.25, "loss": 0.5},
        {"steps": 4, "steps_per_worker": 3.5, "loss": 0.25},
    ]
    tblog.write_history(tmp_path / "async", records)
    assert _events(tmp_path / "async")["train/loss"] == [(2, 1.0), (2, 0.5), (4, 0.25)]

"""examples/digits.py on a small budget: it runs end to end in the test process, its three
runs see the same data, and their byte counts relate as the schedule says (one sync a round
for DiLoCo, one a step for data parallelism)."""

import importlib.util
import json
import pathlib

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "digits.py"


@pytest.mark.slow
def test_digits_example_runs_and_counts_bytes(tmp_path):
    spec = importlib.util.spec_from_file_location("digits_example", EXAMPLE)
    digits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digits)
    out = tmp_path / "digits.json"
    H = 2
    results = digits.main(
        ["--workers", "2", "--rounds", "2", "--inner-steps", str(H), "--batch-size", "8",
         "--out", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text())["results"] == results
    diloco, steps, bytes_ = (results[k] for k in ("diloco", "sync_equal_steps", "sync_equal_bytes"))
    assert (diloco["steps"], steps["steps"], bytes_["steps"]) == (2 * H, 2 * H, 2)
    for row in results.values():
        assert 0.0 <= row["test_accuracy"] <= 1.0 and 0.0 <= row["train_accuracy"] <= 1.0
    # Every sync all-reduces the float32 params (DiLoCo's deltas, data parallelism's gradients)
    # and the float32 loss; DiLoCo's also the float32 count of the workers its non-finite
    # exclusion kept. A ring all-reduce over M = 2 sends 2 (M - 1) / M = 1 x the operand.
    fns = digits.dj.nnx_model_fns(digits.CNN(digits.nnx.Rngs(0)))
    p = 4 * sum(x.size for x in digits.jax.tree.leaves(fns.params))
    assert diloco["wire_bytes"] == 2 * (p + 4 + 4)
    assert steps["wire_bytes"] == 2 * H * (p + 4)
    assert bytes_["wire_bytes"] == 2 * (p + 4)
    # The BatchNorm statistics (float32 mean and var of 16 + 32 channels) are merged once a
    # round by DiLoCo and once a step by data parallelism.
    stats = 4 * 2 * (16 + 32)
    assert diloco["model_state_wire_bytes"] == 2 * stats
    assert steps["model_state_wire_bytes"] == 2 * H * stats

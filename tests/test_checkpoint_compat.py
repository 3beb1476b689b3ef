"""Checkpoints written before the round bodies were folded into one (format 1: standard
DiLoCo with drops and int8 error feedback, Streaming DiLoCo with int4 error feedback) resume
under today's code and end bit-identical to the uninterrupted run recorded then."""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from golden_cases import INNER_STEPS, data, optimizers, params
from reference import linear_loss

import diloco_jax as dj

# The recorded bits hold for the programs a user's run compiles (tests/conftest.py).
pytestmark = [pytest.mark.usefixtures("users_compiler"), pytest.mark.xla_bits]
FIXTURES = Path(__file__).parent / "data" / "checkpoints_v1"
WRITE = os.environ.get("DILOCO_JAX_WRITE_GOLDEN") == "1"
# Both compressed runs used the all-gather exchange, the only one then.
RUNS = {
    "standard": dict(
        compression="int8,ef=1,exchange=gather",
        drop_probability=0.5,
        drop_seed=1,
        exclude_nonfinite=False,
    ),
    "streaming": dict(
        compression="int4,ef=1,exchange=gather", fragments=2, overlap_steps=1, merge_alpha=0.5
    ),
}


def _train(options, num_rounds, checkpoint_dir=None):
    inner, outer = optimizers()
    return dj.train_diloco(
        linear_loss,
        params("float32"),
        data(4, "float32", nan=False) + data(4, "float32", nan=False),
        num_rounds=num_rounds,
        num_workers=4,
        inner_steps=INNER_STEPS,
        inner_optimizer=inner,
        outer_optimizer=outer,
        backend="vmap",
        checkpoint_dir=checkpoint_dir,
        keep_checkpoints=1,
        **options,
    )


@pytest.mark.parametrize("name", sorted(RUNS))
def test_v1_checkpoint_resumes_bit_identical(name, tmp_path):
    fixture = FIXTURES / name
    if WRITE:
        shutil.rmtree(fixture, ignore_errors=True)
        _train(RUNS[name], 2, fixture / "ckpt")
        full = _train(RUNS[name], 4)
        np.savez(fixture / "final_params.npz", **{k: np.asarray(v) for k, v in full.params.items()})
        pytest.skip(f"wrote {fixture}")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fixture / "ckpt", ckpt)
    resumed = _train(RUNS[name], 4, ckpt)
    assert [h["round"] for h in resumed.history] == [0, 1, 2, 3]
    with np.load(fixture / "final_params.npz") as want:
        for key in want.files:
            assert want[key].tobytes() == np.asarray(resumed.params[key]).tobytes(), key


def test_v1_checkpoint_refuses_the_two_stage_exchange(tmp_path):
    """Resuming a gathered int8 run with today's default (two-stage) exchange would change
    the run's arithmetic midway: refused, naming the field."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "standard" / "ckpt", ckpt)
    options = dict(RUNS["standard"], compression="int8,ef=1")
    with pytest.raises(ValueError, match="exchange: missing from the checkpoint"):
        _train(options, 4, ckpt)

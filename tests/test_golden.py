"""Bit-for-bit goldens: every case of tests/golden_cases.py ends with the final params, state
and history recorded before the round bodies were folded into one (tests/data/golden_*)."""

import contextlib
import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from golden_cases import INNER_STEPS, NUM_ROUNDS, cases, data, optimizers, params
from reference import linear_loss

import diloco_jax as dj

DATA = Path(__file__).parent / "data"
ARRAYS, HISTORIES = DATA / "golden_rounds.npz", DATA / "golden_histories.json"
WRITE = os.environ.get("DILOCO_JAX_WRITE_GOLDEN") == "1"
CASES = cases()


@contextlib.contextmanager
def precision(dtype):
    jax.config.update("jax_enable_x64", dtype == "float64")
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", False)


def run_case(case):
    """(arrays by name, history) of one golden case."""
    inner, outer = optimizers()
    options = case["options"]
    with precision(case["dtype"]):
        result = dj.train_diloco(
            linear_loss,
            params(case["dtype"]),
            data(options["num_workers"], case["dtype"], case["nan"]),
            num_rounds=NUM_ROUNDS,
            inner_steps=INNER_STEPS,
            inner_optimizer=inner,
            outer_optimizer=outer,
            **options,
        )
        arrays = {f"params/{k}": np.asarray(v) for k, v in result.params.items()}
        for field in ("residual", "local_params"):
            tree = getattr(result.state, field)
            if tree is not None:
                arrays |= {f"{field}/{k}": np.asarray(v) for k, v in tree.items()}
    return arrays, result.history


def _stored():
    if not ARRAYS.exists():
        return None, None
    with np.load(ARRAYS) as npz:
        arrays = {k: npz[k] for k in npz.files}
    return arrays, json.loads(HISTORIES.read_text())


@pytest.mark.slow
def test_golden_cases_are_bit_identical():
    stored_arrays, stored_histories = _stored()
    if WRITE:
        arrays, histories = {}, {}
        for name, case in CASES:
            got, histories[name] = run_case(case)
            arrays |= {f"{name}/{k}": v for k, v in got.items()}
        DATA.mkdir(exist_ok=True)
        np.savez_compressed(ARRAYS, **arrays)
        HISTORIES.write_text(json.dumps(histories, indent=0, sort_keys=True))
        pytest.skip(f"wrote {len(CASES)} golden cases")
    assert stored_arrays is not None, "no goldens recorded"
    failures = []
    for name, case in CASES:
        got, history = run_case(case)
        want = {k[len(name) + 1 :]: v for k, v in stored_arrays.items() if k.startswith(name + "/")}
        if want.keys() != got.keys():
            failures.append(f"{name}: fields {sorted(got)} != {sorted(want)}")
            continue
        for key, value in want.items():
            if value.dtype != got[key].dtype or value.tobytes() != got[key].tobytes():
                failures.append(f"{name}: {key} differs")
        if json.loads(json.dumps(history)) != stored_histories[name]:
            failures.append(f"{name}: history differs")
    assert not failures, f"{len(failures)} of {len(CASES)} cases differ:\n" + "\n".join(failures)

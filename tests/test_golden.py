"""Bit-for-bit goldens: every case of tests/golden_cases.py's `checked_cases()` ends with the
final params, state and history recorded before the round bodies were folded into one
(tests/data/golden_*). One test per case, so that pytest-xdist workers share them out.

One exception, on purpose: the old Streaming DiLoCo round accepted `exclude_nonfinite=True`
and ignored it. Now the option takes effect (a weighted exchange that leaves non-finite
workers out), so on the recorded finite data those cases agree to float rounding, not bit for
bit, and their history gains the fault fields (nobody excluded, dropped or skipped)."""

import functools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from golden_cases import INNER_STEPS, NUM_ROUNDS, cases, checked_cases, data, optimizers, params
from jax.sharding import Mesh, NamedSharding
from quick import quick
from reference import linear_loss, precision

import diloco_jax as dj
from diloco_jax.lm import model

# Recorded bits hold for the programs a user's run compiles, not the suite's -O0 ones
# (tests/conftest.py): every test here compiles as a user's run does.
pytestmark = [pytest.mark.usefixtures("users_compiler"), pytest.mark.xla_bits]

DATA = Path(__file__).parent / "data"
ARRAYS, HISTORIES = DATA / "golden_rounds.npz", DATA / "golden_histories.json"
WRITE = os.environ.get("DILOCO_JAX_WRITE_GOLDEN") == "1"
CASES = cases()
CHECKED = dict(checked_cases())


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
        for field, tree in _recorded_fields(result.state.parts).items():
            if tree is not None:
                arrays |= {f"{field}/{k}": np.asarray(v) for k, v in tree.items()}
    return arrays, result.history


def _recorded_fields(parts: dict) -> dict:
    """The state fields the recording holds, by the names they were recorded under: the
    error-feedback residuals, and each worker's own params (Streaming DiLoCo's and the drops'
    params it continues from; without fragments, eager updates' θ_m, which it continues
    from)."""
    residual = parts["compression"].residual if "compression" in parts else None
    own = None
    if "workers" in parts:
        own = parts["workers"].params
    elif "eager" in parts:
        own = parts["eager"].theta
    return {"residual": residual, "local_params": own}


@functools.cache
def _stored():
    """(arrays by case name, then field; histories by case name), read once per process."""
    if not ARRAYS.exists():
        return None, None
    arrays = {}
    with np.load(ARRAYS) as npz:
        for key in npz.files:
            name, field = key.split("/", 1)
            arrays.setdefault(name, {})[field] = npz[key]
    return arrays, json.loads(HISTORIES.read_text())


@pytest.mark.slow
def test_golden_cases_are_recorded():
    if WRITE:
        arrays, histories = {}, {}
        for name, case in CASES:
            got, histories[name] = run_case(case)
            arrays |= {f"{name}/{k}": v for k, v in got.items()}
        DATA.mkdir(exist_ok=True)
        np.savez_compressed(ARRAYS, **arrays)
        HISTORIES.write_text(json.dumps(histories, indent=0, sort_keys=True))
        pytest.skip(f"wrote {len(CASES)} golden cases")
    stored_arrays, stored_histories = _stored()
    assert stored_arrays is not None, "no goldens recorded"
    missing = [
        name for name, _ in CASES if name not in stored_arrays or name not in stored_histories
    ]
    assert not missing, f"{len(missing)} cases not recorded: {missing}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHECKED))
def test_golden_case_is_bit_identical(name):
    assert not jax.config.read("jax_disable_most_optimizations")  # the users_compiler fixture
    if WRITE:
        pytest.skip("writing the goldens (test_golden_cases_are_recorded)")
    stored_arrays, stored_histories = _stored()
    assert stored_arrays is not None, "no goldens recorded"
    got, history = run_case(CHECKED[name])
    want = stored_arrays.get(name, {})
    assert want.keys() == got.keys(), f"{name}: fields {sorted(got)} != {sorted(want)}"
    history = json.loads(json.dumps(history))  # "wire_bytes" came later
    history = [{k: v for k, v in h.items() if k != "wire_bytes"} for h in history]
    if name.endswith("-exclude-stream"):
        failures = _rounding_only(name, want, got, history, stored_histories[name])
    else:
        failures = [
            f"{name}: {key} differs"
            for key, value in want.items()
            if value.dtype != got[key].dtype or value.tobytes() != got[key].tobytes()
        ]
        if history != stored_histories[name]:
            failures.append(f"{name}: history differs")
    assert not failures, "\n".join(failures)


NO_FAULTS = {"excluded_workers": [], "dropped_workers": [], "skipped": False}


def _rounding_only(name, want, got, history, stored):
    """Failures unless `got` / `history` equal the recording to float rounding, the history
    with the fault fields added (nobody left out)."""
    failures = []
    for key, value in want.items():
        if value.dtype != got[key].dtype or not np.allclose(got[key], value, rtol=1e-5, atol=1e-6):
            failures.append(f"{name}: {key} differs beyond rounding")
    for new, old in zip(history, stored, strict=True):
        if {k: new[k] for k in NO_FAULTS} != NO_FAULTS:
            failures.append(f"{name}: round {new['round']} reports a fault")
        rest = {k: v for k, v in new.items() if k not in NO_FAULTS}
        if rest.keys() != old.keys() or not all(
            np.allclose(rest[k], old[k], rtol=1e-5, atol=1e-6) for k in old
        ):
            failures.append(f"{name}: round {new['round']} history differs beyond rounding")
    return failures


def _round_program(name):
    """The jitted round of golden case `name`, lowered for its first round."""
    case = dict(CASES)[name]
    options = dict(case["options"])
    m, backend = options.pop("num_workers"), options.pop("backend")
    inner, outer = optimizers()
    options |= dict(inner_optimizer=inner, outer_optimizer=outer)
    method = dj.method.method_from_options(None, options, caller="test")
    with precision(case["dtype"]):
        state = dj.init_state(params(case["dtype"]), m, method, backend=backend)
        batches = {k: jnp.asarray(v) for k, v in data(m, case["dtype"], case["nan"])[0].items()}
        step = dj.jit_round(
            linear_loss, method, num_workers=m, inner_steps=INNER_STEPS, backend=backend
        )
        return step.lower(state, batches)


def _lm_grad_program():
    """The micro transformer's loss and gradients, its params split over fsdp x tensor."""
    config = model.get_config("micro")
    mesh = Mesh(np.reshape(jax.devices()[:4], (2, 2)), ("fsdp", "tensor"))
    params = model.init_params(config, jax.random.key(0))
    specs = model.param_specs(config, params, mesh)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    tokens = jnp.zeros((4, config.seq_len + 1), jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return jax.jit(jax.value_and_grad(model.make_loss_fn(config))).lower(placed, batch)


@pytest.mark.parametrize(
    "program",
    quick(
        ["shard_map-float64-M4-int8,ef=1-steps-std", "lm-grads-fsdp2xtensor2"],
        {"shard_map-float64-M4-int8,ef=1-steps-std"},
    ),
)
def test_the_suites_compiles_fix_the_program_a_users_run_compiles(program):
    """The rest of the suite compiles with `jax_disable_most_optimizations` (tests/conftest.py),
    which must leave XLA's HLO passes alone: the optimized program (fusions, collectives,
    buffers: what the byte and memory tests read) is the one a user's run compiles, only the
    machine code differs."""
    lowered = _lm_grad_program() if program.startswith("lm-") else _round_program(program)
    texts = {}
    try:
        for disabled in (False, True):
            jax.config.update("jax_disable_most_optimizations", disabled)
            jax.clear_caches()  # no executable of the other setting (options given: none kept)
            compiled = lowered.compile(compiler_options={})
            texts[disabled] = (compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes)
    finally:  # the module's other tests: a user's compiles, no -O0 executable kept
        jax.config.update("jax_disable_most_optimizations", False)
        jax.clear_caches()
    assert texts[True] == texts[False]

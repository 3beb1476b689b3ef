"""The golden grid: today's train_diloco options, whose final params and histories were
recorded (tests/data/golden_*) before the round bodies were folded into one. Every case must
stay bit-identical; tests/test_golden.py replays `checked_cases()`, a subset without
redundant dtype x backend repeats. Regenerate only on purpose: DILOCO_JAX_WRITE_GOLDEN=1 pytest
tests/test_golden.py (it refuses to overwrite without that variable)."""

import itertools

import numpy as np
import optax

BACKENDS = ("vmap", "shard_map", "pmap")
COMPRESSIONS = (None, "int8,ef=1", "int4,ef=1")
DTYPES = ("float32", "float64")
NUM_ROUNDS, INNER_STEPS, NAN_ROUND, NAN_WORKER = 3, 4, 1, 1
# Fault options as train_diloco takes them; exclusion is always set explicitly.
FAULTS = {
    "none": dict(exclude_nonfinite=False),
    "exclude": dict(exclude_nonfinite=True),
    "drops": dict(exclude_nonfinite=False, drop_probability=0.5, drop_seed=3),
    "steps": dict(exclude_nonfinite=False, weighting="steps"),
}
STREAMING = dict(fragments=2, overlap_steps=1, merge_alpha=0.5)


def worker_steps(num_workers):
    return (4, 2, 3, 1)[:num_workers] if num_workers > 1 else (2,)


def cases():
    """(name, options) for every recorded case."""
    out = []
    for backend, dtype, m in itertools.product(BACKENDS, DTYPES, (1, 4)):
        if m == 1 and backend != "vmap":
            continue  # recorded, but one worker on one device is the vmap case: kept fast
        for comp, fault in itertools.product(COMPRESSIONS, FAULTS):
            out.append(_case(backend, dtype, m, comp, fault, streaming=False))
        # Streaming took exclusion (and ignored it); drops and worker_steps were refused.
        for comp, fault in itertools.product(COMPRESSIONS, ("none", "exclude")):
            out.append(_case(backend, dtype, m, comp, fault, streaming=True))
    return out


def checked_cases():
    """The cases tests/test_golden.py replays: a subset of `cases()`, each still checked bit
    for bit against its recording (the other recordings stay stored, unread).

    The dtype changes no branch of the round, so neither dtype need run the whole grid on
    every backend: vmap M = 4 keeps the full grid (every compression x fault x streaming
    option) in float32 and in float64; vmap M = 1, shard_map and pmap each run every one of
    the 18 options once, a third of them (dealt round-robin, a different third on each) in
    float64 and the rest in float32. So every option runs on every backend, in both dtypes
    on vmap M = 4, and each backend runs both dtypes with every compression, every fault
    option and both streaming modes."""
    index = {}  # option key -> its place in a group's order of cases
    for name, _ in cases():
        index.setdefault(_option_key(name), len(index))
    out = []
    for name, case in cases():
        backend, dtype, m = name.split("-")[:3]
        group = DEALT.get((backend, m))
        if group is not None:
            in_float64 = index[_option_key(name)] % len(DEALT) == group
            if in_float64 != (dtype == "float64"):
                continue
        out.append((name, case))
    return out


# The groups that run each option once, a third of them in float64 (see `checked_cases`).
DEALT = {("vmap", "M1"): 0, ("shard_map", "M4"): 1, ("pmap", "M4"): 2}


def _option_key(name):
    """A case's name without its backend, dtype and M: compression, fault, streaming."""
    return tuple(name.split("-")[3:])


def _case(backend, dtype, m, comp, fault, streaming):
    # Recorded with the all-gather exchange, the only one then (the dense codecs now default
    # to a two-stage all-reduce); the names keep the recorded spec.
    spec = None if comp is None else f"{comp},exchange=gather"
    options = dict(num_workers=m, backend=backend, compression=spec, **FAULTS[fault])
    if fault == "steps":
        options["worker_steps"] = list(worker_steps(m))
    if streaming:
        options.update(STREAMING)
    name = f"{backend}-{dtype}-M{m}-{comp or 'exact'}-{fault}-{'stream' if streaming else 'std'}"
    # NaN data is fed only to the exclusion cases without fragments (with fragments the old
    # code ignored exclusion, so NaN data would record NaN params).
    nan = fault == "exclude" and not streaming
    return name, dict(options=options, dtype=dtype, nan=nan)


def data(num_workers, dtype, nan):
    """NUM_ROUNDS rounds of {"x": [M, H, 4, 8], "y": [M, H, 4, 4]}; with `nan`, worker
    NAN_WORKER's first x of round NAN_ROUND is NaN (with M = 1 the only worker's)."""
    rng = np.random.default_rng(2026)
    rounds = []
    for r in range(NUM_ROUNDS):
        x = rng.normal(size=(num_workers, INNER_STEPS, 4, 8)).astype(dtype)
        y = rng.normal(size=(num_workers, INNER_STEPS, 4, 4)).astype(dtype)
        if nan and r == NAN_ROUND:
            x[min(NAN_WORKER, num_workers - 1), 0, 0, 0] = np.nan
        rounds.append({"x": x, "y": y})
    return rounds


def params(dtype):
    rng = np.random.default_rng(7)
    return {
        "w": (0.3 * rng.normal(size=(8, 4))).astype(dtype),
        "b": (0.1 * rng.normal(size=(4,))).astype(dtype),
    }


def optimizers():
    return optax.adam(0.05), optax.sgd(0.7, momentum=0.9, nesterov=True)

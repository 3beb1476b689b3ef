"""Every combination of the round's parts (schedule x weights x exchange) against one NumPy
reference of the round written here from the definitions: Streaming DiLoCo's fragments,
overlap and merge alpha; non-finite exclusion, drops, per-worker steps and step weighting;
exact, int8 and int4 exchanges with error feedback. Three rounds on vmap, shard_map and pmap,
in float32 and float64."""

import copy

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from quick import quick
from reference import np_blocks, precision
from reference import np_codec as reference_codec

import diloco_jax as dj
from diloco_jax import faults

M, H, R = 4, 4, 3
SIZES = {"a": 40, "b": 24}  # leaf a is fragment 0, leaf b fragment 1; 40 needs block padding
INNER_LR, INNER_MOMENTUM, OUTER_LR, OUTER_MOMENTUM = 0.5, 0.5, 0.8, 0.6
NAN_AT = (1, 1, 0)  # (round, worker, step) whose leaf-a target is NaN


def loss_fn(params, batch):
    """Two independent quadratics: 0.5 mean((a - x)^2) + 0.5 mean((b - y)^2)."""
    return 0.5 * jnp.mean((params["a"] - batch["x"]) ** 2) + 0.5 * jnp.mean(
        (params["b"] - batch["y"]) ** 2
    )


def make_data(dtype, nan):
    rng = np.random.default_rng(11)
    rounds = []
    for r in range(R):
        x = rng.normal(size=(M, H, SIZES["a"])).astype(dtype)
        y = rng.normal(size=(M, H, SIZES["b"])).astype(dtype)
        if nan and r == NAN_AT[0]:
            x[NAN_AT[1], NAN_AT[2], 3] = np.nan
        rounds.append({"x": x, "y": y})
    return rounds


def init_params(dtype):
    rng = np.random.default_rng(5)
    return {k: (0.5 * rng.normal(size=n)).astype(dtype) for k, n in SIZES.items()}


# ----------------------------------------------------------------------------- reference


def np_codec(x, bits):
    """Symmetric per-block (32) absmax quantization in float32, round half to even: (what a
    worker's payload decodes to, the largest block scale)."""
    decoded, scale = reference_codec(np_blocks(x), bits)
    return decoded.reshape(-1)[: np.size(x)], scale.max()


def reference(params, rounds, *, fragments, tau, alpha, codec, ef, exclude, drops, steps,
              weighting, carried, two_stage):  # fmt: skip
    """The round, step by step, float64 (codec arithmetic in float32 as the wire carries it).

    drops[r][p][m]: worker m dropped at sync p of round r (None: no drops). steps[m]: its
    steps per round (None: H). `two_stage`: the codec's mean is summed in float32 in worker
    order and quantized again (else the decoded deltas are averaged). Returns (θ, local
    params, residuals, history, the largest quantization step seen)."""
    leaves = ("a", "b")
    groups = [("a",), ("b",)] if fragments else [leaves]
    per = H // len(groups)
    syncs = [(g, (p + 1) * per - tau, (p + 1) * per) for p, g in enumerate(groups)]
    weighted = exclude or drops is not None or steps is not None or weighting != "uniform"
    steps = steps or [H] * M
    glob = {k: np.float64(v).copy() for k, v in params.items()}
    trace = [{k: np.zeros_like(glob[k]) for k in g} for g in groups]
    local = [copy.deepcopy(glob) for _ in range(M)]
    inner = [{k: np.zeros_like(glob[k]) for k in leaves} for _ in range(M)]
    residual = [{k: np.zeros(SIZES[k], np.float32) for k in leaves} for _ in range(M)]
    history, quantum = [], 0.0
    for r, batch in enumerate(rounds):
        if not carried:
            local = [copy.deepcopy(glob) for _ in range(M)]
        inner_start = copy.deepcopy(inner)
        losses = [[] for _ in range(M)]
        snaps, excluded, dropped_any, skipped, sq_norm = {}, set(), set(), False, 0.0
        for h in range(H):
            for m in range(M):
                if h >= steps[m]:
                    continue
                target = {"a": batch["x"][m, h], "b": batch["y"][m, h]}
                errs = {k: local[m][k] - np.float64(target[k]) for k in leaves}
                losses[m].append(sum(0.5 * np.mean(e**2) for e in errs.values()))
                for k in leaves:
                    inner[m][k] = errs[k] / SIZES[k] + INNER_MOMENTUM * inner[m][k]
                    local[m][k] = local[m][k] - INNER_LR * inner[m][k]
            for p, (group, snapshot, at) in enumerate(syncs):
                if h + 1 == snapshot:
                    snaps[p] = [{k: local[m][k].copy() for k in group} for m in range(M)]
                if h + 1 != at:
                    continue
                deltas = [{k: glob[k] - snaps[p][m][k] for k in group} for m in range(M)]
                finite = [
                    not exclude or all(np.isfinite(d).all() for d in deltas[m].values())
                    for m in range(M)
                ]
                dropped = [drops is not None and bool(drops[r][p][m]) for m in range(M)]
                included = [finite[m] and not dropped[m] for m in range(M)]
                weights = [float(steps[m]) if weighting == "steps" else 1.0 for m in range(M)]
                if not weighted:
                    weights, included = [1.0] * M, [True] * M
                sent = []
                for m in range(M):
                    if codec is None:
                        sent.append(deltas[m])
                        continue
                    value = {
                        k: (deltas[m][k] if included[m] else np.zeros(SIZES[k])).astype(np.float32)
                        + (residual[m][k] if ef else np.float32(0))
                        for k in group
                    }
                    decoded = {}
                    for k in group:
                        decoded[k], scale = np_codec(value[k], codec)
                        quantum = max(quantum, float(scale))
                    if ef and included[m]:
                        residual[m] |= {k: value[k] - decoded[k] for k in group}
                    sent.append({k: np.float64(v) for k, v in decoded.items()})
                total = sum(w for w, inc in zip(weights, included, strict=True) if inc)
                mean = {k: np.zeros(SIZES[k]) for k in group}
                if total > 0 and codec is not None and two_stage:
                    acc = {k: np.zeros(SIZES[k], np.float32) for k in group}
                    for m in range(M):
                        w = np.float32(weights[m])
                        if included[m]:
                            acc = {k: acc[k] + np.float32(sent[m][k]) * w for k in group}
                    for k in group:
                        again, scale = np_codec(acc[k] / np.float32(total), codec)
                        mean[k] = np.float64(again)
                        quantum = max(quantum, float(scale))
                elif total > 0:
                    for m in range(M):
                        if included[m]:
                            mean = {k: mean[k] + weights[m] * sent[m][k] for k in group}
                    mean = {k: v / total for k, v in mean.items()}
                if total > 0:
                    for k in group:
                        trace[p][k] = mean[k] + OUTER_MOMENTUM * trace[p][k]
                        glob[k] = glob[k] - OUTER_LR * trace[p][k]
                else:
                    skipped = True
                sq_norm += sum(np.sum(v**2) for v in mean.values())
                for m in range(M):
                    if not finite[m]:
                        excluded.add(m)
                        inner[m] = copy.deepcopy(inner_start[m])
                        if carried:
                            local[m] = copy.deepcopy(glob)
                    elif carried and not dropped[m]:
                        for k in group:
                            local[m][k] = glob[k] + alpha * (local[m][k] - glob[k])
                dropped_any |= {m for m in range(M) if dropped[m]}
        entry = {
            "loss": sum(map(sum, losses)) / sum(steps),
            "worker_loss": [np.mean(x) for x in losses],
            "outer_grad_norm": np.sqrt(sq_norm),
        }
        if weighted:
            entry |= {
                "excluded_workers": sorted(excluded),
                "dropped_workers": sorted(dropped_any),
                "skipped": skipped,
            }
        history.append(entry)
    return glob, local, residual, history, quantum


# ----------------------------------------------------------------------------- the matrix

CONFIGS = {
    # name: (train_diloco options, NaN data)
    "stream-exact-all-faults": (
        dict(fragments=2, overlap_steps=1, merge_alpha=0.5, exclude_nonfinite=True,
             drop_probability=0.3, drop_seed=4, worker_steps=[4, 2, 3, 1], weighting="steps"),
        True,
    ),
    "stream-int8-ef-all-faults": (
        dict(fragments=2, overlap_steps=1, merge_alpha=0.5, compression="int8,ef=1",
             exclude_nonfinite=True, drop_probability=0.3, drop_seed=4,
             worker_steps=[4, 2, 3, 1], weighting="steps"),
        True,
    ),
    "stream-int4-ef-gather-drops-uniform": (
        dict(fragments=2, overlap_steps=0, merge_alpha=0.0, compression="int4,ef=1,exchange=gather",
             exclude_nonfinite=True, drop_probability=0.5, drop_seed=1,
             worker_steps=[2, 4, 4, 3]),
        True,
    ),
    "stream-int8-no-faults": (
        dict(fragments=2, overlap_steps=1, merge_alpha=0.25, compression="int8",
             exclude_nonfinite=False),
        False,
    ),
    "standard-int4-ef-all-faults": (
        dict(compression="int4,ef=1", exclude_nonfinite=True, drop_probability=0.4,
             drop_seed=2, worker_steps=[1, 4, 2, 3], weighting="steps"),
        True,
    ),
    "standard-exact-drops": (
        dict(exclude_nonfinite=False, drop_probability=0.5, drop_seed=6),
        False,
    ),
    "standard-int8-gather-all-faults": (
        dict(compression="int8,ef=1,exchange=gather", exclude_nonfinite=True,
             drop_probability=0.4, drop_seed=2, worker_steps=[1, 4, 2, 3], weighting="steps"),
        True,
    ),
}  # fmt: skip


def _reference_for(options, params, data):
    """The reference run of `options`; call it under the run's precision (the drop draws
    are uniform floats of the default float dtype)."""
    fragments = options.get("fragments") is not None
    p = options.get("drop_probability")
    drops = None
    if p is not None:
        syncs = 2 if fragments else 1
        drops = [
            np.asarray(faults.drop_masks(options["drop_seed"], jnp.int32(r), M, p, syncs))
            for r in range(R)
        ]
    comp = options.get("compression")
    return reference(
        params,
        data,
        fragments=fragments,
        tau=options.get("overlap_steps", 0),
        alpha=options.get("merge_alpha", 0.0),
        codec=None if comp is None else comp.split(",")[0],
        ef=comp is not None and "ef=1" in comp,
        exclude=options.get("exclude_nonfinite", False),
        drops=drops,
        steps=options.get("worker_steps"),
        weighting=options.get("weighting", "uniform"),
        carried=fragments or p is not None,
        two_stage=comp is not None and "exchange=gather" not in comp,
    )


# Every config on every backend: on vmap in both dtypes; on shard_map in one, float64 for
# every other config (in sorted order); on pmap (shard_map's layout) in float32.
MATRIX = [
    (config, backend, dtype)
    for i, config in enumerate(sorted(CONFIGS))
    for backend, dtypes in (
        ("vmap", ("float32", "float64")),
        ("shard_map", ("float64",) if i % 2 else ("float32",)),
        ("pmap", ("float32",)),
    )
    for dtype in dtypes
]


# Quick: every config on vmap in float64 and on shard_map; the rest slow.
@pytest.mark.parametrize(
    "config, backend, dtype",
    quick(MATRIX, lambda c: c[1:] == ("vmap", "float64") or c[1] == "shard_map"),
)
def test_round_matches_numpy_reference(config, backend, dtype):
    options, nan = CONFIGS[config]
    params, data = init_params(dtype), make_data(dtype, nan)
    with precision(dtype):
        result = dj.train_diloco(
            loss_fn,
            params,
            data,
            num_rounds=R,
            num_workers=M,
            inner_steps=H,
            inner_optimizer=optax.sgd(INNER_LR, momentum=INNER_MOMENTUM),
            outer_optimizer=optax.sgd(OUTER_LR, momentum=OUTER_MOMENTUM),
            backend=backend,
            **options,
        )
        glob, local, residual, history, quantum = _reference_for(options, params, data)
    # float64 runs are exact to float64 rounding, except that a codec decodes and averages
    # in float32 (what the wire carries); history values are float32 in every run.
    if dtype == "float32":
        tol = history_tol = dict(rtol=2e-5, atol=2e-6)
    else:
        tol = dict(rtol=1e-9, atol=1e-12)
        if "compression" in options:
            tol = dict(rtol=1e-6, atol=1e-7)
        history_tol = dict(rtol=1e-6, atol=1e-7)
    for k in SIZES:
        assert result.params[k].dtype == np.dtype(dtype)
        np.testing.assert_allclose(result.params[k], glob[k], **tol, err_msg=k)
        parts = result.state.parts
        if "workers" in parts:
            want = np.stack([w[k] for w in local])
            np.testing.assert_allclose(parts["workers"].params[k], want, **tol, err_msg=k)
        if "compression" in parts:
            # Rounded in float32 (the mean on the wire is float32 in either precision), a
            # value within rounding of a code boundary may take the neighbour code: its
            # residual then differs by one quantization step.
            error = np.abs(
                np.asarray(parts["compression"].residual[k]) - np.stack([w[k] for w in residual])
            )
            assert error.max() <= quantum, k
            assert np.mean(error > 1e-3 * quantum) <= 0.05, k
    for got, want in zip(result.history, history, strict=True):
        for key, value in want.items():
            if isinstance(value, list | bool) and key != "worker_loss":
                assert got[key] == value, (got["round"], key)
            else:
                np.testing.assert_allclose(
                    got[key], value, **history_tol, equal_nan=True, err_msg=key
                )

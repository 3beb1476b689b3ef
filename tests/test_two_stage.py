"""The two-stage quantized all-reduce (the dense codecs' exchange) against a NumPy two-stage
reference written here, its bound against the exact mean, its independence of the worker
layout, and its wire bytes read from the compiled program.

Round-1 checks start from θ = 0 with outer SGD(1): then θ_1 = -Δ̄ exactly, so the exchanged
mean is read off the params with no rounding of its own."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference
from quick import quick
from reference import linear_loss, np_codec, worker_deltas

import diloco_jax as dj
from diloco_jax import comm, hlo

M, H, DIM = 8, 2, 70  # leaves b (1 block) and w (3 blocks of 32): 4 blocks, padded per D
INNER, OUTER = optax.sgd(0.1), optax.sgd(1.0)


def np_blocks(leaves):
    """Each leaf flattened and zero-padded to whole blocks of 32, the blocks stacked."""
    return np.concatenate([reference.np_blocks(x) for x in leaves])


def np_two_stage(deltas, kind, weights=None):
    """The two-stage mean of per-worker delta leaf lists: each worker's blocks quantized,
    decoded and summed in float32 in worker order (weighted, over the weight sum), the mean
    quantized again and decoded. Returns (two-stage mean blocks, one-stage mean blocks, the
    second stage's block scales)."""
    num = len(deltas)
    weights = np.ones(num, np.float32) if weights is None else np.float32(weights)
    total = np.float32(0)
    summed = np.zeros_like(np_blocks(deltas[0]))
    for m in range(num):
        if weights[m] > 0:
            summed = summed + np_codec(np_blocks(deltas[m]), kind)[0] * weights[m]
            total = total + weights[m]
    one_stage = summed / total
    two_stage, scale = np_codec(one_stage, kind)
    return two_stage, one_stage, scale


def _params():
    return {"w": jnp.zeros(DIM, jnp.float32), "b": jnp.float32(0.0)}


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(M, H, 2, DIM)).astype(np.float32),
        "y": rng.normal(size=(M, H, 2)).astype(np.float32),
    }


def _worker_deltas(params, batch):
    return worker_deltas(params, batch, INNER)


def _np_deltas(batch):
    """[b, w] float32 leaves of every worker's delta (leaf order of jax.tree.leaves)."""
    d = jax.tree.map(np.asarray, _worker_deltas(_params(), batch))
    return [[d["b"][m], d["w"][m]] for m in range(M)]


@functools.cache
def _round(backend, devices, compression, exclude=False):
    found = jax.devices()[:devices]
    return jax.jit(
        functools.partial(
            dj.diloco_round,
            linear_loss,
            inner_optimizer=INNER,
            outer_optimizer=OUTER,
            backend=dj.make_backend(backend, M, found),
            compression=compression,
            exclude_nonfinite=exclude,
        )
    )


def _mean_blocks(backend, devices, compression, batch, exclude=False):
    """The exchanged mean as blocks [NB, 32] (and the round's metrics)."""
    state = dj.init_state(
        _params(), M, inner_optimizer=INNER, outer_optimizer=OUTER, compression=compression
    )
    state, metrics = _round(backend, devices, compression, exclude)(state, batch)
    mean = jax.tree.map(lambda x: -np.asarray(x), state.params)
    return np_blocks([mean["b"], mean["w"]]), state, metrics


def _assert_matches_reference(got, want, scale):
    """Equal to float rounding, except that an element within rounding of a code boundary
    may take the neighbour code (one quantization step of its block)."""
    step = np.repeat(scale, 32).reshape(got.shape) * 1.01 + 1e-12
    err = np.abs(got - want)
    assert np.all(err <= step)
    assert np.mean(err > 1e-6 * np.abs(want) + 1e-12) <= 0.05


@pytest.mark.parametrize("kind", ["int8", "int4", "e3m0"])
def test_two_stage_mean_matches_numpy_and_its_bound(kind):
    batch = _batch()
    two, one, scale = np_two_stage(_np_deltas(batch), kind)
    got, _, _ = _mean_blocks("shard_map", M, kind, batch)
    step = scale if kind != "e3m0" else scale / 64  # e3m0: its finest grid step
    _assert_matches_reference(got, two, step)
    # The second quantization's error is not fed back; it is bounded per element by half a
    # step of the mean's block (int8 / int4), or e3m0's grid spacing (relative 1/3 above
    # s/64, absolute s/128 below).
    s = np.repeat(scale, 32).reshape(got.shape)
    if kind == "e3m0":
        bound = np.maximum(np.abs(one) / 3.0, s / 128.0)
    else:
        bound = s / 2
    assert np.all(np.abs(got - one) <= bound * (1 + 1e-5) + 1e-12)


def test_weighted_two_stage_leaves_a_nan_worker_out():
    batch = _batch(1)
    batch["x"][3, 0, 0, 0] = np.nan
    deltas = _np_deltas(batch)
    weights = [0.0 if m == 3 else 1.0 for m in range(M)]
    deltas[3] = [np.zeros_like(x) for x in deltas[3]]  # never read: weight 0
    two, _, scale = np_two_stage(deltas, "int8", weights)
    for backend, devices in [("vmap", 1), ("shard_map", 8), ("shard_map", 4), ("pmap", 8)]:
        got, _, metrics = _mean_blocks(backend, devices, "int8", batch, exclude=True)
        _assert_matches_reference(got, two, scale)
        assert np.flatnonzero(metrics["excluded_workers"]).tolist() == [3]


def test_error_feedback_keeps_the_first_stage_residual():
    batch = _batch(2)
    deltas = _np_deltas(batch)
    _, state, _ = _mean_blocks("shard_map", M, "int4,ef=1", batch)
    for m in range(M):
        blocks = np_blocks(deltas[m])
        want = blocks - np_codec(blocks, "int4")[0]
        residual = state.parts["compression"].residual
        got = np_blocks([residual["b"][m], residual["w"][m]])
        # XLA may fuse value - q * scale into one rounding: equal to the deltas' float rounding
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "spec", quick(["int8,ef=1", "int4", "e3m0", "bf16", "fp8"], {"int8,ef=1", "int4"})
)
def test_every_layout_gives_the_same_mean(spec):
    """8 workers on 1, 2, 4 or 8 devices, through vmap, shard_map and pmap: every worker
    encodes its own delta and the sums run in worker order, so the layout doesn't matter."""
    batch = _batch(3)
    base, _, _ = _mean_blocks("vmap", 1, spec, batch)
    for backend, devices in [("shard_map", 8), ("shard_map", 4), ("shard_map", 2), ("pmap", 8)]:
        got, _, _ = _mean_blocks(backend, devices, spec, batch)
        np.testing.assert_allclose(got, base, rtol=1e-6, atol=1e-9, err_msg=f"{backend} {devices}")


# ----------------------------------------------------------------------------- wire bytes

WIRE_PARAMS = {"w": jnp.zeros((256, 64)), "b": jnp.zeros(64)}
# The round layouts the wire-byte tests compile: one sync unweighted, two fragments weighted.
LAYOUTS = [(None, False), (2, True)]


@functools.cache  # the tests below share their programs (a process compiles each once)
def _compiled_wire_bytes(num_workers, compression, fragments=None, exclude=False, **delay):
    def loss(p, b):
        return 0.5 * jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)

    state = dj.init_state(
        WIRE_PARAMS,
        num_workers,
        inner_optimizer=INNER,
        outer_optimizer=OUTER,
        compression=compression,
        fragments=fragments,
        **delay,
    )
    batch = {"x": jnp.ones((num_workers, 2, 2, 256)), "y": jnp.ones((num_workers, 2, 2, 64))}
    round_fn = functools.partial(
        dj.diloco_round,
        loss,
        inner_optimizer=INNER,
        outer_optimizer=OUTER,
        backend=dj.make_backend("shard_map", num_workers),
        compression=compression,
        fragments=fragments,
        exclude_nonfinite=exclude,
        **delay,
    )
    return hlo.wire_bytes(jax.jit(round_fn).lower(state, batch).compile())


SPECS = [None, "bf16", "fp8", "int8", "int4", "e3m0", "topk:0.01", "sign_prune:0.5"]


@pytest.mark.parametrize("num_workers", quick([2, 4, 8], {2}))
def test_wire_bytes_formula_is_the_compiled_program(num_workers):
    # Every codec at M = 8; at M = 2 and 4 one of each exchange (compiles are the cost).
    specs = SPECS + ["int8,exchange=gather"] if num_workers == 8 else [None, "int4", "topk:0.01"]
    for spec in specs:
        for fragments, exclude in LAYOUTS:
            got = _compiled_wire_bytes(num_workers, spec, fragments, exclude)
            want = comm.round_wire_bytes(
                WIRE_PARAMS, spec, num_workers, fragments=fragments, weighted=exclude
            )
            assert got == pytest.approx(want, rel=1e-9), (spec, fragments, exclude)


@pytest.mark.parametrize("delay", [dict(outer_delay=1), dict(outer_delay=2, eager=True)])
def test_a_delay_moves_the_exchange_but_sends_the_same_bytes(delay):
    for fragments in (None, 2):
        got = _compiled_wire_bytes(4, "int4", fragments, **delay)
        assert got == comm.round_wire_bytes(WIRE_PARAMS, "int4", 4, fragments=fragments)


@pytest.mark.parametrize("num_workers", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_quantized_rounds_send_a_fraction_of_the_exact_bytes(num_workers):
    # The layouts of the formula test above: most of these programs are its own.
    for fragments, exclude in LAYOUTS:
        exact = _compiled_wire_bytes(num_workers, None, fragments, exclude)
        assert _compiled_wire_bytes(num_workers, "int8", fragments, exclude) <= 0.30 * exact
        assert _compiled_wire_bytes(num_workers, "int4", fragments, exclude) <= 0.18 * exact


def test_sparse_gathers_cost_more_than_float32_from_a_worker_count_on():
    """The sparse codecs keep the all-gather (every worker's indices differ), so their wire
    bytes grow with M: for a 256 x 64 (+ 64) float32 model, sign_prune:0.5 (a packed mask and
    half the values) sends more than the exact all-reduce from M = 4 on, topk:0.01 (1% of
    the values with int32 indices) from M = 100 on. SparseLoCo at its defaults: the matrix's
    4 chunks of 64 x 64 keep 128 values each (2 bits: 128 bytes; 12-bit offsets: 768), the
    bias's one chunk keeps 2 (1 byte; uint8 offsets: 2), and each tensor sends its 4 bins'
    float32 values (32): 931 bytes, gathered from M - 1 workers, against 2 (M - 1) / M x
    65,792 for float32 (the 4-byte loss all-reduce on both sides): costlier once 931 M >
    131,584, from M = 142 on."""

    def first_costlier(spec):
        return next(
            m
            for m in range(2, 1000)
            if comm.round_wire_bytes(WIRE_PARAMS, spec, m)
            > comm.round_wire_bytes(WIRE_PARAMS, None, m)
        )

    assert first_costlier("sign_prune:0.5") == 4
    assert first_costlier("topk:0.01") == 100
    assert dj.comm.round_bytes(WIRE_PARAMS, "sparseloco") == 128 + 768 + 1 + 2 + 32
    assert first_costlier("sparseloco") == 142


def test_history_reports_the_wire_bytes():
    batch = _batch(4)
    result = dj.train_diloco(
        linear_loss, _params(), [batch, batch], num_rounds=2, num_workers=M, inner_steps=H,
        compression="int8", backend="shard_map", inner_optimizer=INNER, outer_optimizer=OUTER,
    )  # fmt: skip
    # By hand: w's 70 values fill 3 int8 blocks of 32 and b 1 block, each 32 codes + a
    # float32 scale: 144 bytes of payload. On the wire the 4 rows are padded to 8 (one per
    # device), 288 bytes: the all-to-all sends 7/8 of them (252), the all-gather 7 of the 36-
    # byte reduced rows (252), and the loss all-reduce 2 x 7/8 x 4 (7): 511 per round.
    assert [h["wire_bytes"] for h in result.history] == [511, 1022]
    assert result.history[0]["bytes_communicated"] == 144


# ------------------------------------------------ 16 devices (a subprocess of its own)

SIXTEEN = r"""
import functools, json, sys
import jax, jax.numpy as jnp, numpy as np, optax
sys.path.insert(0, sys.argv[1])
import test_two_stage as t
import diloco_jax as dj
from diloco_jax import comm
out = {"exact": t._compiled_wire_bytes(16, None), "int8": t._compiled_wire_bytes(16, "int8"),
       "int4": t._compiled_wire_bytes(16, "int4"),
       "int4_fragments": t._compiled_wire_bytes(16, "int4", 2),
       "exact_fragments": t._compiled_wire_bytes(16, None, 2),
       "formula_int4": comm.round_wire_bytes(t.WIRE_PARAMS, "int4", 16)}
rng = np.random.default_rng(0)
data = [{"x": rng.normal(size=(16, 2, 2, 70)).astype(np.float32),
         "y": rng.normal(size=(16, 2, 2)).astype(np.float32)} for _ in range(2)]
for devices in (16, 8):
    r = dj.train_diloco(t.linear_loss, t._params(), data, num_rounds=2, num_workers=16,
        inner_steps=2, backend="shard_map", devices=jax.devices()[:devices],
        compression="int8,ef=1", inner_optimizer=t.INNER, outer_optimizer=t.OUTER)
    out[f"params_{devices}"] = np.concatenate([np.ravel(r.params["b"]), r.params["w"]]).tolist()
    out[f"wire_{devices}"] = r.history[-1]["wire_bytes"]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_sixteen_workers_on_sixteen_or_eight_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=16")
    here = Path(__file__).parent
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent), str(here)])
    done = subprocess.run(
        [sys.executable, "-c", SIXTEEN, str(here)], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["int8"] <= 0.30 * out["exact"] and out["int4"] <= 0.18 * out["exact"]
    assert out["int4_fragments"] <= 0.18 * out["exact_fragments"]
    assert out["int4"] == pytest.approx(out["formula_int4"], rel=1e-9)
    np.testing.assert_allclose(out["params_8"], out["params_16"], rtol=1e-6, atol=1e-9)
    assert out["wire_8"] == out["wire_16"]

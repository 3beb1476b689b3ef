"""diloco_round with compressed outer gradients exchanged by the all-gather of every payload
(`exchange=gather`: the sparse codecs' exchange, and the dense ones' when asked; the dense
codecs' default two-stage all-reduce is tests/test_two_stage.py's), against NumPy references
and compiled HLO.

Round-1 checks start from θ = 0 with outer SGD(1): then θ_1 = 0 - 1 * Δ̄ exactly, so the
exchanged mean Δ̄ is read off as -θ_1 with no rounding. Per-worker deltas for the references
come from running `inner_loop` on each worker's batches outside the round.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from reference import linear_loss, worker_deltas

import diloco_jax as dj
from diloco_jax import comm, hlo
from diloco_jax import compression as C

M, H, DIM = 8, 2, 37  # 37: a leaf that needs block padding (block_size 32)
INNER = optax.sgd(0.1)
OUTER = optax.sgd(1.0)
BACKENDS = ("vmap", "shard_map", "pmap")


def as_gathered(spec):
    """`spec` with the all-gather exchange (dense kinds; other specs unchanged)."""
    if spec is None or isinstance(spec, C.Compression):
        return spec
    kind = spec.split(",")[0].split(":")[0]
    return f"{spec},exchange=gather" if kind in C.DENSE_KINDS else spec


def _params(dim=DIM):
    return {"w": jnp.zeros(dim, jnp.float32), "b": jnp.float32(0.0)}


def _batch(num_workers=M, seed=0, dim=DIM):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(num_workers, H, 2, dim)).astype(np.float32),
        "y": rng.normal(size=(num_workers, H, 2)).astype(np.float32),
    }


@functools.cache
def _round_fn(backend: str, num_workers: int, compression):
    return jax.jit(
        functools.partial(
            dj.diloco_round,
            linear_loss,
            inner_optimizer=INNER,
            outer_optimizer=OUTER,
            backend=dj.make_backend(backend, num_workers),
            compression=as_gathered(compression),
        )
    )


def _run(backend, compression, num_rounds=1, num_workers=M, params=None):
    """(state after `num_rounds`, metrics of the last round); batches seeded by round."""
    params = _params() if params is None else params
    state = dj.init_state(
        params,
        num_workers,
        inner_optimizer=INNER,
        outer_optimizer=OUTER,
        compression=as_gathered(compression),
    )
    state = _placed(state, backend, num_workers)
    for r in range(num_rounds):
        state, metrics = _round_fn(backend, num_workers, compression)(
            state, _batch(num_workers, seed=r)
        )
    return state, metrics


def _placed(state, backend, num_workers):
    """The state laid out as a round returns it, so round 2 reuses round 1's executable."""
    b = dj.make_backend(backend, num_workers)
    return dj.DiLoCoState(
        b.place_shared(state.params),
        b.place_shared(state.outer_opt_state),
        b.place_workers(state.inner_opt_state),
        b.place_shared(state.round),
        parts={name: b.place_workers(part) for name, part in state.parts.items()},
    )


def _worker_deltas(params, batch):
    return worker_deltas(params, batch, INNER)


def _np(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _bits_equal(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        x, y = np.atleast_1d(np.asarray(x)), np.atleast_1d(np.asarray(y))
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def _np_int8(x, block_size=32):
    """Independent int8 codec: per-block absmax / 127 scales, round half to even, float32."""
    flat = np.ravel(x).astype(np.float32)
    n = flat.size
    blocks = np.zeros(-(-n // block_size) * block_size, np.float32)
    blocks[:n] = flat
    blocks = blocks.reshape(-1, block_size)
    scale = np.abs(blocks).max(axis=1) / np.float32(127)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.round(blocks / safe[:, None]), -127, 127)
    return (q * scale[:, None]).reshape(-1)[:n].reshape(np.shape(x))


def _roundtrip(x, compression):
    c = C.parse_compression(compression)
    return np.asarray(C.decode(C.encode(jnp.asarray(x), c), c, np.shape(x), jnp.float32))


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("backend", BACKENDS)
def test_none_is_the_exact_round_bit_for_bit(backend):
    exact_state, exact_metrics = _run(backend, None, num_rounds=2)
    state, metrics = _run(backend, "none,ef=1", num_rounds=2)
    assert "compression" not in state.parts  # "none" loses nothing: no residual to carry
    _bits_equal((state, metrics), (exact_state, exact_metrics))
    # Not just equal numbers: the same program (one all-reduce of the deltas).
    args = (dj.init_state(_params(), M, inner_optimizer=INNER, outer_optimizer=OUTER), _batch())
    specs = (None, "none", C.Compression("none"), "none,ef=1")
    texts = {_round_fn(backend, M, spec).lower(*args).as_text() for spec in specs}
    assert len(texts) == 1


def test_bf16_round_is_the_mean_of_bf16_deltas():
    deltas = _np(_worker_deltas(_params(), _batch()))
    state, _ = _run("vmap", "bf16")
    for name, d in deltas.items():
        rounded = d.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
        got = -np.asarray(state.params[name], np.float64)
        tol = 1e-6 * np.abs(d).max()  # float32 mean of bf16 values
        np.testing.assert_allclose(got, rounded.mean(axis=0), rtol=0, atol=tol)
        # ... which is within bf16 precision of the exact mean, and not equal to it.
        np.testing.assert_allclose(got, d.mean(axis=0), rtol=0, atol=2**-8 * np.abs(d).max())
    assert not np.allclose(-np.asarray(state.params["w"]), deltas["w"].mean(0), rtol=1e-6)


@pytest.mark.parametrize("spec,block_size", [("int8", 32), ("int8,block_size=8", 8)])
def test_int8_round_is_the_mean_of_numpy_quantized_deltas(spec, block_size):
    deltas = _np(_worker_deltas(_params(), _batch()))
    state, _ = _run("vmap", spec)
    for name, d in deltas.items():
        decoded = np.stack([_np_int8(d[m], block_size) for m in range(M)]).astype(np.float64)
        got = -np.asarray(state.params[name], np.float64)
        tol = 1e-6 * np.abs(d).max()  # float32 summation order of the mean only
        np.testing.assert_allclose(got, decoded.mean(axis=0), rtol=0, atol=tol)
        assert got.dtype == np.float64 and state.params[name].dtype == jnp.float32


@pytest.mark.parametrize("num_workers", [8, 16])  # 1 and 2 workers per device
def test_backends_agree_under_compression(num_workers):
    runs = {be: _run(be, "int4,ef=1", 2, num_workers) for be in BACKENDS}
    ref_state, ref_metrics = runs["vmap"]
    assert jax.tree.leaves(ref_state.parts["compression"])[0].shape[0] == num_workers
    for state, metrics in runs.values():
        # Backends sum in different orders, so deltas differ by float32 rounding; int4 codes
        # then agree, and residuals (delta minus its decoded code) differ by that rounding.
        for got, want in [(state.params, ref_state.params), (state.parts, ref_state.parts)]:
            for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(metrics["worker_loss"], ref_metrics["worker_loss"], rtol=1e-6)


# ----------------------------------------------------------------------------- error feedback


def test_error_feedback_residual_and_its_use_in_round_2():
    spec = "int4,ef=1"
    state0 = dj.init_state(
        _params(), M, inner_optimizer=INNER, outer_optimizer=OUTER, compression=as_gathered(spec)
    )
    residual0 = state0.parts["compression"].residual
    for leaf, p in zip(jax.tree.leaves(residual0), jax.tree.leaves(_params()), strict=True):
        assert leaf.shape == (M,) + p.shape and leaf.dtype == jnp.float32
        assert not np.any(np.asarray(leaf))
    round_fn = _round_fn("vmap", M, spec)

    # Round 1: residual_m = Δ_m - decode(encode(Δ_m)).
    deltas1 = _worker_deltas(state0.params, _batch(seed=0))
    state1, _ = round_fn(state0, _batch(seed=0))
    residual1 = {}
    for name, d in deltas1.items():
        d = np.asarray(d)
        decoded = np.stack([_roundtrip(d[m], spec) for m in range(M)])
        residual1[name] = d - decoded
        # XLA may fuse Δ - q * s into one fma: the residual is then exact, not rounded twice.
        tol = 2**-22 * np.abs(d).max()
        residual = state1.parts["compression"].residual[name]
        np.testing.assert_allclose(residual, residual1[name], rtol=0, atol=tol)
        np.testing.assert_allclose(-np.asarray(state1.params[name]), decoded.mean(0), atol=1e-8)
    assert np.abs(residual1["w"]).max() > 1e-4  # int4 drops a lot: the check below has teeth

    # Round 2: each worker sends encode(Δ_m + residual_m).
    deltas2 = _worker_deltas(state1.params, _batch(seed=1))
    state2, _ = round_fn(state1, _batch(seed=1))
    for name, d in deltas2.items():
        value = np.asarray(d) + residual1[name]
        decoded = np.stack([_roundtrip(value[m], spec) for m in range(M)])
        sent = np.asarray(state1.params[name], np.float64) - np.asarray(state2.params[name])
        tol = 1e-6 * np.abs(np.asarray(state1.params[name])).max()  # rounding of θ_1 - Δ̄
        np.testing.assert_allclose(sent, decoded.mean(0), rtol=0, atol=tol)
        res_tol = 2**-22 * np.abs(value).max()
        residual = state2.parts["compression"].residual[name]
        np.testing.assert_allclose(residual, value - decoded, rtol=0, atol=res_tol)
        if name == "w":
            without = np.stack([_roundtrip(np.asarray(d)[m], spec) for m in range(M)]).mean(0)
            assert np.abs(sent - without).max() > 100 * tol


def test_a_state_must_hold_what_the_compression_needs():
    state = dj.init_state(
        _params(), M, inner_optimizer=INNER, outer_optimizer=OUTER
    )  # built without compression
    assert "compression" not in state.parts
    with pytest.raises(ValueError, match=r"another method.*\[\"parts\['compression'\]\"\]"):
        _round_fn("vmap", M, "int8,ef=1")(state, _batch())
    # Residuals a round without feedback would never read: another method's state too.
    ef_state = dj.init_state(
        _params(),
        M,
        inner_optimizer=INNER,
        outer_optimizer=OUTER,
        compression=as_gathered("int8,ef=1"),
    )
    with pytest.raises(ValueError, match=r"another method.*\[\"parts\['compression'\]\"\]"):
        _round_fn("vmap", M, "int8")(ef_state, _batch())
    # Without error feedback an exact and an int8 round hold the same state: both run it.
    _round_fn("vmap", M, "int8")(state, _batch())


def test_invalid_compression_raises():
    with pytest.raises(ValueError, match="compression"):
        dj.init_state(
            _params(), M, inner_optimizer=INNER, outer_optimizer=OUTER, compression="int9"
        )
    with pytest.raises(ValueError, match="compression"):
        dj.diloco_round(
            linear_loss,
            dj.init_state(_params(), M, inner_optimizer=INNER, outer_optimizer=OUTER),
            _batch(),
            inner_optimizer=INNER,
            outer_optimizer=OUTER,
            compression="topk",  # needs a keep fraction
        )
    with pytest.raises(ValueError, match="compression"):
        comm.round_bytes(_params(), "nope")


def test_state_stays_positionally_constructible():
    state = dj.init_state(_params(), M, inner_optimizer=INNER, outer_optimizer=OUTER)
    rebuilt = dj.DiLoCoState(state.params, state.outer_opt_state, state.inner_opt_state, 0)
    assert rebuilt.model_state is None and rebuilt.parts == {}


# ----------------------------------------------------------------------------- compiled bytes

BIG = 4096


def _w_loss(params, batch):
    return 0.5 * jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _big_program(backend, compression, num_workers=M):
    params = {"w": jnp.zeros(BIG, jnp.float32)}
    state = dj.init_state(
        params,
        num_workers,
        inner_optimizer=INNER,
        outer_optimizer=OUTER,
        compression=as_gathered(compression),
    )
    batch = {
        "x": jax.ShapeDtypeStruct((num_workers, 1, 1, BIG), jnp.float32),
        "y": jax.ShapeDtypeStruct((num_workers, 1, 1), jnp.float32),
    }
    round_fn = functools.partial(
        dj.diloco_round,
        _w_loss,
        inner_optimizer=INNER,
        outer_optimizer=OUTER,
        backend=dj.make_backend(backend, num_workers),
        compression=as_gathered(compression),
        exclude_nonfinite=False,  # the unweighted exchange
    )
    return params, hlo.collectives(jax.jit(round_fn).lower(state, batch).compile())


_INTEGER = {"u8", "s8", "u16", "s32"}


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
@pytest.mark.parametrize(
    "spec,min_ratio",
    [("bf16", 1.5), ("int8", 3), ("fp8", 3), ("int4", 6), ("e3m0", 6), ("topk:0.01", 40)],
)
def test_compiled_collectives_shrink(backend, spec, min_ratio):
    params, exact = _big_program(backend, None)
    # Uncompressed: all-reduces of |θ| x 4 bytes plus the scalar mean loss (XLA may combine them).
    assert {c.op for c in exact} == {"all-reduce"}
    assert sum(c.operand_bytes for c in exact) == BIG * 4 + 4
    _, found = _big_program(backend, spec)
    assert not any(c.in_loop for c in found)
    gathers = [c for c in found if c.op == "all-gather"]
    others = [c for c in found if c.op != "all-gather"]
    assert [(c.op, c.operand_bytes) for c in others] == [("all-reduce", 4)]  # the mean loss
    gathered = sum(c.operand_bytes for c in gathers)
    assert gathered == comm.round_bytes(params, spec)
    assert BIG * 4 / gathered >= min_ratio
    # Codes travel as integers; float32 only for the per-block scales / kept values.
    dtypes = [
        (dt, shape)
        for c in gathers
        for dt, shape in zip(c.operand_dtypes, c.operand_shapes, strict=True)
    ]
    assert {dt for dt, _ in dtypes} <= _INTEGER | {"f32"}
    floats = sum(4 * int(np.prod(shape)) for dt, shape in dtypes if dt == "f32")
    c = C.parse_compression(spec)
    expected_floats = {"bf16": 0, "topk": 4 * C.num_kept(BIG, 0.01)}.get(
        c.kind, 4 * BIG // c.block_size
    )
    assert floats == expected_floats


def test_compiled_bytes_with_two_workers_per_device():
    params, found = _big_program("shard_map", "int8", num_workers=16)
    gathered = sum(c.operand_bytes for c in found if c.op == "all-gather")
    assert gathered == 2 * comm.round_bytes(params, "int8")  # each device sends its 2 workers'


def test_vmap_backend_compiles_no_collective_under_compression():
    _, found = _big_program("vmap", "int4,ef=1")
    assert found == []


def test_round_bytes():
    params = {"w": jnp.zeros(BIG, jnp.bfloat16), "b": jnp.float32(0)}
    # Uncompressed: deltas in float32 whatever the param dtype.
    assert comm.round_bytes(params) == comm.round_bytes(params, "none") == (BIG + 1) * 4
    # int8: codes (padded to the block) + one float32 scale per block, per leaf.
    assert comm.round_bytes(params, "int8") == (BIG + 4 * BIG // 32) + (32 + 4)
    assert comm.round_bytes(params, "int4,block_size=64") == (BIG // 2 + 4 * BIG // 64) + (32 + 4)
    assert comm.round_bytes(params, "bf16") == (BIG + 1) * 2


def test_train_diloco_with_compression_reports_payload_bytes_and_carries_residual():
    # w: 4096 float32 -> int4 codes 4096 / 2 = 2048 bytes + 128 blocks x 4-byte scales = 512;
    # b: 1 element padded to one block of 32 -> 16 bytes of codes + one 4-byte scale = 20.
    rng = np.random.default_rng(5)
    params = {"w": jnp.zeros(4096), "b": jnp.float32(0)}
    rounds = [
        {
            "x": rng.normal(size=(4, 2, 2, 4096)).astype(np.float32),
            "y": rng.normal(size=(4, 2, 2)).astype(np.float32),
        }
        for _ in range(3)
    ]
    kw = dict(num_rounds=3, num_workers=4, inner_steps=2, backend="shard_map")
    exact = dj.train_diloco(linear_loss, params, rounds, **kw)
    none = dj.train_diloco(linear_loss, params, rounds, compression="none", **kw)
    jax.tree.map(np.testing.assert_array_equal, none.params, exact.params)
    int4 = dj.train_diloco(linear_loss, params, rounds, compression=as_gathered("int4,ef=1"), **kw)
    assert [h["bytes_communicated"] for h in int4.history] == [2580, 5160, 7740]
    assert exact.history[0]["bytes_communicated"] == (4096 + 1) * 4
    residual = int4.state.parts["compression"].residual
    assert residual["w"].shape == (4, 4096)
    assert float(jnp.max(jnp.abs(residual["w"]))) > 0
    # 4-bit deltas still train: the result stays close to the exact run's.
    np.testing.assert_allclose(int4.params["w"], exact.params["w"], atol=0.05)
    with pytest.raises(ValueError, match="compression"):
        dj.train_diloco(linear_loss, params, rounds, compression="int3", **kw)


# ----------------------------------------------------------------------------- with faults


def _faulty_run(backend, spec, batch, num_workers=M, **options):
    """One round from θ = 0 with fault options under `spec`: (state, metrics)."""
    drops = options.get("drop_probability")
    state = dj.init_state(
        _params(),
        num_workers,
        inner_optimizer=INNER,
        outer_optimizer=OUTER,
        compression=as_gathered(spec),
        drop_probability=drops,
    )
    round_fn = jax.jit(
        functools.partial(
            dj.diloco_round, linear_loss, inner_optimizer=INNER, outer_optimizer=OUTER,
            backend=dj.make_backend(backend, num_workers), compression=as_gathered(spec), **options,
        )
    )  # fmt: skip
    return round_fn(state, batch)


def _nan_batch(worker):
    batch = _batch()
    batch["x"][worker, 0, 0, 0] = np.nan
    return batch


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_worker_is_left_out_of_the_compressed_mean(backend):
    batch = _nan_batch(2)
    deltas = _np(_worker_deltas(_params(), batch))
    assert not np.isfinite(deltas["w"][2]).all()
    state, metrics = _faulty_run(backend, "int8,ef=1", batch, exclude_nonfinite=True)
    kept = [m for m in range(M) if m != 2]
    for name, d in deltas.items():
        decoded = np.stack([_np_int8(d[m]) for m in kept]).astype(np.float64)
        got = -np.asarray(state.params[name], np.float64)
        np.testing.assert_allclose(
            got, decoded.mean(axis=0), rtol=0, atol=1e-6 * np.abs(d[kept]).max()
        )
        # Included workers keep what int8 dropped; the excluded one sent nothing: residual 0.
        residual = np.asarray(state.parts["compression"].residual[name], np.float64)
        assert not np.any(residual[2])
        np.testing.assert_allclose(
            residual[kept], d[kept] - decoded, rtol=0, atol=2**-22 * np.abs(d[kept]).max()
        )
    assert np.asarray(metrics["excluded_workers"]).tolist() == [m == 2 for m in range(M)]
    assert not bool(metrics["skipped"])


def test_drops_and_step_weights_under_compression():
    # Workers 0-3 take both inner steps, 4-7 one; drops keyed by (seed, round 0); each kept
    # worker's decoded delta weighs h_m.
    steps = [2, 2, 2, 2, 1, 1, 1, 1]
    batch = _batch()
    full = _np(_worker_deltas(_params(), batch))
    one = _np(_worker_deltas(_params(), {k: v[:, :1] for k, v in batch.items()}))
    dropped = np.asarray(dj.faults.drop_mask(5, jnp.int32(0), M, 0.4))
    assert 0 < dropped.sum() < M - 1 and not dropped.all()
    state, metrics = _faulty_run(
        "shard_map", "int8", batch, drop_probability=0.4, drop_seed=5, worker_steps=steps,
        weighting="steps",
    )  # fmt: skip
    kept = [m for m in range(M) if not dropped[m]]
    for name in full:
        d = np.where(
            np.array(steps)[:, None] == 2, full[name].reshape(M, -1), one[name].reshape(M, -1)
        )
        decoded = np.stack([_np_int8(d[m]) for m in kept]).astype(np.float64)
        weights = np.array([steps[m] for m in kept], np.float64)
        want = (weights[:, None] * decoded).sum(0) / weights.sum()
        got = -np.asarray(state.params[name], np.float64).reshape(-1)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(d).max())
    assert np.asarray(metrics["dropped_workers"]).tolist() == dropped.tolist()


def test_compiled_bytes_of_a_compressed_round_with_exclusion():
    params = {"w": jnp.zeros(BIG, jnp.float32)}
    state = dj.init_state(
        params, M, inner_optimizer=INNER, outer_optimizer=OUTER, compression=as_gathered("int8")
    )
    batch = {
        "x": jax.ShapeDtypeStruct((M, 1, 1, BIG), jnp.float32),
        "y": jax.ShapeDtypeStruct((M, 1, 1), jnp.float32),
    }
    round_fn = functools.partial(
        dj.diloco_round, _w_loss, inner_optimizer=INNER, outer_optimizer=OUTER,
        backend=dj.make_backend("shard_map", M), compression=as_gathered("int8"),
        exclude_nonfinite=True,
    )  # fmt: skip
    found = hlo.collectives(jax.jit(round_fn).lower(state, batch).compile())
    assert not any(c.in_loop for c in found)
    gathered = sum(c.operand_bytes for c in found if c.op == "all-gather")
    # The payloads, plus each worker's float32 weight in the mean.
    assert gathered == comm.round_bytes(params, "int8") + 4

"""Tests for diloco_jax.compression. Expected values come from NumPy arithmetic written here."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from diloco_jax import compression as C
from diloco_jax.compression import Compression, parse_compression

ALL_SPECS = ["none", "bf16", "fp8", "int8", "int4", "e3m0", "topk:0.1", "sign_prune:0.5"]
LOSSY_SPECS = ALL_SPECS[1:]


def _rand(shape, seed=0, scale=1e-3):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _roundtrip_jit(x, c, shape, dtype):
    payload = C.encode(x, c)
    return C.decode(payload, c, shape, dtype), payload


_encode = jax.jit(C.encode, static_argnums=1)
_decode = jax.jit(C.decode, static_argnums=(1, 2, 3))
_feedback = jax.jit(C.compress_with_feedback, static_argnums=2)


def _roundtrip(x, spec, dtype=jnp.float32):
    """(decoded as NumPy, payload); jitted so each (shape, spec) compiles once."""
    c = parse_compression(spec)
    y, payload = _roundtrip_jit(jnp.asarray(x), c, tuple(np.shape(x)), dtype)
    return np.asarray(y), payload


def _blocks_np(x, bs):
    """Flattened, zero-padded (blocks, bs) view and the per-element block absmax (flat, n)."""
    flat = np.ravel(x).astype(np.float32)
    n = flat.size
    nb = -(-n // bs)
    xb = np.zeros(nb * bs, np.float32)
    xb[:n] = flat
    xb = xb.reshape(nb, bs)
    absmax = np.abs(xb).max(axis=1)
    return xb, np.repeat(absmax, bs)[:n]


# ----------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "spec,expected",
    [
        (None, Compression("none")),
        ("none", Compression("none")),
        ("int8", Compression("int8")),
        ("topk:0.01", Compression("topk", keep_fraction=0.01)),
        ("sign_prune,keep_fraction=0.5,ef=1", Compression("sign_prune", 0.5, True)),
        ("int4,block_size=64,error_feedback=true", Compression("int4", None, True, 64)),
        (Compression("e3m0", block_size=16), Compression("e3m0", block_size=16)),
    ],
)
def test_parse_valid(spec, expected):
    assert parse_compression(spec) == expected


@pytest.mark.parametrize(
    "spec",
    [
        "gzip",
        "",
        "topk",
        "sign_prune",
        "topk:0",
        "topk:1.5",
        "topk:-0.1",
        "sign_prune:abc",
        "int8:0.5",
        "bf16,keep_fraction=0.3",
        "int4,block_size=0",
        "int4,block_size=-3",
        "int8,error_feedback=maybe",
        "int8,colour=red",
        "int8,block_size",
    ],
)
def test_invalid_specs_raise(spec):
    with pytest.raises(ValueError, match="compression"):
        parse_compression(spec)


def test_invalid_dataclass_raises():
    with pytest.raises(ValueError, match="compression"):
        Compression("int3")
    with pytest.raises(ValueError, match="compression"):
        Compression("topk", keep_fraction=None)
    with pytest.raises(ValueError, match="compression"):
        Compression("int8", block_size=0)
    with pytest.raises(ValueError, match="compression"):
        parse_compression(3)


# ----------------------------------------------------------------------------- round trips


def test_none_is_exact():
    x = _rand((3, 5, 7))
    y, _ = _roundtrip(x, "none")
    np.testing.assert_array_equal(y, x)
    xb = jnp.asarray(x, jnp.bfloat16)
    c = parse_compression("none")
    yb = C.decode(C.encode(xb, c), c, xb.shape, jnp.bfloat16)
    assert yb.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(yb), np.asarray(xb))


def test_bf16_round_to_nearest_even():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(2049) * 10.0 ** rng.uniform(-8, 3, 2049)).astype(np.float32)
    y, payload = _roundtrip(x, "bf16")
    # NumPy RNE of the f32 bit pattern to its top 16 bits.
    bits = x.view(np.uint32).astype(np.uint64)
    expected = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(np.asarray(payload["codes"]), expected)
    assert np.all(np.abs(y - x) <= 2.0**-8 * np.abs(x))


def test_fp8_relative_error():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-6, -2, 4096)).astype(np.float32)
    y, _ = _roundtrip(x, "fp8")
    _, absmax = _blocks_np(x, 32)
    scale = absmax / 448.0
    normal = np.abs(x) >= scale * 2.0**-6  # scaled value in e4m3's normal range
    assert normal.mean() > 0.5
    err = np.abs(y - x)
    assert np.all(err[normal] <= (2.0**-4 + 1e-6) * np.abs(x[normal]))
    # Subnormal e4m3 spacing is 2^-9 (in scaled units): error <= half of it.
    assert np.all(err[~normal] <= (2.0**-10 + 1e-6) * scale[~normal])
    # The block maxima map to 448, an e4m3 value: exact up to f32 rounding of (m / 448) * 448.
    at_max = np.abs(x) == absmax
    np.testing.assert_allclose(np.abs(y)[at_max], absmax[at_max], rtol=3e-7)


@pytest.mark.parametrize("spec,qmax", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("block_size", [32, 5])
def test_int_quantizers(spec, qmax, block_size):
    x = _rand(1003, seed=3)
    x[10:50] = 0.0  # at least one all-zero block
    c = parse_compression(f"{spec},block_size={block_size}")
    y, _ = _roundtrip(x, c)
    _, absmax = _blocks_np(x, block_size)
    scale = absmax / qmax
    assert np.all(np.abs(y - x) <= scale / 2 * (1 + 1e-5) + 1e-12)
    # Independent NumPy quantizer.
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(x / safe), -qmax, qmax)
    np.testing.assert_allclose(y, q * scale, rtol=1e-6, atol=0)
    assert not np.isnan(y).any()


def _e3m0_reference(x, bs):
    """Nearest point of {0, ±s·2^(e-7), e = 1..7} by brute-force argmin, per block scale s."""
    _, s = _blocks_np(x, bs)
    grid = np.array([0.0] + [2.0 ** (e - 7) for e in range(1, 8)])
    mags = s[:, None] * grid[None, :]
    pick = np.argmin(np.abs(np.abs(x)[:, None] - mags), axis=1)
    return np.sign(x) * mags[np.arange(x.size), pick], s


@pytest.mark.parametrize("block_size", [32, 7])
def test_e3m0_nearest_grid_point(block_size):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(999) * 10.0 ** rng.uniform(-5, -2, 999)).astype(np.float32)
    y, _ = _roundtrip(x, f"e3m0,block_size={block_size}")
    ref, s = _e3m0_reference(x, block_size)
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=0)
    # Grid spacing bound: relative 1/3 above s/64, absolute s/128 below.
    bound = np.maximum(np.abs(x) / 3.0, s / 128.0) * (1 + 1e-6)
    assert np.all(np.abs(y - x) <= bound)


def test_4bit_wire_format_by_hand():
    c = parse_compression("e3m0,block_size=8")
    x = jnp.array([1.0, -0.5, 0.3, 0.01, 0.0, -0.004, 0.02, -0.9])
    p = _encode(x, c)
    # Nibbles (sign<<3 | e): 1->7, -0.5->8|6, 0.3->5 (0.25), 0.01->1 (1/64), 0->0,
    # -0.004 -> 0 (below 1/128, sign dropped), 0.02 -> 1 (< 0.75/32), -0.9 -> 8|7.
    nib = [7, 14, 5, 1, 0, 0, 1, 15]
    expected = [nib[i] | (nib[i + 1] << 4) for i in range(0, 8, 2)]
    np.testing.assert_array_equal(np.asarray(p["codes"]), expected)
    np.testing.assert_array_equal(np.asarray(p["scales"]), [1.0])
    np.testing.assert_array_equal(
        np.asarray(_decode(p, c, (8,), jnp.float32)), [1, -0.5, 0.25, 1 / 64, 0, 0, 1 / 64, -1]
    )

    c4 = parse_compression("int4,block_size=4")
    p4 = _encode(jnp.array([7.0, -7.0, 1.0, -1.0]), c4)
    np.testing.assert_array_equal(np.asarray(p4["codes"]), [0x97, 0xF1])  # two's complement


# ----------------------------------------------------------------------------- sparsity


@pytest.mark.parametrize("frac", [0.01, 0.1, 0.3, 1.0])
def test_topk_keeps_k_largest(frac):
    rng = np.random.default_rng(5)
    x = rng.permutation(np.arange(1, 106, dtype=np.float32)) * rng.choice([-1, 1], 105)
    x = (x * 1e-4).astype(np.float32).reshape(3, 5, 7)
    k = math.ceil(round(frac * 105, 9))
    y, payload = _roundtrip(x, f"topk:{frac}")
    assert payload["indices"].shape == (k,) and payload["indices"].dtype == jnp.int32
    keep = np.argsort(-np.abs(x.ravel()))[:k]
    expected = np.zeros(105, np.float32)
    expected[keep] = x.ravel()[keep]
    np.testing.assert_array_equal(y.ravel(), expected)


@pytest.mark.parametrize("frac", [0.25, 0.5, 0.75, 1.0])
def test_sign_prune_fraction(frac):
    x = _rand(1000, seed=6) + np.float32(1e-9)  # no exact zeros
    y, payload = _roundtrip(x, f"sign_prune:{frac}")
    k = math.ceil(frac * 1000)
    kept = y != 0
    assert kept.sum() == k  # pruned exactly 1000 - k
    np.testing.assert_array_equal(y[kept], x[kept])
    if k < 1000:
        assert np.abs(x[kept]).min() >= np.abs(x[~kept]).max()
    np.testing.assert_array_equal(np.asarray(payload["values"]), x[kept])  # position order
    assert payload["mask"].dtype == jnp.uint8 and payload["mask"].shape == (125,)


def test_keep_fraction_float_noise():
    assert C.num_kept(10, 0.3) == 3  # 0.3 * 10 = 3.0000000000000004
    assert C.num_kept(10, 0.31) == 4
    assert C.num_kept(1000, 1e-9) == 1
    assert C.num_kept(7, 1.0) == 7


# ----------------------------------------------------------------------------- shapes / dtypes


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("shape", [(), (1,), (33,), (3, 5, 7)])
def test_shapes_dtypes_and_zeros(spec, shape):
    c = parse_compression(spec)
    x = _rand(shape, seed=7) if shape else np.float32(0.25)
    y, payload = _roundtrip(x, c)
    assert y.shape == shape and y.dtype == np.float32
    assert np.all(np.isfinite(y))
    if shape == (33,):  # restoring another dtype
        yb, _ = _roundtrip(x, c, jnp.bfloat16)
        assert yb.shape == shape and yb.dtype == jnp.bfloat16
    yz, _ = _roundtrip(np.zeros(shape, np.float32), c)
    np.testing.assert_array_equal(yz, np.zeros(shape, np.float32))
    # Payload shapes are static: the same under jit and eval_shape.
    abstract = jax.eval_shape(lambda a: C.encode(a, c), jnp.asarray(x))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), payload) == jax.tree.map(
        lambda a: (a.shape, a.dtype), abstract
    )


@pytest.mark.parametrize("spec", LOSSY_SPECS)
def test_payload_dtypes_are_wire_safe(spec):
    c = parse_compression(spec)
    payload = _encode(jnp.asarray(_rand(100)), c)
    for name, arr in payload.items():
        assert arr.dtype not in (jnp.bfloat16, jnp.float8_e4m3fn, jnp.float16), name
        if name in ("scales", "values"):
            assert arr.dtype == jnp.float32, name
        else:
            assert jnp.issubdtype(arr.dtype, jnp.integer), (name, arr.dtype)


# ----------------------------------------------------------------------------- bytes


# Hand counts for a 4096-element float32 leaf, block_size 32 -> 128 float32 scales = 512 bytes.
BYTES_4096 = {
    "none": 4096 * 4,
    "bf16": 4096 * 2,
    "fp8": 4096 + 512,
    "int8": 4096 + 512,
    "int4": 4096 // 2 + 512,
    "e3m0": 4096 // 2 + 512,
    "topk:0.01": 41 * (4 + 4),  # k = ceil(40.96)
    "topk:0.1": 410 * 8,  # k = ceil(409.6)
    "sign_prune:0.5": 4096 // 8 + 2048 * 4,  # bitmask + kept values
    "sign_prune:0.25": 512 + 1024 * 4,
}
MIN_RATIO = {"bf16": 1.5, "fp8": 3, "int8": 3, "int4": 6, "e3m0": 6}


@pytest.mark.parametrize("spec", list(BYTES_4096))
def test_payload_bytes_4096(spec):
    nbytes = C.payload_bytes((4096,), jnp.float32, spec)
    assert nbytes == BYTES_4096[spec]
    assert 16384 / nbytes >= MIN_RATIO.get(spec, 1.0)
    payload = _encode(jnp.asarray(_rand(4096)), parse_compression(spec))
    assert sum(a.nbytes for a in payload.values()) == nbytes


@pytest.mark.parametrize(
    "shape,spec,expected",
    [
        ((1000,), "int8", 1024 + 32 * 4),  # padded to 32 blocks
        ((1000,), "int4", 512 + 32 * 4),
        ((33,), "e3m0", 32 + 2 * 4),  # 2 blocks, 64 nibbles
        ((5,), "int4,block_size=5", 3 + 4),  # odd nibble count padded to a byte
        ((5,), "int4,block_size=3", 3 + 2 * 4),  # 6 padded nibbles
        ((), "fp8", 32 + 4),
        ((), "bf16", 2),
        ((3, 5, 7), "topk:0.1", 11 * 8),
        ((3, 5, 7), "sign_prune:0.5", 14 + 53 * 4),
        ((64, 64), "none", 16384),
    ],
)
def test_payload_bytes_odd_sizes(shape, spec, expected):
    assert C.payload_bytes(shape, jnp.float32, spec) == expected


def test_tree_payload_bytes():
    tree = {"a": jnp.zeros((4096,)), "b": jax.ShapeDtypeStruct((33,), jnp.float32)}
    assert C.tree_payload_bytes(tree, "int4") == 2560 + 32 + 8


# ----------------------------------------------------------------------------- error feedback


def test_feedback_residual_definition():
    x, r = _rand(300, seed=8), _rand(300, seed=9, scale=1e-4)
    c = Compression("int4", error_feedback=True)
    payload, new_r = _feedback(jnp.asarray(x), jnp.asarray(r), c)
    d = np.asarray(_decode(payload, c, x.shape, jnp.float32))
    np.testing.assert_allclose(np.asarray(new_r), (x + r) - d, rtol=0, atol=1e-9)
    # Without feedback the residual is unused and comes back as zeros.
    c0 = Compression("int4")
    payload0, r0 = _feedback(jnp.asarray(x), jnp.asarray(r), c0)
    np.testing.assert_array_equal(np.asarray(r0), np.zeros(300))
    d0 = np.asarray(_decode(payload0, c0, x.shape, jnp.float32))
    ref = _roundtrip(x, "int4")[0]
    np.testing.assert_array_equal(d0, ref)


@pytest.mark.parametrize("spec", ["int4", "e3m0", "topk:0.3", "sign_prune:0.5"])
def test_feedback_tracks_sum_better(spec):
    x1, x2 = _rand(512, seed=10), _rand(512, seed=11)
    c_fb = parse_compression(spec + ",error_feedback=true")
    c_no = parse_compression(spec)

    p1, r1 = _feedback(jnp.asarray(x1), None, c_fb)
    p2, r2 = _feedback(jnp.asarray(x2), r1, c_fb)
    sent_fb = np.asarray(_decode(p1, c_fb, (512,), jnp.float32)) + np.asarray(
        _decode(p2, c_fb, (512,), jnp.float32)
    )
    sent_no = _roundtrip(x1, c_no)[0] + _roundtrip(x2, c_no)[0]

    # Telescoping: what was sent plus what is still owed equals what was produced.
    np.testing.assert_allclose(sent_fb + np.asarray(r2), x1 + x2, rtol=0, atol=1e-8)
    err_fb = np.linalg.norm(sent_fb - (x1 + x2))
    err_no = np.linalg.norm(sent_no - (x1 + x2))
    assert err_fb < err_no


# ----------------------------------------------------------------------------- collective

W = 4


def _worker_tree(seed):
    rng = np.random.default_rng(seed)
    return {
        "w": (rng.standard_normal((W, 3, 37)) * 1e-3).astype(np.float32),
        "s": (rng.standard_normal((W,)) * 1e-3).astype(np.float32),  # scalar per worker
    }


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_compressed_mean_vmap(spec):
    c = parse_compression(spec)
    tree = _worker_tree(12)
    mean, new_res = jax.jit(jax.vmap(lambda t: C.compressed_mean(t, c, "w"), axis_name="w"))(tree)
    assert new_res is None
    for name, xs in tree.items():
        decoded = np.stack([_roundtrip(xs[w], c)[0] for w in range(W)])
        expected = decoded.mean(axis=0)
        got = np.asarray(mean[name])
        assert got.shape == xs.shape and got.dtype == np.float32
        tol = 1e-6 * np.abs(decoded).max()  # f32 summation order; means can cancel
        for w in range(W):  # every worker ends with the same mean
            np.testing.assert_allclose(got[w], expected, rtol=0, atol=tol)
        if c.kind == "none":
            np.testing.assert_allclose(got[0], xs.mean(axis=0), rtol=1e-6, atol=0)


def test_compressed_mean_none_is_pmean():
    tree = _worker_tree(13)
    ours, _ = jax.jit(jax.vmap(lambda t: C.compressed_mean(t, "none", "w"), axis_name="w"))(tree)
    ref = jax.jit(jax.vmap(lambda t: lax.pmean(t, "w"), axis_name="w"))(tree)
    for name in tree:
        np.testing.assert_array_equal(np.asarray(ours[name]), np.asarray(ref[name]))


def test_compressed_mean_error_feedback():
    c = parse_compression("int4,ef=1")
    tree = _worker_tree(14)
    res0 = jax.tree.map(lambda x: np.full_like(x, 1e-5), tree)
    f = jax.jit(jax.vmap(lambda t, r: C.compressed_mean(t, c, "w", r), axis_name="w"))
    mean, new_res = f(tree, res0)
    for name, xs in tree.items():
        value = xs + res0[name]
        decoded = np.stack([_roundtrip(value[w], c)[0] for w in range(W)])
        np.testing.assert_allclose(np.asarray(new_res[name]), value - decoded, atol=1e-9)
        tol = 1e-6 * np.abs(decoded).max()  # f32 summation order; means can cancel
        np.testing.assert_allclose(np.asarray(mean[name])[0], decoded.mean(axis=0), atol=tol)
    # Residual given but feedback off: zeros come back.
    off = jax.vmap(lambda t, r: C.compressed_mean(t, "int4", "w", r), axis_name="w")
    _, r_off = jax.jit(off)(tree, res0)
    for leaf in jax.tree.leaves(r_off):
        np.testing.assert_array_equal(np.asarray(leaf), 0.0)


def test_compressed_mean_shard_map():
    mesh = Mesh(np.array(jax.devices()[:W]), ("w",))
    x = _rand((W, 70), seed=15)
    c = parse_compression("int8")

    def body(xs):
        m, _ = C.compressed_mean(xs[0], c, "w")
        return m[None]

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("w"), out_specs=P("w")))(x)
    expected = np.stack([_roundtrip(x[w], c)[0] for w in range(W)]).mean(axis=0)
    for w in range(W):
        np.testing.assert_allclose(np.asarray(out)[w], expected, atol=1e-6 * np.abs(x).max())

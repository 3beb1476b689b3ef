"""SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706) as the "sparseloco" codec, against NumPy
references written here: the block split of a leaf, the chunked top-k by magnitude, the 2-bit
statistical quantizer, error feedback with decay over a 4-round train_diloco run, the
per-contributor mean, the degenerate cases, bad input, and the wire bytes read from the
compiled round."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diloco_jax as dj
from diloco_jax import comm, hlo
from diloco_jax import compression as C

M, H, B = 4, 3, 4
IN, OUT = 128, 96  # w: blocks of 64 x 48 (k = 96 of 3072), b: blocks of 48 (k = 2)
INNER_LR = 0.1
INNER = optax.sgd(INNER_LR)


# ----------------------------------------------------------------------------- references


def np_block(n: int) -> int:
    """The largest divisor of n that is <= 64, by brute force."""
    return max(d for d in range(1, min(n, 64) + 1) if n % d == 0)


def np_geometry(shape):
    """(rows, cols, h, w) of a 1-D or 2-D leaf: a vector is one row."""
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape
    h = 1 if len(shape) == 1 else np_block(rows)
    return rows, cols, h, np_block(cols)


def np_k(block_len: int, top_k: int) -> int:
    return min(block_len, max(1, round(block_len * top_k / 4096)))


def np_chunks(x):
    """[blocks, h*w]: block (i, j) of the matrix view at row i * (cols // w) + j."""
    rows, cols, h, w = np_geometry(x.shape)
    xm = np.asarray(x).reshape(rows, cols)
    return np.stack(
        [
            xm[i * h : (i + 1) * h, j * w : (j + 1) * w].ravel()
            for i in range(rows // h)
            for j in range(cols // w)
        ]
    )


def np_unchunk(chunks, shape):
    rows, cols, h, w = np_geometry(shape)
    out = np.zeros((rows, cols), chunks.dtype)
    per_row = cols // w
    for r, chunk in enumerate(chunks):
        i, j = divmod(r, per_row)
        out[i * h : (i + 1) * h, j * w : (j + 1) * w] = chunk.reshape(h, w)
    return out.reshape(shape)


def np_quantize(values):
    """The authors' rule: shift = mean, sigma unbiased, scale = 6 sigma / 4, codes =
    clip(round(c / scale + 2), 0, 3) (half to even), each bin decoded to its mean."""
    values = np.asarray(values, np.float64)
    n = values.size
    shift = values.mean()
    c = values - shift
    sigma = np.sqrt(np.sum(c * c) / (n - 1)) if n > 1 else 0.0
    scale = 6.0 * sigma / 4 or 1.0
    codes = np.clip(np.round(c / scale + 2), 0, 3).astype(np.int64)
    levels = np.array([c[codes == q].mean() if np.any(codes == q) else 0.0 for q in range(4)])
    return codes, levels + shift


def np_codec(x, top_k, quant):
    """(decoded leaf, sent mask) of one worker's value x (1-D or 2-D), float64."""
    chunks = np_chunks(np.asarray(x, np.float64))
    k = np_k(chunks.shape[1], top_k)
    idx = np.argsort(-np.abs(chunks), axis=1, kind="stable")[:, :k]
    kept = np.take_along_axis(chunks, idx, axis=1)
    if quant:
        codes, levels = np_quantize(kept.ravel())
        kept = levels[codes].reshape(kept.shape)
    dense, mask = np.zeros_like(chunks), np.zeros_like(chunks)
    np.put_along_axis(dense, idx, kept, axis=1)
    np.put_along_axis(mask, idx, 1.0, axis=1)
    return np_unchunk(dense, x.shape), np_unchunk(mask, x.shape)


def np_grads(w, b, x, y):
    """Gradients of 0.5 * mean((x @ w + b - y)^2) over the batch and the outputs."""
    err = x @ w + b - y
    return x.T @ err / err.size, err.sum(0) / err.size


def np_sparseloco(params, rounds, *, top_k, beta, quant, per_contributor, alpha):
    """DiLoCo with inner SGD and SparseLoCo's exchange, float64: per worker e <- beta e + Δ_m,
    send the decoded TopK / Q of e, e <- e - sent; θ <- θ - alpha * mean. Returns (params,
    residuals [M, ...])."""
    theta = {k: np.asarray(v, np.float64) for k, v in params.items()}
    err = {k: np.zeros((M, *v.shape)) for k, v in theta.items()}
    for batch in rounds:
        x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
        summed = {k: np.zeros_like(v) for k, v in theta.items()}
        count = {k: np.zeros_like(v) for k, v in theta.items()}
        for m in range(M):
            w, b = theta["w"].copy(), theta["b"].copy()
            for h in range(H):
                gw, gb = np_grads(w, b, x[m, h], y[m, h])
                w, b = w - INNER_LR * gw, b - INNER_LR * gb
            for name, local in (("w", w), ("b", b)):
                value = theta[name] - local + beta * err[name][m]
                sent, mask = np_codec(value, top_k, quant)
                err[name][m] = value - sent
                summed[name] += sent
                count[name] += mask
        for name in theta:
            if per_contributor:
                mean = np.where(count[name] > 0, summed[name] / np.maximum(count[name], 1), 0)
            else:
                mean = summed[name] / M
            theta[name] = theta[name] - alpha * mean
    return theta, err


# ----------------------------------------------------------------------------- helpers


def loss_fn(params, batch):
    err = batch["x"] @ params["w"] + params["b"] - batch["y"]
    return 0.5 * jnp.mean(err**2)


def _params():
    return {"w": jnp.zeros((IN, OUT), jnp.float32), "b": jnp.zeros((OUT,), jnp.float32)}


def _rounds(num_rounds, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(M, H, B, IN)).astype(np.float32),
            "y": rng.normal(size=(M, H, B, OUT)).astype(np.float32),
        }
        for _ in range(num_rounds)
    ]


def _train(spec, rounds, alpha=1.0, backend="vmap"):
    return dj.train_diloco(
        loss_fn, _params(), rounds, num_rounds=len(rounds), num_workers=M, inner_steps=H,
        inner_optimizer=INNER, outer_optimizer=optax.sgd(alpha), compression=spec,
        backend=backend,
    )  # fmt: skip


def np_offsets(packed, blocks, k, block_len):
    """The payload's offsets as ints [blocks, k]: one byte each for blocks up to 256, else
    12 bits each, the pair (a, b) in bytes a & 0xff, a >> 8 | (b & 0xf) << 4, b >> 4."""
    raw = np.asarray(packed).astype(np.int64)
    if block_len <= 256:
        return raw.reshape(blocks, k)
    b0, b1, b2 = raw.reshape(-1, 3).T
    pairs = np.stack([b0 | (b1 & 0xF) << 8, b1 >> 4 | b2 << 4], axis=1)
    return pairs.reshape(-1)[: blocks * k].reshape(blocks, k)


@functools.partial(jax.jit, static_argnums=1)
def _roundtrip(x, c):
    payload = C.encode(x, c)
    return C.decode(payload, c, x.shape, jnp.float32), payload


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ----------------------------------------------------------------------------- the codec


@pytest.mark.parametrize(
    "shape,block",
    [((128, 96), (64, 48)), ((100, 30), (50, 30)), ((7,), (7,)), ((200,), (50,))],
)
def test_block_shapes(shape, block):
    assert C.sparseloco_block_shape(shape) == block
    rows, cols, h, w = np_geometry(shape)
    assert block == ((w,) if len(shape) == 1 else (h, w))
    # Beyond the examples: a prime > 64 gets blocks of 1 along it, higher ranks are
    # (prod(leading), last) matrices, a scalar is one block of one.
    assert C.sparseloco_block_shape((67,)) == (1,)
    assert C.sparseloco_block_shape((3, 4, 70)) == (np_block(12), np_block(70))
    assert C.sparseloco_block_shape(()) == (1,)


@pytest.mark.parametrize("shape", [(128, 96), (100, 30), (7,), (200,)])
@pytest.mark.parametrize("top_k", [128, 300])
def test_chunked_topk_by_magnitude(shape, top_k):
    x = _rand(shape, seed=sum(shape))
    c = C.Compression("sparseloco", top_k=top_k, quant=False)
    got, payload = _roundtrip(jnp.asarray(x), c)
    want, mask = np_codec(x, top_k, quant=False)
    np.testing.assert_array_equal(np.asarray(got), want.astype(np.float32))  # values: copies
    _, _, h, w = np_geometry(shape)
    blocks, k = x.size // (h * w), np_k(h * w, top_k)
    assert int(mask.sum()) == blocks * k
    offsets = np.asarray(payload["offsets"])
    assert offsets.dtype == np.uint8
    if h * w <= 256:  # one byte per offset
        assert offsets.shape == (blocks, k)
    else:  # 12 bits per offset, two in three bytes
        assert offsets.shape == (3 * -(-blocks * k // 2),)
    kept = np.argwhere(np_chunks(np.asarray(got, np.float64)) != 0)  # (block, position) sorted
    got_offsets = np.sort(np_offsets(offsets, blocks, k, h * w), axis=1)
    np.testing.assert_array_equal(got_offsets, kept[:, 1].reshape(blocks, k))
    assert C.payload_bytes(shape, jnp.float32, c) == offsets.size + blocks * k * 4


def test_an_odd_number_of_12_bit_offsets_pads_the_last_pair():
    x = _rand((64, 64), seed=11)  # one block of 4096 keeping 127: 64 pairs, 192 bytes
    c = C.Compression("sparseloco", top_k=127, quant=False)
    got, payload = _roundtrip(jnp.asarray(x), c)
    np.testing.assert_array_equal(np.asarray(got), np_codec(x, 127, quant=False)[0])
    assert payload["offsets"].shape == (192,) and int(payload["offsets"][-1]) == 0
    idx = np.argsort(-np.abs(x.ravel()), kind="stable")[:127]
    np.testing.assert_array_equal(np_offsets(payload["offsets"], 1, 127, 4096)[0], idx)


def test_k_per_block_rounds_half_to_even():
    # 48 * 128 / 4096 = 1.5 -> 2; 16 * 128 / 4096 = 0.5 -> 0 -> at least 1; 80 * 128 / 4096
    # = 2.5 -> 2 (Python's round, as the authors' code).
    assert [C.sparseloco_k(n, 128) for n in (48, 16, 80, 4096, 3072)] == [2, 1, 2, 128, 96]
    assert C.sparseloco_k(50, 4096) == 50 and C.sparseloco_k(7, 1) == 1


@pytest.mark.parametrize("shape", [(128, 96), (100, 30), (200,)])
def test_statistical_quantizer(shape):
    x = _rand(shape, seed=3) * 1e-3
    c = C.Compression("sparseloco")  # top_k 128, 2-bit values
    got, payload = _roundtrip(jnp.asarray(x), c)
    chunks = np_chunks(x.astype(np.float64))
    k = np_k(chunks.shape[1], 128)
    idx = np.argsort(-np.abs(chunks), axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(np_offsets(payload["offsets"], *idx.shape, chunks.shape[1]), idx)
    codes, levels = np_quantize(np.take_along_axis(chunks, idx, axis=1).ravel())
    # Wire format: four 2-bit codes per byte, element 4i in the lowest bits.
    packed = np.asarray(payload["codes"])
    assert packed.dtype == np.uint8 and packed.size == -(-codes.size // 4)
    unpacked = ((packed[:, None] >> np.array([0, 2, 4, 6])) & 3).ravel()[: codes.size]
    np.testing.assert_array_equal(unpacked, codes)
    # Kept values are large of either sign, so they fill the bins either side of the middle
    # (the rule is asymmetric: positives above +0.75 sigma share bin 3; see the module).
    assert {1, 3} <= set(codes.tolist())
    np.testing.assert_allclose(np.asarray(payload["levels"]), levels, rtol=1e-5, atol=1e-12)
    want, _ = np_codec(x, 128, quant=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-12)
    blocks = chunks.shape[0]
    # Offsets: a byte each up to 256-element blocks, else 12 bits (a pair in three bytes).
    offset_bytes = blocks * k if chunks.shape[1] <= 256 else 3 * -(-blocks * k // 2)
    assert C.payload_bytes(shape, jnp.float32, c) == (offset_bytes + -(-blocks * k // 4) + 4 * 4)


def test_quantizer_by_hand():
    # mean 0, sigma = sqrt(20 / 4) = sqrt(5), scale = 1.5 sqrt(5) ~ 3.354: c / scale + 2 =
    # -4/3.354 + 2 = 0.81 -> 1, -1 -> 1.70 -> 2, 0 -> 2, 1 -> 2.30 -> 2, 4 -> 3.19 -> 3.
    quantize = jax.jit(C.statistical_quantize)
    codes, levels = quantize(jnp.asarray([-4.0, -1.0, 0.0, 1.0, 4.0]))
    np.testing.assert_array_equal(np.asarray(codes), [1, 2, 2, 2, 3])
    np.testing.assert_allclose(np.asarray(levels), [0.0, -4.0, 0.0, 4.0], atol=1e-7)
    # An outlier below -2.25 sigma: sum 0, sigma = sqrt(110 / 10), -10 / (1.5 sigma) + 2 =
    # -0.01 -> bin 0; 1 / (1.5 sigma) + 2 = 2.2 -> bin 2.
    codes, levels = quantize(jnp.asarray([-10.0] + [1.0] * 10))
    np.testing.assert_array_equal(np.asarray(codes), [0] + [2] * 10)
    np.testing.assert_allclose(np.asarray(levels), [-10.0, 0.0, 1.0, 0.0], atol=1e-6)
    # A constant leaf: sigma 0 -> scale 1, everything in bin 2, decoded exactly.
    codes, levels = quantize(jnp.full((6,), 0.25))
    assert np.all(np.asarray(codes) == 2) and float(levels[2]) == 0.25


@pytest.mark.parametrize("shape", [(), (1,), (33,), (3, 5, 7)])
def test_shapes_dtypes_and_zeros(shape):
    c = C.parse_compression("sparseloco")
    x = jnp.asarray(_rand(shape, seed=7))
    y = jax.jit(lambda a: C.decode(C.encode(a, c), c, shape, jnp.bfloat16))(x)
    assert y.shape == shape and y.dtype == jnp.bfloat16
    zeros = jnp.zeros(shape, jnp.float32)
    np.testing.assert_array_equal(np.asarray(_roundtrip(zeros, c)[0]), np.zeros(shape))
    payload = jax.eval_shape(lambda a: C.encode(a, c), x)
    for name, arr in payload.items():  # integers on the wire, float32 only for the levels
        assert arr.dtype == (jnp.float32 if name == "levels" else jnp.uint8), name


# ----------------------------------------------------------------------------- feedback


_feedback = jax.jit(C.compress_with_feedback, static_argnums=2)


def test_feedback_decays_the_residual_and_beta_1_is_the_old_rule():
    x, r = _rand((100, 30), 1), _rand((100, 30), 2)
    c = C.Compression("sparseloco", beta=0.5, quant=False)
    payload, residual = _feedback(x, r, c)
    value = x + np.float32(0.5) * r  # float32, as the codec computes it
    sent, mask = np_codec(value, 128, quant=False)
    np.testing.assert_array_equal(np.asarray(C.decode(payload, c, x.shape)), sent)
    np.testing.assert_array_equal(residual, np.where(mask > 0, 0, value))
    quantized = C.Compression("sparseloco", beta=0.5)
    payload, residual = _feedback(x, r, quantized)
    np.testing.assert_array_equal(np.asarray(payload["offsets"]), np.asarray(_roundtrip(
        jnp.asarray(value), quantized)[1]["offsets"]))  # fmt: skip
    np.testing.assert_allclose(residual, value - np_codec(value, 128, True)[0], atol=1e-6)
    # Every other kind feeds back with decay 1: value = x + residual, as before.
    for spec in ("int4,ef=1", "topk:0.1,ef=1"):
        other = C.parse_compression(spec)
        payload, residual = _feedback(x[:5], r[:5], other)
        expected = _feedback(x[:5] + r[:5], None, other)
        jax.tree.map(np.testing.assert_array_equal, (payload, residual), expected)
    for kind in C.KINDS:
        c = C.parse_compression(f"{kind}:0.5" if kind in C.FRACTION_KINDS else kind)
        assert c.feedback_decay == (0.95 if kind == "sparseloco" else 1.0)  # SparseLoCo's beta


@pytest.mark.parametrize(
    "spec,alpha",
    [("sparseloco", 1.0), ("sparseloco:top_k=300,beta=0.5,quant=0,per_contributor=1", 0.7)],
)
def test_error_feedback_with_decay_over_four_rounds(spec, alpha):
    c = C.parse_compression(spec)
    rounds = _rounds(4)
    result = _train(spec, rounds, alpha)
    want, residual = np_sparseloco(
        _params(), rounds, top_k=c.top_k, beta=c.beta, quant=c.quant,
        per_contributor=c.per_contributor, alpha=alpha,
    )  # fmt: skip
    # The check has teeth: another decay gives params far outside the tolerance.
    other, _ = np_sparseloco(
        _params(), rounds, top_k=c.top_k, beta=0.0 if c.beta else 0.95, quant=c.quant,
        per_contributor=c.per_contributor, alpha=alpha,
    )  # fmt: skip
    for name in ("w", "b"):
        tol = 1e-5 * np.abs(want[name]).max()
        np.testing.assert_allclose(result.params[name], want[name], rtol=0, atol=tol)
        assert np.abs(other[name] - want[name]).max() > 100 * tol
        res_tol = 1e-5 * np.abs(residual[name]).max()
        np.testing.assert_allclose(
            result.state.parts["compression"].residual[name], residual[name], atol=res_tol
        )
    density = np.mean(np.asarray(result.state.parts["compression"].residual["w"]) != 0)
    assert density > 0.9  # a residual almost everywhere: only a few % is sent each round


# ----------------------------------------------------------------------------- aggregation


@pytest.mark.parametrize("spec", ["sparseloco,top_k=500", "topk:0.2"])
def test_per_contributor_mean(spec):
    c = C.parse_compression(spec + ",per_contributor=1")
    shape = (100, 30)
    xs = np.stack([_rand(shape, seed=10 + m) for m in range(3)])
    gathered = jax.jit(jax.vmap(lambda x: C.encode(x, c)))(xs)
    decoded = np.asarray(jax.jit(jax.vmap(lambda p: C.decode(p, c, shape)))(gathered))
    sent = np.asarray(jax.jit(jax.vmap(lambda p: C.sent_mask(p, c, shape)))(gathered))
    # The masks are the selections: |x| at a sent coordinate beats the unsent ones.
    if c.kind == "topk":
        np.testing.assert_array_equal(sent, decoded != 0)
    else:
        np.testing.assert_array_equal(sent[0], np_codec(xs[0], 500, quant=True)[1])
    count = sent.sum(0)
    assert count.max() >= 2 and (count == 1).any() and (count == 0).any()
    like = jax.ShapeDtypeStruct(shape, jnp.float32)
    mean = jax.jit(
        lambda g, w=None, per=None: C.decode_mean(g, c, like, w, per_contributor=per),
        static_argnums=2,
    )
    want = np.where(count > 0, decoded.sum(0) / np.maximum(count, 1), 0.0)
    np.testing.assert_allclose(mean(gathered), want, rtol=1e-6, atol=1e-7)
    all_m = mean(gathered, None, False)
    np.testing.assert_allclose(all_m, decoded.mean(0), rtol=1e-6, atol=1e-7)
    # Weighted (fault options): weights count per coordinate too; weight 0 is left out even
    # when its payload decodes to NaN.
    weights = jnp.asarray([2.0, 0.0, 1.0])
    poisoned = jax.tree.map(lambda a: a, gathered)
    key = "values" if c.kind == "topk" else "levels"
    poisoned[key] = poisoned[key].at[1].set(jnp.nan)
    got_w = mean(poisoned, weights)
    w = np.array([2.0, 0.0, 1.0])[:, None, None]
    num, den = (w * decoded)[[0, 2]].sum(0), (w * sent)[[0, 2]].sum(0)
    np.testing.assert_allclose(got_w, np.where(den > 0, num / np.maximum(den, 1), 0), rtol=1e-6)


def test_full_density_without_quantization_is_diloco_with_sgd():
    """Every value kept and sent in float32: nothing is dropped, whatever beta, and the mean
    (over all M or per contributor: everyone sent everything) is the exact one, bit for bit
    on CPU, so the run is DiLoCo with optax.sgd(alpha)."""
    rounds = _rounds(3, seed=1)
    exact = _train(None, rounds, alpha=0.8)
    for spec in (
        "sparseloco,top_k=4096,quant=0,beta=0",
        "sparseloco,top_k=4096,quant=0,per_contributor=1",  # beta 0.95
    ):
        sparse = _train(spec, rounds, alpha=0.8)
        for name in ("w", "b"):
            np.testing.assert_array_equal(sparse.params[name], exact.params[name])
            residual = sparse.state.parts["compression"].residual
            np.testing.assert_array_equal(residual[name], 0.0)  # nothing dropped
        assert [h["loss"] for h in sparse.history] == [h["loss"] for h in exact.history]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "spec,name",
    [
        ("sparseloco,top_k=0", "top_k"),
        ("sparseloco:4097", "top_k"),
        ("sparseloco,top_k=1.5", "top_k"),
        ("sparseloco,beta=1", "beta"),
        ("sparseloco,beta=-0.1", "beta"),
        ("sparseloco:beta=abc", "beta"),
        ("sparseloco,quant=maybe", "quant"),
        ("sparseloco,ef=0", "error_feedback"),
        ("sparseloco,keep_fraction=0.1", "keep_fraction"),
        ("sparseloco,exchange=two_stage", "two_stage"),
        ("int8,top_k=64", "top_k"),
        ("topk:0.1,beta=0.9", "beta"),
        ("int4,quant=1", "quant"),
        ("int8,per_contributor=1", "per_contributor"),
    ],
)
def test_bad_input_names_the_argument(spec, name):
    with pytest.raises(ValueError, match=f"compression:.*{name}"):
        C.parse_compression(spec)


def test_dataclass_validation_and_spellings():
    for kwargs, name in [
        (dict(top_k=0), "top_k"),
        (dict(top_k=4097), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(beta=1.0), "beta"),
        (dict(beta=-0.5), "beta"),
        (dict(quant="yes"), "quant"),
        (dict(per_contributor=2), "per_contributor"),
    ]:
        with pytest.raises(ValueError, match=name):
            C.Compression("sparseloco", **kwargs)
    default = C.Compression("sparseloco", top_k=128, beta=0.95, quant=True, error_feedback=True)
    assert C.parse_compression("sparseloco") == C.Compression("sparseloco") == default
    assert C.parse_compression("sparseloco:top_k=64,beta=0.9") == C.parse_compression(
        "sparseloco:64,error_decay=0.9"
    ) == C.Compression("sparseloco", top_k=64, beta=0.9)  # fmt: skip
    assert C.parse_compression("sparseloco,topk=4096,quantize=off,per_contributor=yes") == (
        C.Compression("sparseloco", top_k=4096, quant=False, per_contributor=True)
    )
    # Other kinds keep the repr their checkpoints were fingerprinted with.
    assert repr(C.parse_compression("int4,ef=1")) == (
        "Compression(kind='int4', keep_fraction=None, error_feedback=True, block_size=32)"
    )
    assert "quant=False" in repr(C.parse_compression("sparseloco,quant=0"))
    assert C.parse_compression("sparseloco").resolved_exchange == "gather"


# ----------------------------------------------------------------------------- wire bytes


def _compiled_wire_bytes(num_workers, spec, exclude=False):
    state = dj.init_state(
        _params(),
        num_workers,
        inner_optimizer=INNER,
        outer_optimizer=optax.sgd(1.0),
        compression=spec,
    )
    batch = {"x": jnp.ones((num_workers, 2, 2, IN)), "y": jnp.ones((num_workers, 2, 2, OUT))}
    round_fn = functools.partial(
        dj.diloco_round, loss_fn, inner_optimizer=INNER, outer_optimizer=optax.sgd(1.0),
        backend=dj.make_backend("shard_map", num_workers), compression=spec,
        exclude_nonfinite=exclude,
    )  # fmt: skip
    return hlo.wire_bytes(jax.jit(round_fn).lower(state, batch).compile())


@pytest.mark.parametrize(
    "num_workers,spec,exclude",
    [(2, "sparseloco", False), (8, "sparseloco", False), (8, "sparseloco,quant=0", True)],
)
def test_wire_bytes_read_from_the_compiled_round(num_workers, spec, exclude):
    c = C.parse_compression(spec)
    # By hand: w has 4 blocks of 64 x 48 keeping 96 each, 12-bit offsets (384 of them in 576
    # bytes); b has 2 blocks of 48 keeping 2 each, uint8 offsets. 2-bit codes four per byte
    # plus 4 float32 levels per leaf, or float32 values.
    if c.quant:
        payload = (576 + 4 * 96 // 4 + 16) + (2 * 2 * 1 + 1 + 16)
    else:
        payload = 576 + 4 * 96 * 4 + 2 * 2 * (1 + 4)
    assert dj.comm.round_bytes(_params(), spec) == payload
    ring = num_workers - 1
    want = ring * payload + 2 * ring / num_workers * 4 + (ring * 4 if exclude else 0)
    formula = comm.round_wire_bytes(_params(), spec, num_workers, weighted=exclude)
    assert formula == pytest.approx(want, rel=1e-12)
    assert _compiled_wire_bytes(num_workers, spec, exclude) == pytest.approx(want, rel=1e-12)
    if c.quant:  # against the exact all-reduce of float32 deltas: 2 (M-1)/M x 4 |θ|
        assert payload * 50 < (IN * OUT + OUT) * 4

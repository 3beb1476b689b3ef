"""Tests for diloco_jax.lm.model: shapes, parameter counts, causality, loss, training, dtypes."""

import dataclasses
import functools
import math
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_jax.lm import model

MICRO = model.PRESETS["micro"]
# Learned positions, and 2 heads x 8 = 16 != d_model 32: exercises the other code paths.
ALT = dataclasses.replace(MICRO, positions="learned", head_dim=8)
# Eager op-by-op dispatch is slow on CPU; jit every forward pass in these tests, and keep
# input shapes few so compilations are shared between tests.
_apply = jax.jit(model.apply, static_argnums=0)
_micro_loss = jax.jit(model.make_loss_fn(MICRO))


@functools.cache
def _params(config, seed=0):
    return model.init_params(config, jax.random.key(seed))


def _random_batch(config, key, batch_size=4, seq_len=None):
    seq_len = config.seq_len if seq_len is None else seq_len
    tokens = jax.random.randint(key, (batch_size, seq_len + 1), 0, config.vocab_size, jnp.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _hand_count(c: model.ModelConfig) -> int:
    """Parameter count from the architecture, written out independently of the code."""
    d, h, f, v = c.d_model, c.num_heads, c.d_ff, c.vocab_size
    k = c.head_dim if c.head_dim is not None else d // h
    attention = 3 * d * h * k + h * k * d  # q, k, v, out kernels (no biases)
    mlp = d * f + f * d  # up, down kernels
    norms = 2 * d  # two RMSNorm scales per block
    total = c.num_layers * (attention + mlp + norms)
    total += d  # final norm
    total += v * d  # token embedding, tied with the output projection
    if c.positions == "learned":
        total += c.seq_len * d
    return total


def _abstract_params(config):
    return jax.eval_shape(functools.partial(model.init_params, config), jax.random.key(0))


@pytest.mark.parametrize("config", [MICRO, ALT], ids=["micro", "alt"])
def test_logits_shape_and_dtype(config):
    params = _params(config)
    for seq_len in (config.seq_len, 5):
        inputs = jnp.zeros((2, seq_len), jnp.int32)
        logits = _apply(config, params, inputs)
        assert logits.shape == (2, seq_len, config.vocab_size)
        assert logits.dtype == jnp.float32
        assert bool(jnp.all(jnp.isfinite(logits)))


def test_params_are_plain_nested_dicts():
    params = _params(MICRO)
    assert type(params) is dict
    for leaf in jax.tree.leaves(params):
        assert isinstance(leaf, jax.Array)
    # Usable directly with optax.
    opt_state = optax.adam(1e-3).init(params)
    assert jax.tree.structure(opt_state[0].mu) == jax.tree.structure(params)


@pytest.mark.parametrize("name", sorted(model.PRESETS))
def test_param_count_matches_hand_formula(name):
    config = model.PRESETS[name]
    abstract = _abstract_params(config)
    assert model.count_params(abstract) == _hand_count(config)


def test_learned_positions_and_head_dim_param_count():
    params = _params(ALT)
    assert params["blocks"][0]["attn"]["query"]["kernel"].shape == (32, 16)
    assert params["position_embed"]["embedding"].shape == (ALT.seq_len, ALT.d_model)
    assert model.count_params(params) == _hand_count(ALT)


@pytest.mark.parametrize(
    "name,paper_millions",
    [("60m", 60), ("150m", 150), ("400m", 400)],
)
def test_paper_shapes_with_32k_vocab_match_their_names(name, paper_millions):
    config = model.get_config(name, vocab_size=32_000)
    count = model.count_params(_abstract_params(config))
    # Hand arithmetic, e.g. 60m: 3 * (4*896*1024 + 8*896^2 + 2*896) + 896 + 32000*896.
    assert count == _hand_count(config)
    assert abs(count / 1e6 - paper_millions) / paper_millions < 0.03


def test_count_params_simple():
    params = {"a": jnp.zeros((2, 3)), "b": {"c": jnp.zeros((4,))}}
    assert model.count_params(params) == 10


def test_flops_per_token_formula():
    c = MICRO
    n = c.num_layers * (4 * c.d_model * c.d_model + 2 * c.d_model * c.d_ff) + 256 * c.d_model
    expected = 6 * n + 12 * c.num_layers * c.d_model * c.seq_len
    assert model.flops_per_token(c) == expected
    assert model.flops_per_token(c, seq_len=8) < expected


@pytest.mark.parametrize("config", [MICRO, ALT], ids=["micro", "alt"])
def test_causality(config):
    params = _params(config)
    inputs = jax.random.randint(jax.random.key(2), (2, config.seq_len), 0, 256, jnp.int32)
    t = 10
    changed = inputs.at[:, t + 1].set((inputs[:, t + 1] + 1) % 256)
    before, after = _apply(config, params, inputs), _apply(config, params, changed)
    np.testing.assert_allclose(before[:, : t + 1], after[:, : t + 1], atol=1e-6)
    assert float(jnp.max(jnp.abs(before[:, t + 1 :] - after[:, t + 1 :]))) > 1e-6


def test_loss_at_init_is_about_log_vocab():
    params = _params(MICRO)
    batch = _random_batch(MICRO, jax.random.key(3), batch_size=8)
    loss = _micro_loss(params, batch)
    assert loss.shape == () and loss.dtype == jnp.float32
    assert abs(float(loss) - math.log(256)) < 0.1


def _half_right_batch(config, params, key, batch_size=4):
    """Random inputs whose targets are the model's own argmax prediction (NumPy, from
    `apply`'s logits) at the even positions and another token at the odd ones: accuracy 1/2."""
    inputs = jax.random.randint(key, (batch_size, config.seq_len), 0, config.vocab_size)
    logits = np.asarray(_apply(config, params, inputs))
    predicted = np.argmax(logits, axis=-1)
    odd = np.arange(config.seq_len) % 2 == 1
    targets = np.where(odd, (predicted + 1) % config.vocab_size, predicted).astype(np.int32)
    return {"inputs": inputs, "targets": jnp.asarray(targets)}, logits


def test_loss_with_accuracy_matches_numpy_argmax_and_keeps_the_loss_bit_for_bit():
    params = _params(MICRO)
    batch, logits = _half_right_batch(MICRO, params, jax.random.key(11))
    half = jax.tree.map(lambda x: 0.5 * x, params)  # other params: not the batch's own model
    with_aux = jax.jit(model.make_loss_fn(MICRO, has_aux=True))
    for p, want_logits in ((params, logits), (half, None)):
        if want_logits is None:
            want_logits = np.asarray(_apply(MICRO, p, batch["inputs"]))
        want = np.mean(np.argmax(want_logits, axis=-1) == np.asarray(batch["targets"]))
        loss, aux = with_aux(p, batch)
        assert set(aux) == {"accuracy"} and aux["accuracy"].dtype == jnp.float32
        assert aux["accuracy"].shape == () and float(aux["accuracy"]) == np.float32(want)
        assert loss.dtype == jnp.float32 and np.asarray(loss) == np.asarray(_micro_loss(p, batch))
    assert float(with_aux(params, batch)[1]["accuracy"]) == 0.5  # as the batch was built
    # The gradients are the loss's alone: the same bits as without the accuracy.
    plain = jax.jit(jax.value_and_grad(model.make_loss_fn(MICRO)))(half, batch)
    aux_grad = jax.jit(jax.value_and_grad(model.make_loss_fn(MICRO, has_aux=True), has_aux=True))
    (loss, _), grads = aux_grad(half, batch)
    assert np.asarray(loss) == np.asarray(plain[0])
    jax.tree.map(np.testing.assert_array_equal, grads, plain[1])
    with pytest.raises(ValueError, match="has_aux must be True or False"):
        model.make_loss_fn(MICRO, has_aux=1)


def test_sgd_steps_reduce_loss_on_fixed_batch():
    loss_fn = model.make_loss_fn(MICRO)
    params = _params(MICRO)
    batch = _random_batch(MICRO, jax.random.key(4), batch_size=4)
    opt = optax.sgd(1.0)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = opt.init(params)
    losses = []
    for _ in range(5):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05, losses


def test_vmap_and_scan_over_stacked_params():
    loss_fn = model.make_loss_fn(MICRO)
    # Two "workers" with different params: the init and a scaled copy.
    stacked = jax.tree.map(lambda x: jnp.stack([x, 0.5 * x]), _params(MICRO))
    batch = _random_batch(MICRO, jax.random.key(6), batch_size=8)

    def body(params, _):
        loss, grads = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(0, None))(params, batch)
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss

    _, losses = jax.jit(lambda p: jax.lax.scan(body, p, None, length=2))(stacked)
    assert losses.shape == (2, 2)
    # Worker 0 of the vmapped scan equals a plain call on its own params.
    single = jax.tree.map(lambda x: x[0], stacked)
    np.testing.assert_allclose(losses[0, 0], _micro_loss(single, batch), rtol=1e-5)


def test_init_model_returns_pure_apply_fn():
    apply_fn, params = model.init_model(MICRO, jax.random.key(0))
    inputs = jnp.ones((2, 5), jnp.int32)
    np.testing.assert_allclose(
        jax.jit(apply_fn)(params, inputs), _apply(MICRO, params, inputs), atol=1e-6
    )


def test_bf16_params_give_float32_loss():
    # param_dtype = dtype = bfloat16: parameters themselves in bf16 (the old behaviour).
    config = dataclasses.replace(MICRO, dtype="bfloat16", param_dtype="bfloat16")
    params = model.init_params(config, jax.random.key(0))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    batch = _random_batch(config, jax.random.key(7), batch_size=2)
    loss, grads = jax.jit(jax.value_and_grad(model.make_loss_fn(config)))(params, batch)
    assert loss.dtype == jnp.float32 and bool(jnp.isfinite(loss))
    assert abs(float(loss) - math.log(256)) < 0.2
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
    logits = jax.eval_shape(functools.partial(model.apply, config), params, batch["inputs"])
    assert logits.dtype == jnp.float32


# ---------------------------------------------------------------------------------------
# Attention: jax.nn.dot_product_attention against the einsum attention the model had before.


def _einsum_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, *, is_causal, implementation):
    """Reference: scores and softmax in float32, written out with einsums and a causal mask."""
    assert is_causal and implementation in ("xla", "cudnn")
    seq_len, head_dim = q_BxLxHxK.shape[1], q_BxLxHxK.shape[-1]
    s_BxHxLxL = jnp.einsum(
        "bqhk,bshk->bhqs", q_BxLxHxK, k_BxLxHxK, preferred_element_type=jnp.float32
    ) / np.sqrt(head_dim)
    causal_LxL = np.tril(np.ones((seq_len, seq_len), bool))
    s_BxHxLxL = jnp.where(causal_LxL, s_BxHxLxL, -np.inf)
    p_BxHxLxL = jax.nn.softmax(s_BxHxLxL, axis=-1).astype(v_BxLxHxK.dtype)
    return jnp.einsum("bhqs,bshk->bqhk", p_BxHxLxL, v_BxLxHxK)


def _logits_and_grads(config, params, batch):
    """One fresh jit (so a monkeypatched attention is traced anew): logits and loss grads."""
    loss_fn = model.make_loss_fn(config)
    both = lambda p: (model.apply(config, p, batch["inputs"]), jax.grad(loss_fn)(p, batch))
    return jax.jit(both)(params)


def _assert_close_trees(got, want, rtol):
    """Every leaf within rtol of that leaf's largest entry."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=0, atol=rtol * np.abs(w).max())


# Stated tolerances (float32 CPU: measured differences are 0 for logits and <= 5e-7 of a
# leaf's largest gradient entry; XLA orders the same float32 sums differently).
ATTENTION_LOGITS_ATOL = 1e-5
ATTENTION_GRADS_RTOL = 1e-5


def test_xla_attention_matches_einsum_reference(monkeypatch):
    config = dataclasses.replace(MICRO, attention="xla")
    params = _params(config)
    batch = _random_batch(config, jax.random.key(11), batch_size=3)
    logits, grads = _logits_and_grads(config, params, batch)
    monkeypatch.setattr(jax.nn, "dot_product_attention", _einsum_attention)
    want_logits, want_grads = _logits_and_grads(config, params, batch)
    np.testing.assert_allclose(logits, want_logits, rtol=0, atol=ATTENTION_LOGITS_ATOL)
    _assert_close_trees(grads, want_grads, ATTENTION_GRADS_RTOL)


def test_xla_attention_matches_reference_on_random_bf16_inputs():
    q, k, v = jax.random.normal(jax.random.key(12), (3, 2, 9, 4, 16), jnp.bfloat16)
    xla = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla")
    got = jax.jit(xla)(q, k, v)
    want = jax.jit(functools.partial(_einsum_attention, is_causal=True, implementation="xla"))(
        q, k, v
    )
    np.testing.assert_allclose(np.float32(got), np.float32(want), atol=1e-2)


def _fake_device(platform, capability=None, kind="fake"):
    device = types.SimpleNamespace(platform=platform, device_kind=kind)
    if capability is not None:
        device.compute_capability = capability
    return device


H100 = _fake_device("gpu", "9.0", "NVIDIA H100 80GB HBM3")
A100 = _fake_device("gpu", "8.0", "NVIDIA A100-SXM4-80GB")
CPU = _fake_device("cpu", kind="cpu")
TPU = _fake_device("tpu", kind="TPU v4")


@pytest.mark.parametrize(
    "overrides, device, expected",
    [
        ({"dtype": "bfloat16"}, H100, "cudnn"),
        ({"dtype": "float16"}, A100, "cudnn"),
        ({"dtype": "float32"}, H100, "xla"),  # cuDNN flash attention is bf16 / fp16 only
        ({"dtype": "bfloat16", "head_dim": 12}, H100, "xla"),  # not a multiple of 8
        ({"dtype": "bfloat16", "head_dim": 192}, H100, "cudnn"),  # <= 256 on Hopper
        ({"dtype": "bfloat16", "head_dim": 192}, A100, "xla"),  # > 128 before Hopper
        ({"dtype": "bfloat16"}, CPU, "xla"),
        ({"dtype": "bfloat16"}, TPU, "xla"),
        ({"dtype": "bfloat16"}, _fake_device("gpu", "gfx90a"), "xla"),  # ROCm
        ({"dtype": "bfloat16", "attention": "xla"}, H100, "xla"),
        ({"dtype": "bfloat16", "attention": "cudnn"}, H100, "cudnn"),
    ],
)
def test_attention_implementation_resolution(overrides, device, expected):
    config = dataclasses.replace(MICRO, **overrides)
    assert model.attention_implementation(config, device) == expected


def test_cudnn_attention_where_it_cannot_run_is_a_value_error_naming_attention():
    config = dataclasses.replace(MICRO, dtype="bfloat16", attention="cudnn")
    with pytest.raises(ValueError, match="attention='cudnn' needs an NVIDIA GPU"):
        model.attention_implementation(config, CPU)
    with pytest.raises(ValueError, match="attention='cudnn' needs a head dim"):
        model.attention_implementation(dataclasses.replace(config, head_dim=192), A100)
    with pytest.raises(ValueError, match="attention='cudnn' needs dtype bfloat16"):
        dataclasses.replace(MICRO, attention="cudnn")  # float32: refused when built


GPU = [d for d in jax.devices() if d.platform == "gpu"]


@pytest.mark.skipif(not GPU, reason="cuDNN flash attention needs an NVIDIA GPU")
def test_cudnn_attention_matches_xla_on_gpu():
    # bf16 compute; head dim 64 like the paper's shapes, and a sequence cuDNN tiles well.
    base = model.ModelConfig(
        seq_len=128, d_model=128, num_layers=2, num_heads=2, d_ff=256, dtype="bfloat16"
    )
    params = _params(base)
    batch = _random_batch(base, jax.random.key(13), batch_size=4)
    got_logits, got_grads = _logits_and_grads(
        dataclasses.replace(base, attention="cudnn"), params, batch
    )
    want_logits, want_grads = _logits_and_grads(
        dataclasses.replace(base, attention="xla"), params, batch
    )
    # bf16 probabilities and outputs, summed in different orders: a few bf16 ulps.
    np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=5e-2)
    _assert_close_trees(got_grads, want_grads, 5e-2)


# ---------------------------------------------------------------------------------------
# Embedding: one-hot matmul and gather against NumPy indexing.


@pytest.mark.parametrize("embedding", ["gather", "onehot"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embedding_lookup_equals_numpy_indexing(embedding, dtype):
    config = dataclasses.replace(MICRO, embedding=embedding, dtype=dtype)
    table = np.random.default_rng(0).normal(size=(256, 32)).astype(np.float32)
    ids = np.random.default_rng(1).integers(0, 256, size=(3, 7))
    got = jax.jit(functools.partial(model._embed, config))(jnp.asarray(table), jnp.asarray(ids))
    assert got.dtype == jnp.dtype(dtype)
    # Exact: a lookup rounds each row to the compute dtype once, whichever way it is done.
    np.testing.assert_array_equal(np.float32(got), np.float32(jnp.asarray(table[ids], dtype)))


def test_onehot_and_gather_embeddings_give_the_same_logits_and_grads():
    batch = _random_batch(MICRO, jax.random.key(14), batch_size=3)
    params = _params(MICRO)
    onehot = _logits_and_grads(dataclasses.replace(MICRO, embedding="onehot"), params, batch)
    gather = _logits_and_grads(dataclasses.replace(MICRO, embedding="gather"), params, batch)
    np.testing.assert_array_equal(onehot[0], gather[0])  # the forward lookup is exact
    # The embedding's gradient: a matmul vs a scatter-add, the same float32 sums reordered.
    _assert_close_trees(onehot[1], gather[1], 1e-5)


@pytest.mark.parametrize(
    "embedding, vocab, device, expected",
    [
        ("auto", 256, H100, "onehot"),
        ("auto", 256, TPU, "onehot"),
        ("auto", 32_000, H100, "gather"),
        ("auto", 256, CPU, "gather"),  # measured slower on CPU (benchmarks/README.md)
        ("onehot", 32_000, CPU, "onehot"),
        ("gather", 256, H100, "gather"),
    ],
)
def test_embedding_implementation_resolution(embedding, vocab, device, expected):
    config = dataclasses.replace(MICRO, embedding=embedding, vocab_size=vocab)
    assert model.embedding_implementation(config, device) == expected


# ---------------------------------------------------------------------------------------
# Mixed precision: float32 master weights, bf16 matmuls.

# An instruction's name and result type, in unoptimized ("x = f32[...]") and optimized
# ("%x = f32[...]") HLO text; tuple-typed results (GEMM custom calls) have no entry.
_HLO_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[", re.MULTILINE)


def _operand_dtypes(hlo_text, opcode):
    """[(lhs dtype, rhs dtype, rest of line)] of every `opcode` instruction in HLO text."""
    dtypes = dict(_HLO_DEF.findall(hlo_text))
    call = re.compile(
        rf"^\s*(?:ROOT )?%?[\w.\-]+ = .*? {opcode}\(%?([\w.\-]+), %?([\w.\-]+)[,)](.*)$",
        re.MULTILINE,
    )
    return [(dtypes.get(lhs), dtypes.get(rhs), rest) for lhs, rhs, rest in call.findall(hlo_text)]


def _dot_operand_types(hlo_text):
    """[(lhs dtype, rhs dtype, dot algorithm or None)] of every dot in an HLO module's text."""
    dots = []
    for lhs, rhs, rest in _operand_dtypes(hlo_text, "dot"):
        algorithm = re.search(r"algorithm=(\w+)", rest)
        dots.append((lhs, rhs, algorithm and algorithm.group(1)))
    return dots


def _adamw_train_step(config):
    """A jitted value_and_grad + AdamW step of `config`'s model, and abstract arguments."""
    opt = optax.adamw(1e-3)
    loss_fn = model.make_loss_fn(config)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    params = _abstract_params(config)
    tokens = jax.ShapeDtypeStruct((4, config.seq_len), jnp.int32)
    args = (params, jax.eval_shape(opt.init, params), {"inputs": tokens, "targets": tokens})
    return jax.jit(step), args


def test_mixed_precision_keeps_float32_state_and_runs_bf16_matmuls():
    config = dataclasses.replace(MICRO, dtype="bfloat16", embedding="onehot")
    step, args = _adamw_train_step(config)
    new_params, opt_state, loss, grads = jax.eval_shape(step, *args)
    for tree in (args[0], new_params, grads):
        assert {x.dtype for x in jax.tree.leaves(tree)} == {jnp.dtype(jnp.float32)}
    floats = [x for x in jax.tree.leaves(opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.float32 for x in floats)
    assert loss.dtype == jnp.float32
    # The program handed to XLA: every matmul, forward and backward, takes bf16 operands, or
    # is a dot whose algorithm rounds them to bf16 (the float32-result ones: attention
    # scores, logits, and their gradients). The CPU backend's optimized HLO can't show this:
    # having no bf16 GEMM with bf16 output, it widens such dots to f32 (a GPU's keeps them;
    # see the GPU test below).
    dots = _dot_operand_types(step.lower(*args).as_text(dialect="hlo"))
    assert len(dots) >= 4 * MICRO.num_layers * 3  # q, k, v, out forward and two gradients
    for lhs, rhs, algorithm in dots:
        assert (lhs, rhs) == ("bf16", "bf16") or algorithm == "dot_bf16_bf16_f32", dots
    # float32 compute: no bf16 anywhere.
    f32_step, f32_args = _adamw_train_step(MICRO)
    f32_dots = _dot_operand_types(f32_step.lower(*f32_args).as_text(dialect="hlo"))
    assert {(lhs, rhs) for lhs, rhs, _ in f32_dots} == {("f32", "f32")}


@pytest.mark.skipif(not GPU, reason="reads a GPU's optimized HLO")
def test_mixed_precision_gemms_are_bf16_in_the_optimized_gpu_program():
    config = dataclasses.replace(MICRO, dtype="bfloat16")
    step, args = _adamw_train_step(config)
    text = step.lower(*args).compile().as_text()
    # XLA:GPU turns dots into cuBLAS GEMM custom calls (or Triton GEMM fusions, or dots left
    # as they are); read the types of their first two operands. Most must be bf16: only the
    # float32-result dots' backward (logits, attention scores) may feed a float32 cotangent.
    gemms = [
        (lhs, rhs)
        for opcode in ("custom-call", "fusion", "dot")
        for lhs, rhs, rest in _operand_dtypes(text, opcode)
        if opcode == "dot" or "gemm" in rest
    ]
    assert len(gemms) >= 3 * MICRO.num_layers, text
    bf16 = sum((lhs, rhs) == ("bf16", "bf16") for lhs, rhs in gemms)
    assert bf16 >= 0.75 * len(gemms), gemms


def test_flops_per_token_matches_xla_cost_analysis():
    # The compiled train step's FLOP count from XLA (its matmuls, attention computed over the
    # full L x L, plus the elementwise work the estimate leaves out: softmax, norms, GELU,
    # AdamW) within 15% of the 6N + attention estimate (1.03x when measured); tiny is large
    # enough for the matmuls to dominate. (The one-hot embedding, default on accelerators,
    # adds 4VD per token that are not model FLOPs: 1.08x for tiny.)
    config = model.get_config("tiny", embedding="gather")
    step, args = _adamw_train_step(config)
    cost = step.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    estimate = 4 * config.seq_len * model.flops_per_token(config)  # batch 4
    assert abs(cost["flops"] / estimate - 1) <= 0.15, cost["flops"] / estimate


@pytest.mark.parametrize(
    "overrides",
    [
        {"d_model": 30, "num_heads": 4},  # not divisible
        {"num_layers": 0},
        {"vocab_size": -1},
        {"d_ff": 0},
        {"head_dim": 7},  # odd head dim with rotary
        {"positions": "alibi"},
        {"dtype": "int8"},
        {"param_dtype": "float64"},
        {"attention": "flash"},
        {"embedding": "hash"},
        {"attention": "cudnn", "dtype": "bfloat16", "head_dim": 12},
        {"remat": 1},
        {"shard_activations": "yes"},
    ],
)
def test_bad_config_raises(overrides):
    with pytest.raises(ValueError):
        dataclasses.replace(MICRO, **overrides)


def test_bad_inputs_and_names_raise():
    params = _params(MICRO)
    with pytest.raises(ValueError, match="length"):
        model.apply(MICRO, params, jnp.zeros((1, MICRO.seq_len + 1), jnp.int32))
    with pytest.raises(ValueError, match="inputs_BxL"):
        model.apply(MICRO, params, jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="params"):
        model.apply(MICRO, {"token_embed": params["token_embed"]}, jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="preset"):
        model.get_config("10b")


def test_remat_and_shard_activations_keep_the_loss_and_gradients_bit_for_bit():
    """Without a mesh, `shard_activations` constrains nothing, and `remat` recomputes the
    very ops it dropped: the loss and every gradient are the plain model's bits."""
    params = model.init_params(MICRO, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, MICRO.vocab_size, jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def loss_and_grads(config):
        return jax.jit(jax.value_and_grad(model.make_loss_fn(config)))(params, batch)

    want = loss_and_grads(MICRO)
    for options in ({"remat": True}, {"shard_activations": True}):
        got = loss_and_grads(dataclasses.replace(MICRO, **options))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)

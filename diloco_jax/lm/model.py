"""Decoder-only transformer language model (Flax NNX), used through a functional API.

The network is written as NNX modules, but everything outside this file sees only
pure functions of a plain nested dict of arrays:

  params = init_params(config, key)          # {"token_embed": {"embedding": ...}, ...}
  logits_BxLxV = apply(config, params, x_BxL)  # jit / vmap / grad / scan friendly
  loss = make_loss_fn(config)(params, batch)
  loss, {"accuracy": acc} = make_loss_fn(config, has_aux=True)(params, batch)

`apply` rebuilds the module from a cached abstract GraphDef (from `nnx.eval_shape`) and
the given arrays with `nnx.merge`, so it holds no hidden state and can be traced inside
vmapped / shard_mapped `lax.scan` loops.

Architecture: token embedding (+ learned positions, or rotary on q/k), `num_layers`
pre-norm blocks `x + Attn(RMSNorm(x))`, `x + MLP(RMSNorm(x))` with causal multi-head
self-attention and a GELU MLP, a final RMSNorm, and an output projection TIED to the token
embedding (logits = h @ E^T). Tying matches the DiLoCo paper's parameter counts (see
`PRESETS`). No biases, no dropout.

Precision follows the Flax convention: parameters (and so gradients and optimizer state) are
stored in `param_dtype` (default float32) and cast to `dtype` for the computation, so
`dtype="bfloat16"` runs every matmul in bfloat16 against float32 master weights. Attention
scores and softmax, the logits and the loss are float32 whatever `dtype` is.

Attention goes through `jax.nn.dot_product_attention` (`attention="auto"`: cuDNN flash
attention on an NVIDIA GPU when dtype and head dim allow it, XLA otherwise). The token
embedding is a one-hot matmul for small vocabularies on accelerators (`embedding="auto"`), so
its gradient is a matmul rather than a scatter-add of every token's gradient into a few rows.

Sharding: every matrix parameter carries logical axis names ("vocab", "embed", "heads",
"mlp"; `logical_axes`), and `param_specs(config, params, {"fsdp": 2, "tensor": 2})` maps them
onto the axes of a mesh that partitions each DiLoCo worker (the trainers' `param_sharding=`).

Shape suffixes: B batch, L sequence, D d_model, H heads, K head dim, F d_ff, V vocab.
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec

Params = dict[str, Any]

_DTYPES = ("float32", "bfloat16", "float16")
_LOW_PRECISION = ("bfloat16", "float16")
# Dots with float32 results from low-precision operands: inputs rounded to the compute dtype,
# float32 accumulation (what jax.nn.dot_product_attention's XLA path uses for its scores).
_LOW_PRECISION_DOT = {
    "bfloat16": jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
    "float16": jax.lax.DotAlgorithmPreset.F16_F16_F32,
}
_POSITIONS = ("rotary", "learned")
ATTENTIONS = ("auto", "xla", "cudnn")
EMBEDDINGS = ("auto", "gather", "onehot")
# embedding="auto" picks the one-hot matmul on accelerators up to this vocabulary size. It
# costs 4 * V * D FLOPs per token (forward and the embedding's gradient) on top of the 6 * V * D
# of the tied output projection, and saves a scatter-add of every token's gradient into V
# rows, which serializes on a GPU when V is small. See benchmarks/README.md for figures.
ONEHOT_MAX_VOCAB = 1024
# GPT-2 style init: small normal weights keep logits near zero at init (loss ~ log V).
_INIT_STD = 0.02
_ROPE_BASE = 10_000.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static model hyperparameters (hashable, so it can key caches and jit statics).

    Attributes:
      vocab_size: number of token ids, >= 2 (256 for byte-level data).
      seq_len: maximum context length, >= 1; inputs may be shorter.
      d_model: residual width, >= 1.
      num_layers: number of transformer blocks, >= 1.
      num_heads: attention heads, >= 1.
      d_ff: MLP hidden width, >= 1.
      head_dim: per-head query/key/value size. None means d_model // num_heads (then
        d_model must divide evenly). The paper's 60m/150m shapes use 16 heads x 64 with
        d_model 896, so num_heads * head_dim need not equal d_model.
      positions: "rotary" (RoPE on q/k, no position params) or "learned" (absolute table).
      dtype: compute dtype name ("float32", "bfloat16" or "float16"): activations and matmul
        operands. Attention softmax, logits and loss are always computed in float32.
        float16 runs on GPUs only (its float32-accumulating dots exist only there) and has no
        loss scaling: prefer bfloat16.
      param_dtype: dtype name the parameters are stored in (master weights; gradients and
        optax state follow them). Default float32; set it equal to `dtype` to keep the
        parameters themselves in bfloat16.
      attention: "xla" (`jax.nn.dot_product_attention`'s XLA path), "cudnn" (cuDNN flash
        attention: an NVIDIA GPU, dtype bfloat16/float16, head dim a multiple of 8 and at most
        128, or 256 on Hopper and later) or "auto" (cudnn where it can run, else xla).
      embedding: "gather" (table lookup; its gradient is a scatter-add), "onehot" (a one-hot
        matmul; its gradient is a matmul) or "auto" (onehot on GPU / TPU for vocab_size <=
        ONEHOT_MAX_VOCAB, else gather). Same values either way, up to float rounding.
      remat: recompute each block's activations in the backward pass (`nnx.remat` per
        block) instead of keeping them: only the blocks' inputs are saved. Under fsdp it also
        frees each block's gathered weights between its forward and backward pass.
      shard_activations: constrain the residual stream's batch dim to the mesh axes of
        `ACTIVATION_BATCH_AXES` ("fsdp") at every block boundary, where the mesh in context
        has them as Auto axes (e.g. inside `train_diloco(..., mesh=)`'s round; an Explicit
        axis already says where each array lives): FSDP proper, each of a
        worker's devices runs its share of the batch. Without it XLA's partitioner may split
        the activations' hidden dim instead. A no-op without such a mesh; a ValueError when
        traced on a mesh that partitions a worker over any other axis too (a "tensor" axis:
        XLA's partitioner aborts on the constraint there).
      Neither changes what the model computes, only what a device holds (benchmarks/README.md,
      mesh_memory.py).
    """

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    d_ff: int = 512
    head_dim: int | None = None
    positions: str = "rotary"
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention: str = "auto"
    embedding: str = "auto"
    remat: bool = False
    shard_activations: bool = False

    def __post_init__(self):
        for name in ("remat", "shard_activations"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"ModelConfig.{name} must be True or False, got {getattr(self, name)!r}"
                )
        for name in ("vocab_size", "seq_len", "d_model", "num_layers", "num_heads", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.vocab_size < 2:
            raise ValueError(f"ModelConfig.vocab_size must be >= 2, got {self.vocab_size}")
        if self.head_dim is None:
            if self.d_model % self.num_heads:
                raise ValueError(
                    f"ModelConfig.d_model ({self.d_model}) must be divisible by num_heads "
                    f"({self.num_heads}) when head_dim is None"
                )
        elif not isinstance(self.head_dim, int) or self.head_dim < 1:
            raise ValueError(f"ModelConfig.head_dim must be a positive int, got {self.head_dim!r}")
        if self.positions not in _POSITIONS:
            raise ValueError(
                f"ModelConfig.positions must be one of {_POSITIONS}, got {self.positions!r}"
            )
        if self.positions == "rotary" and self.kv_size % 2:
            raise ValueError(
                f"ModelConfig: rotary positions need an even head dim, got {self.kv_size}"
            )
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(
                    f"ModelConfig.{name} must be one of {_DTYPES}, got {getattr(self, name)!r}"
                )
        if self.attention not in ATTENTIONS:
            raise ValueError(
                f"ModelConfig.attention must be one of {ATTENTIONS}, got {self.attention!r}"
            )
        if self.embedding not in EMBEDDINGS:
            raise ValueError(
                f"ModelConfig.embedding must be one of {EMBEDDINGS}, got {self.embedding!r}"
            )
        if self.attention == "cudnn":
            # The platform-independent half of cuDNN's limits; the device is checked when the
            # model is traced (`attention_implementation`).
            problem = _cudnn_problem(self, compute_capability=(9, 0))
            if problem:
                raise ValueError(f"ModelConfig.attention='cudnn' {problem}")

    @property
    def kv_size(self) -> int:
        """Per-head query/key/value size K."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    @property
    def jnp_dtype(self) -> jnp.dtype:
        """The compute dtype."""
        return jnp.dtype(self.dtype)

    @property
    def param_jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)


def _paper(d_model: int, num_layers: int, num_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=256,
        seq_len=1024,
        d_model=d_model,
        num_layers=num_layers,
        num_heads=num_heads,
        d_ff=4 * d_model,
        head_dim=head_dim,
    )


# Named shapes. "micro" is for unit tests, "mini" for the CLI's quick preset, "tiny" trains
# on a couple of CPU cores, "small" is a quick GPU run. "60m" / "150m" / "400m" are the
# DiLoCo paper's Chinchilla-style shapes (hidden, layers, heads, K/V size): (896, 3, 16, 64),
# (896, 12, 16, 64), (1536, 12, 12, 128) with d_ff = 4 * hidden and context 1024. The paper
# used a 32k vocabulary; here the default is byte-level (256), so counts are lower. With
# `get_config(name, vocab_size=32_000)` and tied embeddings the counts are 59.0M, 149.8M and
# 388.9M, matching the paper's names; this arithmetic is also why "150m" uses hidden 896
# (hidden 1024 would give 184M). "1b" is a model to shard over a mesh (`param_specs`):
# hidden 2048, 20 layers of 16 heads x 128, d_ff 8192, context 2048; 20 x 50.3M matmul
# weights per layer make 1,007.2M parameters with the byte vocabulary and 1,072.3M with a 32k
# one (16 layers, the Llama-style count, would give 806M: this MLP has two matrices, not
# three).
PRESETS: dict[str, ModelConfig] = {
    "micro": ModelConfig(seq_len=32, d_model=32, num_layers=1, num_heads=2, d_ff=128),
    "mini": ModelConfig(seq_len=64, d_model=64, num_layers=2, num_heads=4, d_ff=256),
    "tiny": ModelConfig(seq_len=128, d_model=128, num_layers=2, num_heads=4, d_ff=512),
    "small": ModelConfig(seq_len=256, d_model=256, num_layers=4, num_heads=4, d_ff=1024),
    "60m": _paper(896, 3, 16, 64),
    "150m": _paper(896, 12, 16, 64),
    "400m": _paper(1536, 12, 12, 128),
    "1b": ModelConfig(
        seq_len=2048, d_model=2048, num_layers=20, num_heads=16, d_ff=8192, head_dim=128
    ),
}


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """Returns PRESETS[name] with fields replaced by `overrides` (e.g. vocab_size=32_000)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset name {name!r}; choose from {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def _cuda_capability(device: jax.Device) -> tuple[int, int] | None:
    """(major, minor) compute capability of an NVIDIA GPU; None for any other device."""
    if device.platform != "gpu":
        return None
    try:
        major, minor = (int(part) for part in str(device.compute_capability).split("."))
    except (AttributeError, ValueError):  # ROCm reports e.g. "gfx90a"
        return None
    return major, minor


def _cudnn_problem(c: ModelConfig, compute_capability: tuple[int, int]) -> str | None:
    """Why cuDNN flash attention can't run c's attention on a GPU of this capability, or None.
    The limits are those `jax.nn.dot_product_attention(implementation="cudnn")` checks."""
    if c.dtype not in _LOW_PRECISION:
        return f"needs dtype bfloat16 or float16, got {c.dtype!r}"
    max_head_dim = 256 if compute_capability >= (9, 0) else 128
    if c.kv_size % 8 or c.kv_size > max_head_dim:
        return (
            f"needs a head dim that is a multiple of 8 and at most {max_head_dim} (compute "
            f"capability {compute_capability[0]}.{compute_capability[1]}), got {c.kv_size}"
        )
    return None


def attention_implementation(c: ModelConfig, device: jax.Device | None = None) -> str:
    """The `implementation` passed to `jax.nn.dot_product_attention`: "xla" or "cudnn" (never
    None, which means "xla" today but may change under us). Resolves c.attention for `device`
    (default: `jax.devices()[0]`, where a jitted forward pass runs); raises ValueError naming
    `attention` when "cudnn" was asked for and can't run there."""
    if c.attention == "xla":
        return "xla"
    device = jax.devices()[0] if device is None else device
    capability = _cuda_capability(device)
    if capability is None:
        problem = f"needs an NVIDIA GPU, got {device.platform} ({device.device_kind})"
    else:
        problem = _cudnn_problem(c, capability)
    if problem is None:
        return "cudnn"
    if c.attention == "cudnn":
        raise ValueError(f"ModelConfig.attention='cudnn' {problem}")
    return "xla"


def embedding_implementation(c: ModelConfig, device: jax.Device | None = None) -> str:
    """c.embedding resolved for `device` (default `jax.devices()[0]`): "onehot" or "gather".
    "auto" is onehot on accelerators for vocab_size <= ONEHOT_MAX_VOCAB, and gather on CPUs,
    where the one-hot matmul measured slower (benchmarks/README.md)."""
    if c.embedding != "auto":
        return c.embedding
    device = jax.devices()[0] if device is None else device
    small = c.vocab_size <= ONEHOT_MAX_VOCAB
    return "onehot" if small and device.platform != "cpu" else "gather"


def _embed(c: ModelConfig, table_VxD: jax.Array, inputs_BxL: jax.Array) -> jax.Array:
    """Token vectors in the compute dtype."""
    if embedding_implementation(c) == "onehot":
        onehot_BxLxV = jax.nn.one_hot(inputs_BxL, c.vocab_size, dtype=c.jnp_dtype)
        # A float32 lookup must come out exact, not rounded to TF32 / bf16 passes (the GPU /
        # TPU default precision for float32); bf16 / fp16 operands are exact as they are.
        exact = jax.lax.Precision.HIGHEST if c.dtype == "float32" else None
        return jnp.einsum(
            "blv,vd->bld", onehot_BxLxV, table_VxD.astype(c.jnp_dtype), precision=exact
        )
    # Gather from the table in its own dtype and cast the rows: the gradient's scatter-add
    # then accumulates in param_dtype (float32), not in bfloat16.
    return jnp.take(_whole_on_each_device(table_VxD), inputs_BxL, axis=0).astype(c.jnp_dtype)


def _whole_on_each_device(table_VxD: jax.Array) -> jax.Array:
    """The table gathered whole onto each of a worker's devices before a lookup, when the
    lookup is traced on a mesh whose automatic axes split it (as FSDP gathers each matrix
    before its matmul). Left to XLA, a lookup into a table split over an automatic axis inside
    the workers' shard_map aborts the process in XLA's SPMD partitioner (jaxlib 0.12.0.1:
    "Check failed: partition_group_list.num_replica_groups() ..."); gathered first, it is a
    local lookup. Off a mesh, or on one with explicit axes, the table is returned as is."""
    mesh = jax.sharding.get_abstract_mesh()
    split = [name for name in mesh.auto_axes if mesh.shape[name] > 1] if not mesh.empty else []
    if not split or mesh.explicit_axes:
        return table_VxD
    return jax.lax.with_sharding_constraint(table_VxD, PartitionSpec())


def _rotary(x_BxLxHxK: jax.Array) -> jax.Array:
    """Rotates feature pairs (i, i + K/2) by position-dependent angles (RoPE)."""
    _, seq_len, _, k = x_BxLxHxK.shape
    half = k // 2
    freq_half = _ROPE_BASE ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_LxHalf = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * freq_half[None, :]
    # Broadcast over batch and heads: [1, L, 1, K/2].
    sin = jnp.sin(angle_LxHalf)[None, :, None, :]
    cos = jnp.cos(angle_LxHalf)[None, :, None, :]
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)


def _with_axes(init: Callable, *names: str | None) -> Callable:
    """`init` whose Param carries logical axis names, one per dim (`logical_axes`). Metadata
    only: the values are init's, and nothing is placed on a mesh when it is created."""
    return nnx.with_partitioning(init, names, eager_sharding=False)


def _linear(
    d_in: int,
    d_out: int,
    std: float,
    c: ModelConfig,
    rngs: nnx.Rngs,
    axes: tuple[str | None, str | None],
) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=False,
        kernel_init=_with_axes(nnx.initializers.normal(std), *axes),
        dtype=c.jnp_dtype,
        param_dtype=c.param_jnp_dtype,
        rngs=rngs,
    )


def _rms_norm(c: ModelConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    # Statistics in float32 whatever the dtype (nnx.RMSNorm promotes them).
    return nnx.RMSNorm(
        c.d_model, epsilon=1e-6, dtype=c.jnp_dtype, param_dtype=c.param_jnp_dtype, rngs=rngs
    )


class Attention(nnx.Module):
    """Causal multi-head self-attention."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        self.config = c
        hk = c.num_heads * c.kv_size
        # Residual-output projections are scaled down by depth so the residual stream's
        # variance at init does not grow with num_layers (GPT-2 convention).
        out_std = _INIT_STD / math.sqrt(2 * c.num_layers)
        # Kernels [D, H*K] and [H*K, D]: "heads" is the flattened H*K dim, split by whole heads.
        self.query = _linear(c.d_model, hk, _INIT_STD, c, rngs, ("embed", "heads"))
        self.key = _linear(c.d_model, hk, _INIT_STD, c, rngs, ("embed", "heads"))
        self.value = _linear(c.d_model, hk, _INIT_STD, c, rngs, ("embed", "heads"))
        self.out = _linear(hk, c.d_model, out_std, c, rngs, ("heads", "embed"))

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        c = self.config
        b, seq_len, _ = x_BxLxD.shape
        shape = (b, seq_len, c.num_heads, c.kv_size)
        q_BxLxHxK = self.query(x_BxLxD).reshape(shape)
        k_BxLxHxK = self.key(x_BxLxD).reshape(shape)
        v_BxLxHxK = self.value(x_BxLxD).reshape(shape)
        if c.positions == "rotary":
            q_BxLxHxK = _rotary(q_BxLxHxK)
            k_BxLxHxK = _rotary(k_BxLxHxK)
        # Both implementations take scores and softmax in float32 (bf16 scores lose too much
        # precision in the softmax); cuDNN's flash kernel never materializes [B, H, L, L].
        o_BxLxHxK = jax.nn.dot_product_attention(
            q_BxLxHxK,
            k_BxLxHxK,
            v_BxLxHxK,
            is_causal=True,
            implementation=attention_implementation(c),
        )
        return self.out(o_BxLxHxK.reshape(b, seq_len, c.num_heads * c.kv_size))


class Mlp(nnx.Module):
    """GELU MLP: D -> F -> D."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        self.up = _linear(c.d_model, c.d_ff, _INIT_STD, c, rngs, ("embed", "mlp"))
        down_std = _INIT_STD / math.sqrt(2 * c.num_layers)
        self.down = _linear(c.d_ff, c.d_model, down_std, c, rngs, ("mlp", "embed"))

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x_BxLxD)))


class Block(nnx.Module):
    """Pre-norm transformer block."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = _rms_norm(c, rngs)
        self.attn = Attention(c, rngs)
        self.mlp_norm = _rms_norm(c, rngs)
        self.mlp = Mlp(c, rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD))
        return x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD))


@nnx.remat
def _remat_block(block: Block, x_BxLxD: jax.Array) -> jax.Array:
    return block(x_BxLxD)


# The mesh axes the residual stream's batch dim is split over under
# `ModelConfig.shard_activations`, those of the mesh in context, in order, while they divide B.
ACTIVATION_BATCH_AXES: tuple[str, ...] = ("fsdp",)


def axes_beside_activation_batch(partitioned: Mapping[str, int]) -> list[str]:
    """The axes of `partitioned` (a worker's partitioned mesh axes, name -> size) that
    `shard_activations` can't run beside: those of size > 1 not in ACTIVATION_BATCH_AXES.
    jax 0.10.2's SPMD partitioner aborts the process (a failed check in ExpandDeviceGroups)
    on the batch constraint beside a tensor axis; other axes are untried."""
    return [n for n, size in partitioned.items() if n not in ACTIVATION_BATCH_AXES and size > 1]


def _shard_batch(x_BxLxD: jax.Array) -> jax.Array:
    """x constrained to its batch dim over `ACTIVATION_BATCH_AXES` (the ones the mesh in
    context has at size > 1 and leaves to XLA's partitioner); x itself without any."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    partitioned = {n: s for n, s in sizes.items() if kinds[n] != jax.sharding.AxisType.Manual}
    others = axes_beside_activation_batch(partitioned)
    if others:
        raise ValueError(
            f"ModelConfig.shard_activations needs a mesh whose partitioned axes are "
            f"{ACTIVATION_BATCH_AXES} only; this one also partitions {tuple(others)} (not "
            "supported: XLA's partitioner aborts beside a tensor axis)"
        )
    axes, product = [], 1
    for axis in ACTIVATION_BATCH_AXES:
        size = sizes.get(axis, 1)
        auto = kinds.get(axis) == jax.sharding.AxisType.Auto
        if size > 1 and auto and x_BxLxD.shape[0] % (product * size) == 0:
            axes.append(axis)
            product *= size
    if not axes:
        return x_BxLxD
    spec = PartitionSpec(tuple(axes), *([None] * (x_BxLxD.ndim - 1)))
    return jax.lax.with_sharding_constraint(x_BxLxD, spec)


class Transformer(nnx.Module):
    """Decoder-only LM: int tokens [B, L] -> float32 logits [B, L, V]."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        self.config = c
        embed_init = nnx.initializers.normal(_INIT_STD)
        # nnx.Embed holds the tables; the lookups are `_embed` and plain slices.
        self.token_embed = nnx.Embed(
            c.vocab_size,
            c.d_model,
            embedding_init=_with_axes(embed_init, "vocab", "embed"),
            dtype=c.jnp_dtype,
            param_dtype=c.param_jnp_dtype,
            rngs=rngs,
        )
        if c.positions == "learned":
            self.position_embed = nnx.Embed(
                c.seq_len,
                c.d_model,
                embedding_init=_with_axes(embed_init, None, "embed"),
                dtype=c.jnp_dtype,
                param_dtype=c.param_jnp_dtype,
                rngs=rngs,
            )
        self.blocks = nnx.List([Block(c, rngs) for _ in range(c.num_layers)])
        self.final_norm = _rms_norm(c, rngs)

    def __call__(self, inputs_BxL: jax.Array) -> jax.Array:
        c = self.config
        seq_len = inputs_BxL.shape[1]
        table_VxD = self.token_embed.embedding[...]
        x_BxLxD = _embed(c, table_VxD, inputs_BxL)
        if c.positions == "learned":
            x_BxLxD = x_BxLxD + self.position_embed.embedding[:seq_len][None].astype(c.jnp_dtype)
        for block in self.blocks:
            x_BxLxD = _shard_batch(x_BxLxD) if c.shard_activations else x_BxLxD
            x_BxLxD = _remat_block(block, x_BxLxD) if c.remat else block(x_BxLxD)
        x_BxLxD = _shard_batch(x_BxLxD) if c.shard_activations else x_BxLxD
        h_BxLxD = self.final_norm(x_BxLxD)
        # Tied output projection in the compute dtype, accumulated and returned in float32.
        # The dot algorithm keeps its backward pass in the compute dtype too: the logits'
        # cotangent is float32, and without it both gradient matmuls would run in float32.
        return jnp.einsum(
            "bld,vd->blv",
            h_BxLxD.astype(c.jnp_dtype),
            table_VxD.astype(c.jnp_dtype),
            preferred_element_type=jnp.float32,
            precision=_LOW_PRECISION_DOT.get(c.dtype),
        )


@functools.partial(jax.jit, static_argnums=0)
def init_params(config: ModelConfig, key: jax.Array) -> Params:
    """Random initial parameters as a plain nested dict of arrays (dtype config.param_dtype).

    Jitted (config static); works under vmap over `key`, and
    `jax.eval_shape(init_params, config, key)` gives shapes without allocating.
    """
    model = Transformer(config, rngs=nnx.Rngs(params=key))
    _, state = nnx.split(model)
    return nnx.to_pure_dict(state)


@functools.lru_cache(maxsize=64)
def _abstract_split(config: ModelConfig) -> tuple[nnx.GraphDef, Any, Any]:
    """Cached (graphdef, State treedef, pure-dict treedef) for a config; allocates nothing."""
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(params=0)))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    # `apply` maps pure-dict leaves onto State leaves by flatten order; check that the two
    # orders agree (to_pure_dict returns the very same leaf objects).
    if not all(a is b for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(pure), strict=True)):
        raise RuntimeError("nnx State and pure dict flatten in different orders")
    return graphdef, jax.tree.structure(state), jax.tree.structure(pure)


def apply(config: ModelConfig, params: Params, inputs_BxL: jax.Array) -> jax.Array:
    """Forward pass, a pure function of (params, inputs).

    Args:
      config: the ModelConfig the params were made with (static).
      params: nested dict as returned by `init_params` (any float dtype).
      inputs_BxL: integer token ids in [0, vocab_size), shape [B, L] with 1 <= L <= seq_len.

    Returns:
      logits_BxLxV, float32. Position t depends only on inputs[:, :t + 1].
    """
    inputs_BxL = jnp.asarray(inputs_BxL)
    if inputs_BxL.ndim != 2:
        raise ValueError(f"inputs_BxL must have shape [B, L], got {inputs_BxL.shape}")
    if not jnp.issubdtype(inputs_BxL.dtype, jnp.integer):
        raise ValueError(f"inputs_BxL must be an integer array, got dtype {inputs_BxL.dtype}")
    if not 1 <= inputs_BxL.shape[1] <= config.seq_len:
        raise ValueError(
            f"inputs_BxL length {inputs_BxL.shape[1]} must be in [1, seq_len={config.seq_len}]"
        )
    if config.dtype == "float16" and jax.devices()[0].platform != "gpu":
        # jax's attention (and the logits) ask for F16_F16_F32 dots, which only GPUs have.
        raise ValueError(
            f"ModelConfig.dtype='float16' needs a GPU, got {jax.devices()[0].platform}; "
            "use bfloat16"
        )
    graphdef, state_treedef, dict_treedef = _abstract_split(config)
    if jax.tree.structure(params) != dict_treedef:
        raise ValueError("params do not match the structure init_params(config, ...) produces")
    # State and the pure dict flatten in the same (sorted-key) order, so leaves map 1:1.
    state = jax.tree.unflatten(state_treedef, jax.tree.leaves(params))
    return nnx.merge(graphdef, state)(inputs_BxL)


def init_model(
    config: ModelConfig, key: jax.Array
) -> tuple[Callable[[Params, jax.Array], jax.Array], Params]:
    """Returns (apply_fn, params) with apply_fn(params, inputs_BxL) -> logits_BxLxV."""
    return functools.partial(apply, config), init_params(config, key)


def make_loss_fn(
    config: ModelConfig, *, has_aux: bool = False
) -> Callable[[Params, dict[str, jax.Array]], Any]:
    """Returns loss_fn(params, batch) -> mean next-token cross entropy (float32 scalar, nats).

    `batch` is {"inputs": int [B, L], "targets": int [B, L]} with targets[:, t] the token
    following inputs[:, t].

    With `has_aux`, loss_fn returns (loss, metrics) as the trainers' `has_aux=True` takes it:
    the same loss, bit for bit, and `metrics(logits, targets)` of the same logits (e.g.
    "accuracy"), which carry no gradient.
    """

    def loss_and_logits(params: Params, batch: dict[str, jax.Array]):
        logits_BxLxV = apply(config, params, batch["inputs"]).astype(jnp.float32)
        loss_BxL = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, batch["targets"])
        return jnp.mean(loss_BxL), logits_BxLxV

    def loss_fn(params: Params, batch: dict[str, jax.Array]) -> jax.Array:
        return loss_and_logits(params, batch)[0]

    def loss_and_metrics_fn(
        params: Params, batch: dict[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        loss, logits_BxLxV = loss_and_logits(params, batch)
        return loss, metrics(logits_BxLxV, batch["targets"])

    if not isinstance(has_aux, bool):
        raise ValueError(f"has_aux must be True or False, got {has_aux!r}")
    # The abstract module now, outside any trace: built first inside a round's shard_map, its
    # variables' logical partitioning would be resolved against that mesh's axes.
    _abstract_split(config)
    return loss_and_metrics_fn if has_aux else loss_fn


def metrics(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> dict[str, jax.Array]:
    """A batch's training metrics beside the loss, float32 scalars by name: "accuracy", the
    fraction of target tokens that are the logits' argmax (the first one on a tie)."""
    predictions_BxL = jnp.argmax(jax.lax.stop_gradient(logits_BxLxV), axis=-1)
    return {"accuracy": jnp.mean((predictions_BxL == targets_BxL).astype(jnp.float32))}


def count_params(params: Params) -> int:
    """Total number of scalar parameters (works on arrays or ShapeDtypeStructs)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def flops_per_token(config: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward), for MFU.

    Uses the PaLM (arXiv 2204.02311, App. B) estimate 6 * N + 12 * n_layers * H * K * T:
    N counts the matmul weights a token passes through, i.e. per layer q/k/v/out
    (4 * D * H * K) and MLP (2 * D * F), plus the tied output projection (V * D); embedding
    lookups and norm scales cost ~nothing and are excluded. The second term is attention
    scores and the weighted sum of values over T context positions (no discount for the
    causal mask, as in PaLM). T defaults to config.seq_len.
    """
    t = config.seq_len if seq_len is None else seq_len
    if t < 1:
        raise ValueError(f"seq_len must be >= 1, got {t}")
    hk = config.num_heads * config.kv_size
    per_layer = 4 * config.d_model * hk + 2 * config.d_model * config.d_ff
    n_matmul = config.num_layers * per_layer + config.vocab_size * config.d_model
    return float(6 * n_matmul + 12 * config.num_layers * hk * t)


# Logical axis -> mesh axis (or axes, in order; None: never sharded) for `param_specs`: the
# FSDP / tensor-parallel layout of the usual transformer rules (MaxText, T5X).
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "embed": "fsdp",  # the residual / hidden dim D of every matrix
    "mlp": "tensor",  # the MLP hidden dim F
    "heads": "tensor",  # the attention heads (of the flattened H*K dim)
    "vocab": "tensor",  # the token embedding's (and so the tied output projection's) rows
}
# Leaves with fewer elements than this stay whole on every device by default (`param_specs`).
MIN_SHARD_SIZE = 1024


@functools.lru_cache(maxsize=64)
def _logical_names(config: ModelConfig) -> dict[tuple, tuple[str | None, ...]]:
    """Param path (as in the pure dict) -> logical axis names of its dims, () when the
    module gave none (the norm scales). From the abstract model: allocates nothing."""
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(params=0)))
    return {
        tuple(path): tuple(variable.get_metadata().get("out_sharding") or ())
        for path, variable in nnx.to_flat_state(nnx.state(abstract))
    }


def _path_keys(path: tuple) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def logical_axes(config: ModelConfig) -> Params:
    """The params' logical partitioning: a nested dict like `init_params`', each leaf a
    `PartitionSpec` of logical axis names, one per dim. Kernels: token embedding [V, D]
    ("vocab", "embed"); learned positions [L, D] (None, "embed"); query / key / value
    [D, H*K] ("embed", "heads") and out [H*K, D] ("heads", "embed"); MLP up [D, F]
    ("embed", "mlp") and down [F, D] ("mlp", "embed"). Norm scales: PartitionSpec()."""
    names = _logical_names(config)
    shapes = jax.eval_shape(init_params, config, jax.random.key(0))
    return jax.tree_util.tree_map_with_path(
        lambda path, _: PartitionSpec(*names[_path_keys(path)]), shapes
    )


def param_specs(
    config: ModelConfig,
    params: Params,
    mesh_axes: "Mapping[str, int] | jax.sharding.Mesh",
    *,
    rules: Mapping[str, str | tuple[str, ...] | None] | None = None,
    min_size: int = MIN_SHARD_SIZE,
) -> Params:
    """How each parameter is partitioned within one DiLoCo worker: a nested dict like
    `params` of `jax.sharding.PartitionSpec`s over the non-worker mesh axes (what
    `train_diloco(..., mesh=, param_sharding=)` takes). Reads only the leaves' shapes, so
    `params` may be arrays or `jax.eval_shape`'s ShapeDtypeStructs.

    Args:
      config: the ModelConfig the params were made with.
      params: the params (or their shapes), structured as `init_params(config, ...)`'s.
      mesh_axes: the non-worker mesh axes' sizes by name, e.g. {"fsdp": 2, "tensor": 2} (a
        `Mesh` is read as its `shape`; only axes the rules name are used).
      rules: logical axis -> mesh axis name, a tuple of names (the dim split over their
        product, in order) or None; default `LOGICAL_RULES`. Logical names not in it stay
        unsharded.
      min_size: leaves with fewer elements are replicated whole (default 1024).

    The rules, per dim of each leaf, from its logical axis names (`logical_axes`):
      - "embed" (the hidden dim D of every matrix) over "fsdp"; "mlp" (F), "heads" and
        "vocab" (the token embedding's rows, so the tied output projection is vocab-parallel)
        over "tensor" (`LOGICAL_RULES`).
      - A dim is left unsharded (None) when its mesh axis is absent from `mesh_axes` or of
        size 1, or when the mesh axis size does not divide it. "heads" is the flattened H*K
        dim of the attention kernels and splits by whole heads: it is sharded only when the
        size divides num_heads. With several mesh axes for one logical axis, each is kept in
        order while the product so far divides the dim.
      - A mesh axis partitions at most one dim of a leaf (the first that gets it).
      - Norm scales (and any leaf without logical names, e.g. biases if a model had them) and
        leaves of fewer than `min_size` elements are replicated: PartitionSpec().
    A spec that shards some dim has one entry per dim (trailing Nones included); one that
    shards none is PartitionSpec(). E.g. for the tiny preset on
    {"fsdp": 2, "tensor": 2}: the query kernel [128, 128] gets P("fsdp", "tensor"), the MLP's
    down kernel [512, 128] P("tensor", "fsdp") and the token embedding [256, 128]
    P("tensor", "fsdp").
    """
    if isinstance(mesh_axes, jax.sharding.Mesh):
        mesh_axes = dict(mesh_axes.shape)
    sizes = dict(mesh_axes)
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"mesh axis {name!r} must have an int size >= 1, got {size!r}")
    rules = LOGICAL_RULES if rules is None else dict(rules)
    for name, axes in rules.items():
        axes = (axes,) if isinstance(axes, str) else axes
        if axes is not None and not (
            isinstance(axes, tuple) and all(isinstance(a, str) for a in axes)
        ):
            raise ValueError(
                f"rules[{name!r}] must be a mesh axis name, a tuple of names or None, got {axes!r}"
            )
    names = _logical_names(config)
    expected = jax.tree.structure(jax.eval_shape(init_params, config, jax.random.key(0)))
    if jax.tree.structure(params) != expected:
        raise ValueError("params do not match the structure init_params(config, ...) produces")

    def spec(path: tuple, leaf: Any) -> PartitionSpec:
        shape = tuple(leaf.shape)
        logical = names[_path_keys(path)]
        if not logical or math.prod(shape) < min_size:
            return PartitionSpec()
        used: set[str] = set()
        entries: list[str | tuple[str, ...] | None] = []
        for logical_name, dim in zip(logical, shape, strict=True):
            axes = rules.get(logical_name) if logical_name is not None else None
            axes = (axes,) if isinstance(axes, str) else (axes or ())
            # The count of indivisible pieces along the dim: whole heads for "heads".
            pieces = config.num_heads if logical_name == "heads" else dim
            kept, product = [], 1
            for axis in axes:
                size = sizes.get(axis, 1)
                if size > 1 and axis not in used and pieces % (product * size) == 0:
                    kept.append(axis)
                    product *= size
            used.update(kept)
            entries.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
        return PartitionSpec(*entries) if any(entries) else PartitionSpec()

    return jax.tree_util.tree_map_with_path(spec, params)

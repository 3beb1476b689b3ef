"""Outer-gradient compression codecs for the DiLoCo all-reduce.

Each worker encodes its float32 outer gradient (parameter delta) leaf into a *payload*: a dict of
arrays with static shapes that depend only on the leaf shape and the :class:`Compression`. Low
precision codes are always carried as **integer** arrays (bf16 bitcast to ``uint16``, fp8 bitcast
to ``uint8``, 4-bit codes packed two per ``uint8``, sparsity masks packed eight per ``uint8``),
next to ``float32`` scales / values and ``int32`` indices. XLA on CPU widens bf16 / fp8
collectives back to f32, so only integer payloads make the bytes on the wire really drop.

How payloads travel is `diloco_jax.exchange`'s (``Compression.exchange``): the dense kinds
(bf16, fp8, int8, int4, e3m0) default to a two-stage quantized all-reduce of block rows
(:func:`encode_blocks` / :func:`decode_blocks`); the sparse kinds, and the dense ones with
``exchange="gather"``, to ``encode -> all_gather(payload) -> decode every worker's slice ->
mean in float32`` (:func:`encode_tree` per worker, :func:`decode_mean` on the gathered
payloads; :func:`compressed_mean` is that exchange for your own mapped code; with kind
``"none"`` it is exactly ``lax.pmean``).

Kinds (``block_size`` = elements per scale block; the flattened leaf is zero-padded to a multiple
of it and the padding is sent and counted):

* ``"none"``: the leaf itself (exact).
* ``"bf16"``: round-to-nearest-even bfloat16, sent as ``uint16``. No scales.
* ``"fp8"``: float8_e4m3fn codes of ``x / s`` with a per-block scale ``s = absmax / 448``, sent as
  ``uint8``. The scale matters: outer gradients (~1e-4) sit far below e4m3's smallest normal
  (2^-6), so an unscaled cast would flush most of them to zero.
* ``"int8"``: symmetric, ``round(x / s)`` in [-127, 127] with ``s = absmax / 127`` per block.
* ``"int4"``: symmetric, ``round(x / s)`` in [-7, 7] with ``s = absmax / 7`` per block; two's
  complement nibbles packed two per ``uint8`` (low nibble = even element).
* ``"e3m0"``: the 4-bit float of Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512):
  1 sign bit, 3 exponent bits, 0 mantissa bits. The paper fixes the bit layout, not an exponent
  bias or a scaling rule, so we use standard float semantics for the exponent field together
  with a per-block absmax scale ``s``: exponent field ``e = 0`` is zero (a subnormal with an empty
  mantissa) and ``e = 1..7`` encodes ``±s * 2^(e - 7)``; no codes are reserved for inf/NaN
  ("fn" style, like float8_e4m3fn). The grid per block is therefore
  ``{0, ±s/64, ±s/32, ±s/16, ±s/8, ±s/4, ±s/2, ±s}`` (15 values) and the block maximum is
  represented exactly. Rounding is to the nearest grid value in linear distance (ties away from
  zero): the relative error is <= 1/3 for ``|x| >= s/64`` and the absolute error is <= s/128
  below it. Nibble = ``sign << 3 | e``, packed two per ``uint8``.
* ``"topk"``: keep the ``k = ceil(keep_fraction * n)`` largest-magnitude entries of the leaf;
  payload = their float32 values + int32 flat indices (8 bytes per kept entry).
* ``"sign_prune"``: the outer-gradient pruning of DiLoCo (Douillard et al. 2023, arXiv 2311.08105,
  Table 6), which prunes outer gradients "sign-based" in the sense of TIES-merging (Yadav et al.
  2023). TIES-merging has three steps: *trim* (keep the top-k% entries by magnitude, zero the
  rest), *elect sign* and *disjoint merge*. Only trim is a per-worker operation on the outer
  gradient that removes values from what is sent; elect/disjoint-merge are a cross-worker
  aggregation rule that would replace the plain mean of the outer optimizer. Our reading is
  therefore the trim step, applied per worker and per leaf: zero out the smallest-magnitude
  ``n - k`` entries, ``k = ceil(keep_fraction * n)`` (the same selection as ``"topk"``), and
  average the pruned gradients as usual. The difference to ``"topk"`` is the wire format,
  chosen for the moderate pruning rates of the paper (25-75%): a packed keep-bitmask (n/8 bytes)
  plus the kept float32 values in position order, which is cheaper than int32 indices whenever
  more than 1/32 of the entries are kept.

* ``"sparseloco"``: SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706), as the authors' code
  (tplr-ai/SparseLoCo) does it. The leaf, viewed as a matrix (a vector as one row, a higher
  rank leaf as (prod(shape[:-1]), shape[-1])), is cut into blocks of h x w, each dim split by
  its largest divisor <= 64 (:func:`sparseloco_block_shape`); every block keeps its
  ``k = max(1, round(h * w * top_k / 4096))`` largest-magnitude values (``top_k`` in
  [1, 4096], default 128: 3.1%). Payload: the kept values' offsets inside their block, as
  uint8 [blocks, k] for blocks up to 256 elements, else 12 bits each (blocks hold at most
  64 x 64 = 4096), two offsets packed in three uint8 (the paper's 12-bit indices); and with
  ``quant`` (default) their 2-bit codes, four per uint8, with the leaf's
  four float32 levels (:func:`statistical_quantize`), else their float32 values. Error
  feedback is always on, with decay ``beta`` in [0, 1) (default 0.95): see below. The outer
  step is the caller's outer optimizer: the paper's is ``optax.sgd(1.0)`` (no momentum; the
  error feedback replaces it).

``per_contributor=True`` (sparse kinds): the gathered payloads are averaged per coordinate
over the workers that sent it (:func:`decode_mean`), not over all M; a coordinate nobody sent
is 0.

``keep_fraction`` must be in (0, 1] for ``topk``/``sign_prune`` and is rejected for other kinds;
``block_size`` is only used by the block-scaled kinds (fp8, int8, int4, e3m0). In ``k`` the product
``keep_fraction * n`` is rounded up after forgiving float noise of 1e-6 (so 0.3 * 10 keeps 3).

Error feedback (``error_feedback=True``): each worker compresses ``value = x + residual`` and
keeps ``new_residual = value - decode(payload)`` for the next round, so what is dropped is
delayed instead of lost. SparseLoCo decays it: ``value = x + beta * residual``
(``Compression.feedback_decay``; 1, no multiplication at all, for every other kind). With
``error_feedback=False`` the residual argument is ignored and the returned residual is all
zeros (:func:`compress_with_feedback`) or mirrors the argument (:func:`compressed_mean`:
zeros if a residual tree was passed, ``None`` if not).

:class:`Compression` is a frozen (hashable) dataclass rather than a NamedTuple so that it is not
a pytree: close over it or pass it as a static argument of ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from diloco_jax.carry import Part
from diloco_jax.workers import stack_workers

KINDS = ("none", "bf16", "fp8", "int8", "int4", "e3m0", "sign_prune", "topk", "sparseloco")
FRACTION_KINDS = ("sign_prune", "topk")  # the kinds that keep a keep_fraction of each leaf
SPARSE_KINDS = (*FRACTION_KINDS, "sparseloco")
BLOCK_KINDS = ("fp8", "int8", "int4", "e3m0")
DENSE_KINDS = ("bf16", *BLOCK_KINDS)
NIBBLE_KINDS = ("int4", "e3m0")
# How the payloads travel: "two_stage" (a quantized reduce-scatter + all-gather, the dense
# kinds' default), "gather" (every worker's payload to every device), "auto" (two_stage for
# the dense kinds, gather for the sparse ones).
EXCHANGES = ("auto", "two_stage", "gather")

Payload = dict[str, jax.Array]
PyTree = Any

_FP8_MAX = 448.0  # largest finite float8_e4m3fn
# e3m0 magnitude of exponent field e (0..7), in units of the block scale.
_E3M0_GRID = np.array([0.0] + [2.0 ** (e - 7) for e in range(1, 8)], np.float32)
# Rounding thresholds: |x|/s >= _E3M0_EDGES[e - 1] means exponent field >= e (midpoints).
_E3M0_EDGES = np.array([2.0**-7] + [0.75 * 2.0 ** (e - 7) for e in range(2, 8)], np.float32)

# SparseLoCo (Sarfi et al. 2025): blocks of at most CHUNK x CHUNK; top_k counts per CHUNK**2.
SPARSELOCO_CHUNK = 64
SPARSELOCO_TOP_K = 128  # of 4096: 3.1%, the paper's density
SPARSELOCO_BETA = 0.95  # error-feedback decay
_SL_BINS = 4  # 2-bit codes
_SL_SIGMAS = 6.0  # the quantizer's range, in standard deviations of the centered values


class Residuals(NamedTuple):
    """The compression part's state (`DiLoCoState.parts["compression"]`) under error
    feedback: what each worker's compression dropped so far, float32 leaves [M, ...] like
    the params, added to its next delta."""

    residual: Any

    PER_WORKER = ("residual",)


@dataclasses.dataclass(frozen=True)
class Compression(Part):
    """How an outer-gradient leaf is compressed before it is exchanged (see module docstring)."""

    kind: str = "none"
    keep_fraction: float | None = None
    error_feedback: bool = False
    block_size: int = 32
    # Not in the repr: checkpoint fingerprints of runs made before it existed (all "gather")
    # must match; `train_diloco` fingerprints a two-stage exchange separately.
    exchange: str = dataclasses.field(default="auto", repr=False)
    # SparseLoCo's options (None for other kinds; filled with the paper's defaults for
    # "sparseloco"): kept values per 4096-element block, error-feedback decay, 2-bit values.
    # In the repr only when set (`__repr__`), so other kinds' fingerprints stay as they were.
    top_k: int | None = dataclasses.field(default=None, repr=False)
    beta: float | None = dataclasses.field(default=None, repr=False)
    quant: bool | None = dataclasses.field(default=None, repr=False)
    # Sparse kinds: average each coordinate over the workers that sent it, not over all M.
    per_contributor: bool = dataclasses.field(default=False, repr=False)

    def __repr__(self) -> str:
        shown = [f for f in dataclasses.fields(self) if f.repr]
        extra = [
            f
            for f in dataclasses.fields(self)
            if not f.repr and f.name != "exchange" and getattr(self, f.name) != f.default
        ]
        body = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in shown + extra)
        return f"{type(self).__name__}({body})"

    @property
    def zero_refusal(self) -> str | None:
        """Why the outer state can't be split over the workers with this codec, or None."""
        if self.kind == "none":
            return None
        return "compression (its exchange decodes the whole mean on every worker)"

    def fingerprint(self) -> dict:
        out = {"compression": repr(self)}
        # Runs from before the two-stage exchange have no such field (all "gather").
        if self.resolved_exchange == "two_stage":
            out["exchange"] = "two_stage"
        return out

    def initial(self, params: Any, outer_state: Any, num_workers: int, method: Any) -> dict:
        """Under error feedback, zero float32 residuals for every worker (`Residuals`)."""
        if self.kind == "none" or not self.error_feedback:
            return {}
        return {"compression": Residuals(stack_workers(init_residual(params), num_workers))}

    @property
    def feedback_decay(self) -> float:
        """beta of the error feedback, value = delta + beta * residual: SparseLoCo's `beta`,
        1 (the plain residual) for every other kind."""
        return self.beta if self.kind == "sparseloco" else 1.0

    @property
    def resolved_exchange(self) -> str:
        """ "exact" for kind "none", else "two_stage" or "gather" (`exchange` resolved)."""
        if self.kind == "none":
            return "exact"
        if self.exchange == "auto":
            return "two_stage" if self.kind in DENSE_KINDS else "gather"
        return self.exchange

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"compression: unknown kind {self.kind!r}; expected one of {KINDS}")
        self._check_sparseloco()
        if not isinstance(self.per_contributor, bool | np.bool_):
            raise ValueError(
                f"compression: per_contributor must be a bool, got {self.per_contributor!r}"
            )
        object.__setattr__(self, "per_contributor", bool(self.per_contributor))
        if self.per_contributor and self.kind not in SPARSE_KINDS:
            raise ValueError(
                f"compression: per_contributor needs a sparse kind {SPARSE_KINDS}, not "
                f"{self.kind!r} (every worker sends every coordinate of a dense kind)"
            )
        if self.kind in FRACTION_KINDS:
            f = self.keep_fraction
            if f is None or isinstance(f, bool) or not isinstance(f, int | float):
                raise ValueError(
                    f"compression: kind {self.kind!r} needs keep_fraction in (0, 1], got {f!r}"
                )
            if not (0.0 < float(f) <= 1.0):
                raise ValueError(
                    f"compression: keep_fraction must be in (0, 1] for {self.kind!r}, got {f!r}"
                )
            object.__setattr__(self, "keep_fraction", float(f))
        elif self.keep_fraction is not None:
            raise ValueError(
                f"compression: keep_fraction is only used by {FRACTION_KINDS}, "
                f"not by kind {self.kind!r}"
            )
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int | np.integer) or b < 1:
            raise ValueError(f"compression: block_size must be an integer >= 1, got {b!r}")
        object.__setattr__(self, "block_size", int(b))
        if not isinstance(self.error_feedback, bool | np.bool_):
            raise ValueError(
                f"compression: error_feedback must be a bool, got {self.error_feedback!r}"
            )
        object.__setattr__(self, "error_feedback", bool(self.error_feedback))
        if self.exchange not in EXCHANGES:
            raise ValueError(
                f"compression: exchange must be one of {EXCHANGES}, got {self.exchange!r}"
            )
        if self.exchange == "two_stage" and self.kind in SPARSE_KINDS:
            raise ValueError(
                f"compression: exchange 'two_stage' needs a dense kind {DENSE_KINDS}, not "
                f"{self.kind!r} (every worker's sparse indices differ: use 'gather')"
            )

    def _check_sparseloco(self) -> None:
        """Validates top_k / beta / quant (SparseLoCo's alone) and fills their defaults;
        SparseLoCo always feeds its error back (beta = 0 keeps no memory of it)."""
        if self.kind != "sparseloco":
            for name in ("top_k", "beta", "quant"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"compression: {name} is only used by 'sparseloco', not by {self.kind!r}"
                    )
            return
        top_k = SPARSELOCO_TOP_K if self.top_k is None else self.top_k
        most = SPARSELOCO_CHUNK**2
        if isinstance(top_k, bool) or not isinstance(top_k, int | np.integer):
            raise ValueError(f"compression: top_k must be an integer in [1, {most}], got {top_k!r}")
        if not 1 <= top_k <= most:
            raise ValueError(f"compression: top_k must be in [1, {most}], got {top_k!r}")
        beta = SPARSELOCO_BETA if self.beta is None else self.beta
        if isinstance(beta, bool) or not isinstance(beta, int | float | np.floating):
            raise ValueError(f"compression: beta must be a float in [0, 1), got {beta!r}")
        if not 0.0 <= float(beta) < 1.0:
            raise ValueError(f"compression: beta must be in [0, 1), got {beta!r}")
        quant = True if self.quant is None else self.quant
        if not isinstance(quant, bool | np.bool_):
            raise ValueError(f"compression: quant must be a bool, got {quant!r}")
        object.__setattr__(self, "top_k", int(top_k))
        object.__setattr__(self, "beta", float(beta))
        object.__setattr__(self, "quant", bool(quant))
        object.__setattr__(self, "error_feedback", True)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_compression(spec: str | Compression | None) -> Compression:
    """Builds a validated :class:`Compression`.

    ``None`` means ``"none"``. Strings are ``kind[:head][,key=value...]``. ``head`` is either
    a number (the keep_fraction of topk / sign_prune, the top_k of sparseloco) or the first
    ``key=value`` option. Keys: ``keep_fraction`` (alias ``k``), ``error_feedback`` (alias
    ``ef``), ``block_size`` (alias ``block``), ``exchange`` (auto/two_stage/gather), and for
    sparse kinds ``per_contributor``; for sparseloco ``top_k`` (alias ``topk``), ``beta``
    (alias ``error_decay``) and ``quant`` (alias ``quantize``). Booleans are
    true/false/yes/no/on/off/1/0. E.g. ``"int8"``, ``"topk:0.01"``,
    ``"int4,block_size=64,error_feedback=true"``, ``"sign_prune:0.5,ef=1"``,
    ``"int8,exchange=gather"``, ``"sparseloco"``, ``"sparseloco:top_k=64,beta=0.9"``,
    ``"sparseloco,top_k=4096,quant=0,per_contributor=1"``. A ``Compression`` is re-validated
    and returned. Raises ``ValueError`` (message starting ``compression:`` and naming the
    option) on an unknown kind or option, a keep_fraction missing / outside (0, 1] for
    topk/sign_prune or given to another kind, a block_size < 1, a top_k outside [1, 4096], a
    beta outside [0, 1), an option of another kind, or error_feedback off for sparseloco
    (it always feeds back; beta=0 keeps no memory).
    """
    if spec is None:
        return Compression("none")
    if isinstance(spec, Compression):
        return dataclasses.replace(spec)  # re-runs validation
    if not isinstance(spec, str):
        raise ValueError(f"compression: expected a str, Compression or None, got {spec!r}")
    parts = [p.strip() for p in spec.strip().split(",")]
    head, opts = parts[0], parts[1:]
    kind = head.split(":", 1)[0].strip().lower()
    kwargs: dict[str, Any] = {}
    if ":" in head:
        first = head.split(":", 1)[1].strip()
        if "=" in first:
            opts = [first, *opts]
        elif kind == "sparseloco":
            kwargs["top_k"] = _parse_number(int, "top_k", first, spec)
        else:
            kwargs["keep_fraction"] = _parse_number(float, "keep_fraction", first, spec)
    for opt in opts:
        if "=" not in opt:
            raise ValueError(f"compression: expected key=value, got {opt!r} in {spec!r}")
        key, val = (s.strip().lower() for s in opt.split("=", 1))
        name = _ALIASES.get(key, key)
        if name in ("keep_fraction", "beta"):
            kwargs[name] = _parse_number(float, name, val, spec)
        elif name in ("block_size", "top_k"):
            kwargs[name] = _parse_number(int, name, val, spec)
        elif name in ("error_feedback", "quant", "per_contributor"):
            if val not in _TRUE + _FALSE:
                raise ValueError(f"compression: bad {name} {val!r} in {spec!r}")
            kwargs[name] = val in _TRUE
        elif name == "exchange":
            kwargs[name] = val
        else:
            raise ValueError(f"compression: unknown option {key!r} in {spec!r}")
    if kind == "sparseloco" and kwargs.get("error_feedback") is False:
        raise ValueError(
            f"compression: error_feedback is always on for sparseloco (beta=0 keeps no "
            f"memory of what was dropped), got {spec!r}"
        )
    return Compression(kind, **kwargs)


_ALIASES = {
    "k": "keep_fraction",
    "ef": "error_feedback",
    "block": "block_size",
    "topk": "top_k",
    "error_decay": "beta",
    "quantize": "quant",
}


def _parse_number(cast: type, name: str, s: str, spec: str) -> Any:
    """``cast(s)`` (int or float), or a ValueError naming option `name`."""
    try:
        return cast(s)
    except ValueError:
        raise ValueError(f"compression: bad {name} {s!r} in {spec!r}") from None


# ----------------------------------------------------------------------------- static sizes


def _size(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def num_kept(n: int, keep_fraction: float) -> int:
    """``k = ceil(keep_fraction * n)`` (float noise below 1e-6 forgiven), clipped to [1, n]."""
    if n == 0:
        return 0
    return min(n, max(1, math.ceil(keep_fraction * n - 1e-6)))


def _blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


# ----------------------------------------------------------------------------- helpers


def _blocked(x: jax.Array, block_size: int) -> jax.Array:
    """Flattens to float32, zero-pads to a multiple of block_size, reshapes (blocks, block)."""
    flat = jnp.ravel(x).astype(jnp.float32)
    n = flat.shape[0]
    nb = _blocks(n, block_size)
    flat = jnp.pad(flat, (0, nb * block_size - n))
    return flat.reshape(nb, block_size)


def _absmax_scale(xb: jax.Array, qmax: float) -> tuple[jax.Array, jax.Array]:
    """Per-block scale ``absmax / qmax`` and a division-safe version (1 where the scale is 0)."""
    scale = jnp.max(jnp.abs(xb), axis=1) / qmax
    safe = jnp.where(scale > 0, scale, 1.0)
    return scale, safe


def _pack_nibbles(nib: jax.Array) -> jax.Array:
    """uint8 values in [0, 16) -> uint8 pairs (even element in the low nibble)."""
    nib = nib.astype(jnp.uint8)
    if nib.shape[0] % 2:
        nib = jnp.pad(nib, (0, 1))
    pairs = nib.reshape(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack_nibbles(packed: jax.Array, count: int) -> jax.Array:
    nib = jnp.stack([packed & 0xF, packed >> 4], axis=1).reshape(-1)
    return nib[:count]


def _restore(flat: jax.Array, shape: Sequence[int], dtype) -> jax.Array:
    return flat[: _size(shape)].reshape(tuple(shape)).astype(dtype)


# ----------------------------------------------------------------------------- sparseloco
# SparseLoCo's codec (Sarfi et al. 2025, arXiv 2508.15706; the rules of the authors' code,
# tplr-ai/SparseLoCo): a leaf viewed as a matrix is cut into blocks, the top k of each block
# by |value| are kept, their offsets inside the block travel as uint8 or packed 12-bit
# integers and their values as float32 or as 2-bit codes of a per-leaf statistical quantizer.


def _largest_divisor_at_most(n: int, most: int) -> int:
    """The largest divisor of n that is <= most (n itself when n <= most; 1 for n = 0)."""
    if n <= most:
        return max(n, 1)
    return next(d for d in range(most, 0, -1) if n % d == 0)


def _matrix_view(shape: Sequence[int]) -> tuple[int, int]:
    """The (rows, cols) a leaf is chunked as: a scalar (1, 1), a vector (1, n), a matrix
    itself, and a higher-rank leaf (prod(shape[:-1]), shape[-1]) (the authors' code handles
    only 1-D and 2-D leaves; this extends it the way fan-in is usually counted)."""
    shape = tuple(int(d) for d in shape)
    if len(shape) <= 1:
        return 1, _size(shape)
    return _size(shape[:-1]), shape[-1]


def sparseloco_block_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The block a leaf of ``shape`` is cut into: each dim of its matrix view (see
    `_matrix_view`) split by its largest divisor <= 64, as the authors' ``_get_smaller_split``
    does. 1-D and 0-D leaves: ``(w,)``; others ``(h, w)``. E.g. (128, 96) -> (64, 48),
    (100, 30) -> (50, 30), (7,) -> (7,), (200,) -> (50,); a prime dim > 64 gets blocks of 1
    along it (every element of such a vector is then its own block)."""
    rows, cols = _matrix_view(shape)
    w = _largest_divisor_at_most(cols, SPARSELOCO_CHUNK)
    if len(tuple(shape)) <= 1:
        return (w,)
    return _largest_divisor_at_most(rows, SPARSELOCO_CHUNK), w


def sparseloco_k(block_len: int, top_k: int) -> int:
    """Values kept per block of ``block_len`` elements: ``max(1, round(block_len * top_k /
    4096))`` with Python's round (half to even), as the authors' code; at most block_len."""
    return min(block_len, max(1, round(block_len * top_k / SPARSELOCO_CHUNK**2)))


def _sl_geometry(shape: Sequence[int], top_k: int) -> tuple[int, int, int, int, int]:
    """(rows, cols, h, w, k) of a leaf: its matrix view, block and values kept per block."""
    rows, cols = _matrix_view(shape)
    block = sparseloco_block_shape(shape)
    h, w = (1, *block) if len(block) == 1 else block
    return rows, cols, h, w, sparseloco_k(h * w, top_k)


def _sl_packed_offsets(block_len: int) -> bool:
    """Whether offsets 0..block_len-1 travel packed as 12 bits (else one uint8 each)."""
    return block_len > 256


def _pack_12bit(values: jax.Array) -> jax.Array:
    """Integers in [0, 4096) [n] -> uint8 [3 ceil(n / 2)]: each pair (a, b) as the bytes
    a & 0xff, a >> 8 | (b & 0xf) << 4, b >> 4."""
    v = values.astype(jnp.uint16)
    v = jnp.pad(v, (0, v.shape[0] % 2)).reshape(-1, 2)
    a, b = v[:, 0], v[:, 1]
    packed = jnp.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], axis=1)
    return packed.astype(jnp.uint8).reshape(-1)


def _unpack_12bit(packed: jax.Array, count: int) -> jax.Array:
    """Inverse of `_pack_12bit`: int32 [count]."""
    p = packed.astype(jnp.int32).reshape(-1, 3)
    a = p[:, 0] | ((p[:, 1] & 0xF) << 8)
    b = (p[:, 1] >> 4) | (p[:, 2] << 4)
    return jnp.stack([a, b], axis=1).reshape(-1)[:count]


def _sl_kept(shape: Sequence[int], top_k: int) -> tuple[int, int]:
    """(blocks, k): how many blocks a leaf of ``shape`` has and how many values each keeps."""
    rows, cols, h, w, k = _sl_geometry(shape, top_k)
    return (rows // h) * (cols // w), k


def _sl_offsets(payload: Payload, shape: Sequence[int], top_k: int) -> jax.Array:
    """int32 [blocks, k]: each kept value's offset inside its block."""
    _, _, h, w, _ = _sl_geometry(shape, top_k)
    if not _sl_packed_offsets(h * w):
        return payload["offsets"].astype(jnp.int32)
    num_blocks, k = _sl_kept(shape, top_k)
    return _unpack_12bit(payload["offsets"], num_blocks * k).reshape(num_blocks, k)


def _to_chunks(x: jax.Array, rows: int, cols: int, h: int, w: int) -> jax.Array:
    """float32 [num_blocks, h*w]: block (i, j) of the [rows, cols] view is row
    i * (cols // w) + j, its elements in row-major order (einops "(y h) (x w) -> (y x) (h w)")."""
    xm = jnp.ravel(x).astype(jnp.float32).reshape(rows // h, h, cols // w, w)
    return xm.transpose(0, 2, 1, 3).reshape(-1, h * w)


def _from_chunks(chunks: jax.Array, shape: Sequence[int], h: int, w: int) -> jax.Array:
    """Inverse of `_to_chunks`: the leaf of ``shape`` (float32)."""
    rows, cols = _matrix_view(shape)
    xm = chunks.reshape(rows // h, cols // w, h, w).transpose(0, 2, 1, 3)
    return xm.reshape(tuple(int(d) for d in shape))


def _pack_2bit(codes: jax.Array) -> jax.Array:
    """uint8 values in [0, 4) -> uint8, four per byte (element 4i in the lowest two bits)."""
    codes = codes.astype(jnp.uint8)
    codes = jnp.pad(codes, (0, -codes.shape[0] % 4)).reshape(-1, 4)
    return codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)


def _unpack_2bit(packed: jax.Array, count: int) -> jax.Array:
    shifts = jnp.asarray([0, 2, 4, 6], jnp.uint8)
    return ((packed[:, None] >> shifts) & 0x3).reshape(-1)[:count]


def statistical_quantize(values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """SparseLoCo's 2-bit quantizer of one leaf's kept values, as the authors' code does it.

    values: float32 [n]. shift = mean; c = values - shift; sigma = ||c|| / sqrt(n - 1) (0 for
    n <= 1); scale = 6 sigma / 4 (1 when that is 0 or not finite); code = clip(round(c /
    scale + 2), 0, 3), round half to even. So the bins are c / scale in (-inf, -1.5),
    [-1.5, -0.5), [-0.5, 0.5], (0.5, inf) (up to ties): asymmetric, every kept value above
    +0.75 sigma shares one level. Each bin decodes to the mean of the c in it, plus shift.

    Returns (uint8 codes [n] in [0, 4), float32 levels [4]: each bin's decoded value, 0 +
    shift for an empty bin). The authors send shift and the bin means and add them at the
    receiver; sending their float32 sums is the same numbers (the same one addition).
    """
    n = values.shape[0]
    if n == 0:
        return jnp.zeros((0,), jnp.uint8), jnp.zeros((_SL_BINS,), jnp.float32)
    shift = jnp.mean(values)
    centered = values - shift
    if n > 1:
        sigma = jnp.sqrt(jnp.sum(centered * centered)) / np.float32(math.sqrt(n - 1))
    else:
        sigma = jnp.float32(0)
    scale = np.float32(_SL_SIGMAS) * sigma / np.float32(_SL_BINS)
    scale = jnp.where((scale == 0) | ~jnp.isfinite(scale), jnp.float32(1), scale)
    codes = jnp.clip(jnp.round(centered / scale + _SL_BINS // 2), 0, _SL_BINS - 1)
    codes = codes.astype(jnp.uint8)
    sums = jnp.zeros((_SL_BINS,), jnp.float32).at[codes].add(centered)
    counts = jnp.zeros((_SL_BINS,), jnp.float32).at[codes].add(1.0)
    means = jnp.where(counts > 0, sums / jnp.where(counts > 0, counts, 1.0), 0.0)
    return codes, means + shift


def _encode_sparseloco(x: jax.Array, c: Compression) -> Payload:
    """Per block, the k largest |x|: {"offsets": their offsets inside the block, uint8
    [blocks, k] or packed 12-bit uint8 [3 ceil(blocks * k / 2)], and "codes": uint8
    [ceil(blocks * k / 4)] 2-bit codes + "levels": float32 [4] (quant), or "values": float32
    [blocks, k] (no quant)}."""
    rows, cols, h, w, k = _sl_geometry(x.shape, c.top_k)
    chunks = _to_chunks(x, rows, cols, h, w)
    _, idx = lax.top_k(jnp.abs(chunks), k)
    values = jnp.take_along_axis(chunks, idx, axis=1)
    if _sl_packed_offsets(h * w):
        payload = {"offsets": _pack_12bit(idx.reshape(-1))}
    else:
        payload = {"offsets": idx.astype(jnp.uint8)}
    if not c.quant:
        return payload | {"values": values}
    codes, levels = statistical_quantize(values.reshape(-1))
    return payload | {"codes": _pack_2bit(codes), "levels": levels}


def _sl_scatter(payload: Payload, values: jax.Array, shape: Sequence[int], top_k: int):
    """The leaf (float32, ``shape``) holding ``values`` [blocks, k] at the payload's offsets
    and zeros elsewhere."""
    _, _, h, w, _ = _sl_geometry(shape, top_k)
    idx = _sl_offsets(payload, shape, top_k)
    rows = jnp.arange(idx.shape[0])[:, None]
    chunks = jnp.zeros((idx.shape[0], h * w), jnp.float32).at[rows, idx].set(values)
    return _from_chunks(chunks, shape, h, w)


def _decode_sparseloco(payload: Payload, c: Compression, shape: Sequence[int]) -> jax.Array:
    if c.quant:
        num_blocks, k = _sl_kept(shape, c.top_k)
        codes = _unpack_2bit(payload["codes"], num_blocks * k).reshape(num_blocks, k)
        values = payload["levels"][codes]
    else:
        values = payload["values"]
    return _sl_scatter(payload, values, shape, c.top_k)


def sent_mask(
    payload: Payload, compression: Compression | str | None, shape: Sequence[int]
) -> jax.Array:
    """float32 0/1 of ``shape``: which coordinates a payload carries (a sent value may
    decode to 0; this marks it all the same). All ones for the dense kinds."""
    c = parse_compression(compression)
    shape = tuple(int(d) for d in shape)
    n = _size(shape)
    if c.kind == "sparseloco":
        ones = jnp.ones(_sl_kept(shape, c.top_k), jnp.float32)
        return _sl_scatter(payload, ones, shape, c.top_k)
    if c.kind == "topk":
        flat = jnp.zeros((n,), jnp.float32).at[payload["indices"]].set(1.0)
        return flat.reshape(shape)
    if c.kind == "sign_prune":
        return jnp.unpackbits(payload["mask"], count=n).astype(jnp.float32).reshape(shape)
    return jnp.ones(shape, jnp.float32)


# ----------------------------------------------------------------------------- encode / decode


def encode(x: jax.Array, compression: Compression | str | None) -> Payload:
    """Encodes one leaf into a payload dict of arrays with static shapes (see module docstring)."""
    c = parse_compression(compression)
    x = jnp.asarray(x)
    kind, bs = c.kind, c.block_size
    if kind == "none":
        return {"values": x}
    if kind == "bf16":
        codes = lax.bitcast_convert_type(jnp.ravel(x).astype(jnp.bfloat16), jnp.uint16)
        return {"codes": codes}
    if kind == "sparseloco":
        return _encode_sparseloco(x, c)
    if kind in FRACTION_KINDS:
        flat = jnp.ravel(x).astype(jnp.float32)
        n = flat.shape[0]
        k = num_kept(n, c.keep_fraction)
        if k == 0:
            idx = jnp.zeros((0,), jnp.int32)
        else:
            _, idx = lax.top_k(jnp.abs(flat), k)
            idx = idx.astype(jnp.int32)
        if kind == "topk":
            return {"values": flat[idx], "indices": idx}
        idx = jnp.sort(idx)
        mask = jnp.zeros((n,), jnp.bool_).at[idx].set(True)
        return {"values": flat[idx], "mask": jnp.packbits(mask)}

    elements, scale = _quantized(_blocked(x, bs), c)
    flat = elements.reshape(-1)
    return {"codes": _pack_nibbles(flat) if kind in NIBBLE_KINDS else flat, "scales": scale}


def _quantized(xb: jax.Array, c: Compression) -> tuple[jax.Array, jax.Array | None]:
    """Per-element codes of float32 blocks [NB, bs] in their integer types (bf16 / fp8 bits
    as uint16 / uint8, int8 as int8, 4-bit kinds as one uint8 nibble each), with the
    float32 per-block scales [NB] (None for bf16, which has none)."""
    kind = c.kind
    if kind == "bf16":
        return lax.bitcast_convert_type(xb.astype(jnp.bfloat16), jnp.uint16), None
    if kind == "fp8":
        scale, safe = _absmax_scale(xb, _FP8_MAX)
        y = jnp.clip(xb / safe[:, None], -_FP8_MAX, _FP8_MAX).astype(jnp.float8_e4m3fn)
        return lax.bitcast_convert_type(y, jnp.uint8), scale
    if kind == "int8":
        scale, safe = _absmax_scale(xb, 127.0)
        return jnp.clip(jnp.round(xb / safe[:, None]), -127, 127).astype(jnp.int8), scale
    if kind == "int4":
        scale, safe = _absmax_scale(xb, 7.0)
        q = jnp.clip(jnp.round(xb / safe[:, None]), -7, 7).astype(jnp.int8)
        return lax.bitcast_convert_type(q, jnp.uint8) & 0xF, scale  # two's complement nibble
    if kind == "e3m0":
        scale, safe = _absmax_scale(xb, 1.0)
        a = jnp.abs(xb) / safe[:, None]
        e = jnp.sum(a[..., None] >= jnp.asarray(_E3M0_EDGES), axis=-1).astype(jnp.uint8)
        sign = (xb < 0).astype(jnp.uint8) & (e > 0).astype(jnp.uint8)
        return (sign << 3) | e, scale
    raise AssertionError(kind)  # unreachable: Compression validates kind


def decode(
    payload: Payload,
    compression: Compression | str | None,
    shape: Sequence[int],
    dtype=jnp.float32,
) -> jax.Array:
    """Inverse of :func:`encode`: returns an array of ``shape`` and ``dtype``."""
    c = parse_compression(compression)
    kind, bs = c.kind, c.block_size
    shape = tuple(int(d) for d in shape)
    n = _size(shape)
    if kind == "none":
        return payload["values"].reshape(shape).astype(dtype)
    if kind == "bf16":
        y = lax.bitcast_convert_type(payload["codes"], jnp.bfloat16).astype(jnp.float32)
        return _restore(y, shape, dtype)
    if kind == "sparseloco":
        return _decode_sparseloco(payload, c, shape).astype(dtype)
    if kind == "topk":
        flat = jnp.zeros((n,), jnp.float32).at[payload["indices"]].set(payload["values"])
        return _restore(flat, shape, dtype)
    if kind == "sign_prune":
        values = payload["values"]
        k = values.shape[0]
        mask = jnp.unpackbits(payload["mask"], count=n).astype(jnp.bool_)
        if k == 0:
            return jnp.zeros(shape, dtype)
        pos = jnp.clip(jnp.cumsum(mask.astype(jnp.int32)) - 1, 0, k - 1)
        flat = jnp.where(mask, values[pos], 0.0)
        return _restore(flat, shape, dtype)

    scales = payload["scales"]
    nb = scales.shape[0]
    codes = payload["codes"]
    if kind in NIBBLE_KINDS:
        codes = _unpack_nibbles(codes, nb * bs)
    y = _dequantized(codes.reshape(nb, bs), scales, c)
    return _restore(y.reshape(-1), shape, dtype)


def _dequantized(elements: jax.Array, scale: jax.Array | None, c: Compression) -> jax.Array:
    """Inverse of `_quantized`: float32 blocks [NB, bs]."""
    kind = c.kind
    if kind == "bf16":
        return lax.bitcast_convert_type(elements, jnp.bfloat16).astype(jnp.float32)
    if kind == "fp8":
        y = lax.bitcast_convert_type(elements, jnp.float8_e4m3fn).astype(jnp.float32)
    elif kind == "int8":
        y = elements.astype(jnp.float32)
    elif kind == "int4":
        nib = elements.astype(jnp.int32)
        y = jnp.where(nib >= 8, nib - 16, nib).astype(jnp.float32)
    elif kind == "e3m0":
        mag = jnp.asarray(_E3M0_GRID)[elements & 0x7]
        y = jnp.where((elements >> 3) > 0, -mag, mag)
    else:
        raise AssertionError(kind)
    return y * scale[:, None]


# ----------------------------------------------------------------------------- block rows
# The two-stage exchange moves whole blocks: each leaf zero-padded to whole blocks, the
# leaves' blocks stacked [NB, bs], and every block's codes packed into one row (4-bit codes
# two per byte within the row), so any run of rows is a self-contained chunk.


def to_blocks(leaves: Sequence[jax.Array], block_size: int) -> jax.Array:
    """float32 [NB, block_size]: each leaf flattened, zero-padded to whole blocks, stacked."""
    return jnp.concatenate([_blocked(x, block_size) for x in leaves], axis=0)


def from_blocks(xb: jax.Array, like: Sequence[Any]) -> list[jax.Array]:
    """Inverse of `to_blocks`: the leaves (shapes and dtypes of `like`) from [NB, bs]."""
    bs, out, start = xb.shape[1], [], 0
    for x in like:
        nb = _blocks(_size(x.shape), bs)
        out.append(_restore(xb[start : start + nb].reshape(-1), x.shape, x.dtype))
        start += nb
    return out


def encode_blocks(xb: jax.Array, c: Compression) -> tuple[jax.Array, jax.Array | None]:
    """Dense-kind codes of float32 blocks [NB, bs], one row per block: ([NB, row] codes in
    the kind's integer type, float32 scales [NB] or None for bf16). Per block the codes and
    scale are exactly those `encode` produces."""
    elements, scale = _quantized(xb, c)
    if c.kind in NIBBLE_KINDS:
        elements = jax.vmap(_pack_nibbles)(elements)
    return elements, scale


def decode_blocks(codes: jax.Array, scale: jax.Array | None, c: Compression) -> jax.Array:
    """Inverse of `encode_blocks`: float32 [NB, c.block_size]."""
    if c.kind in NIBBLE_KINDS:
        codes = jax.vmap(lambda row: _unpack_nibbles(row, c.block_size))(codes)
    return _dequantized(codes, scale, c)


def block_row_bytes(c: Compression) -> int:
    """Wire bytes of one block in the two-stage exchange: its codes row and its scale."""
    one_block = jax.ShapeDtypeStruct((1, c.block_size), jnp.float32)
    encoded = jax.eval_shape(functools.partial(encode_blocks, c=c), one_block)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(encoded))


# ----------------------------------------------------------------------------- sizes


def payload_bytes(shape: Sequence[int], dtype, compression: Compression | str | None) -> int:
    """Bytes of the payload arrays of one leaf (codes, scales, indices, masks, padding).

    Computed abstractly with ``jax.eval_shape``; nothing is run.
    """
    c = parse_compression(compression)
    spec = jax.ShapeDtypeStruct(tuple(int(d) for d in shape), jnp.dtype(dtype))
    out = jax.eval_shape(lambda x: encode(x, c), spec)
    return int(sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(out)))


def tree_payload_bytes(tree: PyTree, compression: Compression | str | None) -> int:
    """Sum of :func:`payload_bytes` over the leaves (arrays or ShapeDtypeStructs) of ``tree``."""
    c = parse_compression(compression)
    return sum(payload_bytes(x.shape, x.dtype, c) for x in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------- error feedback


def init_residual(tree: PyTree) -> PyTree:
    """Zero float32 error-feedback residuals shaped like ``tree``."""
    return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), tree)


def compress_with_feedback(
    x: jax.Array, residual: jax.Array | None, compression: Compression | str | None
) -> tuple[Payload, jax.Array]:
    """Encodes ``value = x + beta * residual`` and returns ``(payload, value -
    decode(payload))``: what was dropped, as the receiver decodes what was sent.

    ``beta`` is ``compression.feedback_decay``: SparseLoCo's decay in [0, 1), 1 for every
    other kind (then ``value = x + residual``, with no multiplication, as it always was).
    With ``error_feedback=False`` the residual is ignored (may be ``None``), ``x`` alone is
    encoded and the returned residual is float32 zeros shaped like ``x``. A ``None`` residual
    with error feedback on counts as zeros.
    """
    c = parse_compression(compression)
    x = jnp.asarray(x)
    if not c.error_feedback:
        return encode(x, c), jnp.zeros(x.shape, jnp.float32)
    value = x.astype(jnp.float32)
    if residual is not None:
        r = residual.astype(jnp.float32)
        decay = c.feedback_decay
        value = value + (r if decay == 1.0 else np.float32(decay) * r)
    payload = encode(value, c)
    return payload, value - decode(payload, c, x.shape, jnp.float32)


# ----------------------------------------------------------------------------- trees


def encode_tree(
    tree: PyTree, compression: Compression | str | None, residual: PyTree | None = None
) -> tuple[PyTree, PyTree]:
    """One worker's payloads for every leaf of ``tree`` (see :func:`compress_with_feedback`).

    Args:
      tree: this worker's leaves (e.g. its outer gradient), any float dtype.
      compression: a lossy kind (``"none"`` encodes to ``{"values": leaf}``).
      residual: float32 tree like ``tree`` or ``None`` (zeros); read only with error feedback.

    Returns:
      ``(payloads, new_residual)``: ``payloads`` has ``tree``'s structure with a payload dict
      per leaf (static shapes, integer codes); ``new_residual`` is float32 like ``tree`` (all
      zeros without error feedback).
    """
    c = parse_compression(compression)
    leaves, treedef = jax.tree.flatten(tree)
    res = [None] * len(leaves) if residual is None else treedef.flatten_up_to(residual)
    pairs = [compress_with_feedback(x, r, c) for x, r in zip(leaves, res, strict=True)]
    payloads = treedef.unflatten([p for p, _ in pairs])
    return payloads, treedef.unflatten([r for _, r in pairs])


def decode_mean(
    gathered: PyTree,
    compression: Compression | str | None,
    like: PyTree,
    weights: jax.Array | None = None,
    *,
    per_contributor: bool | None = None,
) -> PyTree:
    """Mean over workers of their payloads, decoded.

    Args:
      gathered: ``like``'s structure with a payload dict per leaf whose arrays are stacked
        over the workers, [M, ...] (what an all_gather of :func:`encode_tree`'s payloads gives).
      compression: the compression that encoded them.
      like: arrays or ``jax.ShapeDtypeStruct``s: each leaf's shape and dtype, without M.
      weights: optional float32 [M] >= 0: the weighted mean sum_m w_m x_m / sum_m w_m instead,
        where a worker of weight 0 is left out (its payload is masked, never multiplied: it
        may decode to anything); zeros where every weight is 0.
      per_contributor: divide each coordinate by the number (the weight sum) of the workers
        whose payload carries it (:func:`sent_mask`), not by M (the weight sum of all): a
        coordinate nobody sent is 0. None: ``compression.per_contributor``. With every
        coordinate sent by every worker it is the plain mean.

    Returns:
      ``like``-shaped tree: every worker's payload decoded to float32, averaged in float32
      and cast to the leaf's dtype.
    """
    c = parse_compression(compression)
    per = c.per_contributor if per_contributor is None else bool(per_contributor)
    like_leaves, treedef = jax.tree.flatten(like)
    if weights is not None:
        weights = weights.astype(jnp.float32)
        total = jnp.sum(weights)
        safe_total = jnp.where(total > 0, total, 1.0)
    means = []
    for payload, x in zip(treedef.flatten_up_to(gathered), like_leaves, strict=True):
        shape = tuple(jnp.shape(x))
        decoded = jax.vmap(lambda p, shape=shape: decode(p, c, shape, jnp.float32))(payload)
        if per:
            sent = jax.vmap(lambda p, shape=shape: sent_mask(p, c, shape))(payload)
            mean = _contributor_mean(decoded, sent, weights)
        elif weights is None:
            mean = jnp.mean(decoded, axis=0)
        else:
            w = weights.reshape((-1,) + (1,) * len(shape))
            summed = jnp.sum(jnp.where(w > 0, decoded * w, 0.0), axis=0)
            mean = jnp.where(total > 0, summed / safe_total, 0.0)
        means.append(mean.astype(x.dtype))
    return treedef.unflatten(means)


def _contributor_mean(decoded: jax.Array, sent: jax.Array, weights: jax.Array | None) -> jax.Array:
    """Per coordinate, sum_m w_m x_m / sum_m w_m over the workers m that sent it (w = 1 when
    `weights` is None; a worker of weight 0 is masked out, never multiplied); 0 where none
    did. decoded, sent: float32 [M, ...] (sent 0/1); weights: float32 [M] or None."""
    if weights is None:
        summed, count = jnp.sum(decoded, axis=0), jnp.sum(sent, axis=0)
    else:
        w = weights.reshape((-1,) + (1,) * (decoded.ndim - 1))
        summed = jnp.sum(jnp.where(w > 0, decoded * w, 0.0), axis=0)
        count = jnp.sum(jnp.where(w > 0, sent * w, 0.0), axis=0)
    return jnp.where(count > 0, summed / jnp.where(count > 0, count, 1.0), 0.0)


# ----------------------------------------------------------------------------- collective


def compressed_mean(
    tree: PyTree,
    compression: Compression | str | None,
    axis_name,
    residual: PyTree | None = None,
) -> tuple[PyTree, PyTree | None]:
    """Mean of ``tree`` over ``axis_name`` with every worker's leaves sent compressed.

    For use inside ``jax.vmap(axis_name=...)``, ``shard_map`` or ``pmap``. Each leaf is encoded
    (after adding the residual, decayed by SparseLoCo's beta, when error feedback is on), the
    payload is ``lax.all_gather``-ed, every worker's slice is decoded and the slices are
    averaged in float32 (per contributor if the compression says so); the mean is returned
    in the leaf's dtype. Kind ``"none"`` uses ``lax.pmean`` directly (bit-identical to it).

    Returns ``(mean_tree, new_residual)``. With error feedback, ``new_residual`` is this worker's
    float32 residual tree (``residual=None`` starts from zeros). Without, it is a zero tree if a
    residual tree was passed and ``None`` otherwise.
    """
    c = parse_compression(compression)
    tree = jax.tree.map(jnp.asarray, tree)
    if c.kind == "none":
        if c.error_feedback and residual is not None:
            tree = jax.tree.map(
                lambda x, r: (x.astype(jnp.float32) + r.astype(jnp.float32)).astype(x.dtype),
                tree,
                residual,
            )
        mean_tree = lax.pmean(tree, axis_name)
        new_residual = init_residual(tree)
    else:
        payloads, new_residual = encode_tree(tree, c, residual)
        mean_tree = decode_mean(lax.all_gather(payloads, axis_name), c, tree)
    if not c.error_feedback and residual is None:
        return mean_tree, None
    return mean_tree, new_residual

"""Inner optimizers beyond AdamW: MuLoCo's Muon (Thérien et al. 2025, arXiv 2505.23725).

MuLoCo is DiLoCo with Muon as the inner optimizer. The rule, as in the authors' code (the Dion
`Muon` optimizer copied into facebookresearch/MuLoCo, torchtitan/.../dion_optimizer/muon.py,
and bentherien/muloco-1, muloco/pytorch/muloco.py), for a hidden matrix W with gradient G:

  M ← μ·M + G                                  (momentum μ = 0.95, no Nesterov)
  O = NS(M)                                    (5 Newton-Schulz steps, Dion's coefficients)
  W ← W·(1 − lr·λ) − lr·sqrt(fan_out / fan_in)·O   (decoupled weight decay λ)

and every other leaf (embeddings, the output head, 1-D norms and biases) takes AdamW
(b1 0.9, b2 0.95, eps 1e-8) with the same learning rate and weight decay unless told otherwise.

Built from optax: `optax.partition` routes the leaves, `optax.contrib.scale_by_muon` does the
momentum and the orthogonalization, `optax.add_decayed_weights` + `optax.scale_by_learning_rate`
the decoupled decay, `optax.adamw` the rest. The one hand-written piece is the width scaling:
optax's own `scale_by_shape` multiplies by sqrt(max(1, fan_out / fan_in)) (Keller Jordan's rule),
which is not the authors' sqrt(fan_out / fan_in) when fan_out < fan_in (an MLP's down
projection gets 1 instead of 0.5).

Layout: a 2-D leaf is read as [fan_in, fan_out], the `x @ W` kernels of Flax and Haiku (the
transpose of PyTorch's [out, in] weights, so the ratio is shape[1] / shape[0] here). The
orthogonalization itself does not care about the layout.
"""

import math
from collections.abc import Callable
from typing import Any

import jax
import optax

from diloco_jax.checks import check_number, check_rate

MUON, ADAMW = "muon", "adamw"

# The Newton-Schulz quintic f(X) = a·X + b·(XXᵀ)X + c·(XXᵀ)²X, one (a, b, c) per iteration, as in
# Dion's `zeropower_via_newtonschulz5` (microsoft/dion, dion/muon.py), which the MuLoCo authors
# use unchanged; optax 0.2.8 holds the same five triples as its "dion" preset.
DION_NS_COEFFS: tuple[tuple[float, float, float], ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

# Names (lower-cased path components) that mark a 2-D leaf as an embedding or an output head,
# which Muon leaves to AdamW: "token_embed"/"embedding" (this package's LM), "wte"/"wpe"
# (GPT-2), "lm_head", "output" (torchtitan's Llama head), "classifier".
_EMBEDDING_PARTS = ("embed", "wte", "wpe")
_HEAD_NAMES = ("head", "output", "classifier")

HiddenMatrixRule = Callable[[tuple[str, ...], Any], bool]


def ns_coefficients(ns_steps: int) -> tuple[tuple[float, float, float], ...]:
    """The (a, b, c) of each of `ns_steps` Newton-Schulz iterations (int >= 1).

    Dion's five triples in order; fewer steps take the first ones (the sequence is greedy:
    each triple is fitted to the singular values the previous ones leave), more steps repeat
    the last one (its fixed point holds the singular values near 1).
    """
    last = len(DION_NS_COEFFS) - 1
    return tuple(DION_NS_COEFFS[min(i, last)] for i in range(ns_steps))


def _key_name(key: Any) -> str:
    """A path entry (dict key, attribute, sequence index) as a plain string."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _is_embedding_or_head(part: str) -> bool:
    part = part.lower()
    is_embedding = any(name in part for name in _EMBEDDING_PARTS)
    is_head = part in _HEAD_NAMES or part.endswith("_head")
    return is_embedding or is_head


def default_is_hidden_matrix(path: tuple[str, ...], leaf: Any) -> bool:
    """MuLoCo's default routing: True (Muon) for a 2-D leaf that no path component names an
    embedding or an output head; False (AdamW) for everything else.

    Args:
      path: the leaf's path as strings, e.g. ("blocks", "0", "mlp", "up", "kernel").
      leaf: an array or anything with `.shape` (a ShapeDtypeStruct works).
    """
    return len(leaf.shape) == 2 and not any(_is_embedding_or_head(part) for part in path)


def muon_labels(params: Any, is_hidden_matrix: HiddenMatrixRule | None = None) -> Any:
    """Labels every leaf of `params` "muon" or "adamw" (a pytree of strings, same structure).

    `is_hidden_matrix(path, leaf) -> bool` decides (default `default_is_hidden_matrix`); the
    path is a tuple of strings. Works on updates and ShapeDtypeStructs as well as params.
    """
    rule = default_is_hidden_matrix if is_hidden_matrix is None else is_hidden_matrix

    def label(path: tuple, leaf: Any) -> str:
        names = tuple(_key_name(k) for k in path)
        if not rule(names, leaf):
            return ADAMW
        if len(leaf.shape) != 2:  # a custom rule must not send Muon what it can't take
            raise ValueError(
                f"is_hidden_matrix chose Muon for {'/'.join(names)} of shape {leaf.shape}; "
                "Muon takes 2-D leaves only"
            )
        return MUON

    return jax.tree_util.tree_map_with_path(label, params)


def scale_by_fan_ratio() -> optax.GradientTransformation:
    """Multiplies each 2-D update [fan_in, fan_out] by sqrt(fan_out / fan_in): the authors'
    `adjust_lr_spectral_norm` (spectral norm 1 -> RMS-to-RMS operator norm 1), so one learning
    rate fits every width. Stateless; leaves that aren't 2-D pass unchanged."""

    def scale(u: jax.Array) -> jax.Array:
        if u.ndim != 2:
            return u
        return u * math.sqrt(u.shape[1] / u.shape[0])

    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(scale, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def _matrix_dims(updates: Any) -> Any:
    """A MuonDimensionNumbers (reduce axis 0, output axis 1) for every leaf: what
    `scale_by_muon` needs under `optax.partition`, where the AdamW leaves are MaskedNodes
    (empty subtrees the map passes through)."""
    return jax.tree.map(lambda _: optax.contrib.MuonDimensionNumbers(0, 1), updates)


def muon_inner_optimizer(
    learning_rate: optax.ScalarOrSchedule = 0.02,
    *,
    adamw_learning_rate: optax.ScalarOrSchedule | None = None,
    momentum: float = 0.95,
    weight_decay: float = 0.01,
    adamw_weight_decay: float | None = None,
    adamw_b1: float = 0.9,
    adamw_b2: float = 0.95,
    eps: float = 1e-8,
    ns_steps: int = 5,
    is_hidden_matrix: HiddenMatrixRule | None = None,
) -> optax.GradientTransformation:
    """MuLoCo's inner optimizer: Muon on the hidden matrices, AdamW on every other leaf.

    Args:
      learning_rate: Muon's learning rate (a float > 0 or an optax schedule of the step);
        0.02 is the MuLoCo recipe's. Each matrix's step is lr · sqrt(fan_out / fan_in).
      adamw_learning_rate: AdamW's; None uses `learning_rate`, as the authors do (one base
        learning rate for every parameter group).
      momentum: Muon's momentum μ in [0, 1): M ← μ·M + G, no Nesterov. (optax keeps the
        bias-corrected EMA (1 − μ)·Σ μ^k G instead; a positive scale of M, which the
        Newton-Schulz normalization removes.)
      weight_decay: decoupled weight decay λ of the Muon leaves, >= 0: W ← W·(1 − lr·λ), with
        the unscaled learning rate. 0.01 is the authors' default.
      adamw_weight_decay: AdamW's decoupled weight decay; None uses `weight_decay`.
      adamw_b1, adamw_b2: AdamW's moment decays (0.9, 0.95 as the authors').
      eps: Newton-Schulz's normalization X / (‖X‖_F + eps) and AdamW's denominator.
      ns_steps: Newton-Schulz iterations, int >= 1 (see `ns_coefficients`).
      is_hidden_matrix: `(path, leaf) -> bool`, True for the leaves Muon takes (2-D only);
        default `default_is_hidden_matrix`.

    Returns:
      An optax GradientTransformation over any params pytree. Its state holds Muon's momentum
      (Muon leaves) and Adam's two moments (AdamW leaves). Raises ValueError naming the
      argument for a bad value.
    """
    check_rate("learning_rate", learning_rate)
    if adamw_learning_rate is not None:
        check_rate("adamw_learning_rate", adamw_learning_rate)
    for name, value in (("momentum", momentum), ("adamw_b1", adamw_b1), ("adamw_b2", adamw_b2)):
        check_number(name, value, lambda x: 0 <= x < 1, "in [0, 1)")
    for name, value in (("weight_decay", weight_decay), ("adamw_weight_decay", adamw_weight_decay)):
        if value is not None:
            check_number(name, value, lambda x: x >= 0, ">= 0")
    check_number("eps", eps, lambda x: x > 0, "> 0")
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
        raise ValueError(f"ns_steps must be an integer >= 1, got {ns_steps!r}")
    if is_hidden_matrix is not None and not callable(is_hidden_matrix):
        raise ValueError(
            f"is_hidden_matrix must be a function (path, leaf) -> bool, got {is_hidden_matrix!r}"
        )

    muon = optax.chain(
        optax.contrib.scale_by_muon(
            ns_coeffs=ns_coefficients(ns_steps),
            ns_steps=ns_steps,
            beta=momentum,
            eps=eps,
            nesterov=False,
            weight_dimension_numbers=_matrix_dims,
        ),
        scale_by_fan_ratio(),
        # Added after the width scaling and before the learning rate: the decay is lr·λ·W,
        # as the authors' W·(1 − lr·λ).
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
    adamw = optax.adamw(
        learning_rate if adamw_learning_rate is None else adamw_learning_rate,
        b1=adamw_b1,
        b2=adamw_b2,
        eps=eps,
        weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay,
    )
    return optax.partition(
        {MUON: muon, ADAMW: adamw},
        lambda tree: muon_labels(tree, is_hidden_matrix),
    )

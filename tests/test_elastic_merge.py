"""The elastic syncer's merge (`diloco_jax.elastic_merge`): what a worker pushes and what the
syncer makes of a sync's pushes, against a NumPy reference written from the rule."""

import jax
import numpy as np
import optax
import pytest

import diloco_jax as dj
from diloco_jax import wire
from diloco_jax.elastic_merge import make_merge

LR, MOMENTUM = 0.7, 0.9
OUTER = optax.sgd(LR, momentum=MOMENTUM, nesterov=True)
PARAMS = {"b": np.float32(0.5), "w": np.linspace(-1, 1, 256, dtype=np.float32).reshape(8, 32)}


def _int8_blocks(x, block=32):
    """Per-leaf int8 quantize-dequantize in blocks of `block` (absmax / 127 scales; the leaf
    zero-padded to whole blocks): (decoded like x, codes, scales)."""
    flat = np.ravel(x).astype(np.float32)
    padded = np.zeros(-(-flat.size // block) * block, np.float32)
    padded[: flat.size] = flat
    rows = padded.reshape(-1, block)
    scale = np.abs(rows).max(1) / np.float32(127)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.round(rows / safe[:, None]), -127, 127)
    decoded = (codes * scale[:, None]).astype(np.float32).ravel()[: flat.size]
    return decoded.reshape(np.shape(x)), codes, scale


def _reference(deltas, residuals, included):
    """θ after one outer Nesterov step on the int8 two-stage mean of the included workers'
    Δ + residual (decoded, summed in worker order, / their count, re-quantized), and each
    worker's new residual (Δ + residual - what it sent)."""
    sent, new_residuals = {}, {}
    for m in range(len(deltas)):
        value = {k: deltas[m][k] + residuals[m][k] for k in PARAMS}
        sent[m] = {k: _int8_blocks(v)[0] for k, v in value.items()}
        new_residuals[m] = {k: value[k] - sent[m][k] for k in PARAMS}
    theta = {}
    for k in PARAMS:
        summed = sum(sent[m][k] for m in included)
        mean = _int8_blocks(summed / np.float32(len(included)))[0]
        trace = mean  # from zero momentum
        theta[k] = PARAMS[k] - LR * (mean + MOMENTUM * trace)
    return theta, new_residuals


def test_an_int8_push_with_error_feedback_merges_as_the_two_stage_exchange_does():
    method = dj.DiLoCo(outer=OUTER, compression="int8,ef=1")
    merge = make_merge(method, PARAMS, num_workers=3)
    rng = np.random.default_rng(0)
    deltas = [{k: rng.normal(size=np.shape(v)).astype(np.float32) for k, v in PARAMS.items()}
              for _ in range(3)]  # fmt: skip
    residuals = [{k: 0.05 * rng.normal(size=np.shape(v)).astype(np.float32)
                  for k, v in PARAMS.items()} for _ in range(3)]  # fmt: skip
    pushes, new_residuals = {}, {}
    for m in (0, 2):  # worker 1 is not in this sync
        leaves, new_residuals[m] = merge.encode(deltas[m], residuals[m])
        # What travels: int8 codes and float32 scales, about a quarter of Δ's bytes.
        assert [x.dtype for x in leaves] == [np.int8, np.float32]
        pushes[m] = wire.tree_like(merge.push_like, leaves, "push")
    outer_state = OUTER.init(jax.tree.map(np.asarray, PARAMS))
    theta = merge.apply(PARAMS, outer_state, pushes).theta
    expected, expected_residuals = _reference(deltas, residuals, included=(0, 2))
    for k in PARAMS:
        np.testing.assert_allclose(theta[k], expected[k], rtol=1e-6, atol=1e-7)
        for m in (0, 2):
            np.testing.assert_allclose(new_residuals[m][k], expected_residuals[m][k], atol=1e-6)
    # What comes back: the mean's codes and scales as the second stage encodes them, and
    # the weight sum (4 bytes).
    assert sum(x.nbytes for x in jax.tree.leaves(merge.reply_like)) == 9 * (32 + 4) + 4
    pushed_bytes = sum(x.nbytes for x in leaves)
    delta_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(PARAMS))
    assert pushed_bytes == 9 * (32 + 4)  # b: one block, w: eight; codes + a scale each
    assert pushed_bytes < 0.5 * delta_bytes


def test_the_exact_merge_is_the_mean_of_the_included_deltas():
    merge = make_merge(dj.DiLoCo(outer=OUTER), PARAMS, num_workers=3)
    deltas = [{k: np.full(np.shape(v), m + 1.0, np.float32) for k, v in PARAMS.items()}
              for m in range(3)]  # fmt: skip
    leaves, residual = merge.encode(deltas[0], None)
    assert residual is None and [x.shape for x in leaves] == [(), (8, 32)]
    theta = merge.apply(PARAMS, OUTER.init(PARAMS), {0: deltas[0], 2: deltas[2]}).theta
    mean = 2.0  # (1 + 3) / 2
    for k in PARAMS:
        np.testing.assert_allclose(theta[k], PARAMS[k] - LR * (1 + MOMENTUM) * mean, rtol=1e-6)


@pytest.mark.parametrize("spec", ["int4,ef=1", "e3m0,ef=1", "topk:0.25,ef=1", "sparseloco", "bf16"])
def test_a_sync_of_one_worker_moves_theta_by_what_it_sent(spec):
    """With one worker in the sync and outer SGD(1): θ moves by exactly what that worker's
    payload decodes to (re-quantizing a quantized mean of one changes nothing), which error
    feedback keeps as Δ - its new residual; for bf16 (no feedback), Δ rounded to bfloat16.
    The other slots' zeros weigh nothing; the payload is smaller than Δ."""
    import ml_dtypes

    method = dj.DiLoCo(outer=optax.sgd(1.0), compression=spec)
    merge = make_merge(method, PARAMS, num_workers=4)
    rng = np.random.default_rng(1)
    delta = {k: rng.normal(size=np.shape(v)).astype(np.float32) for k, v in PARAMS.items()}
    leaves, residual = merge.encode(delta, merge.residual_like)
    assert sum(x.nbytes for x in leaves) < sum(np.asarray(x).nbytes for x in delta.values())
    one = wire.tree_like(merge.push_like, leaves, "push")
    theta = merge.apply(PARAMS, optax.sgd(1.0).init(PARAMS), {3: one}).theta
    for k in PARAMS:
        if residual is None:
            sent = np.asarray(delta[k]).astype(ml_dtypes.bfloat16).astype(np.float32)
        else:
            sent = delta[k] - residual[k]
            assert k == "b" or np.any(residual[k] != 0)  # w lost something, fed back
        np.testing.assert_allclose(PARAMS[k] - theta[k], sent, rtol=1e-6, atol=1e-6)

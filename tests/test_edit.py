"""EDiT's parts (Cheng et al. 2024): the clip of the averaged delta, the softmax weights of the
workers' delta norms, and the EWMA z-score anomaly skip, against NumPy written here.

Round-1 checks start from θ = 0 with outer SGD(1): then θ_1 = -(the applied mean) exactly."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import linear_loss

import diloco_jax as dj
from diloco_jax import comm, faults, hlo

M, H, DIM = 4, 2, 6
INNER, OUTER = optax.sgd(0.1), optax.sgd(1.0)


def _params():
    return {"w": jnp.zeros(DIM, jnp.float32), "b": jnp.float32(0.0)}


def _batch(seed=0, scales=(1.0, 1.0, 1.0, 1.0)):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(M, H, 3, DIM)).astype(np.float32)
    y = rng.normal(size=(M, H, 3)).astype(np.float32)
    return {"x": x, "y": y * np.float32(scales)[:, None, None]}


def _np_deltas(batch):
    """Each worker's float64 delta [w (DIM), b] after H SGD steps from θ = 0."""
    out = []
    for m in range(M):
        w, b = np.zeros(DIM), 0.0
        for h in range(H):
            x, y = batch["x"][m, h].astype(np.float64), batch["y"][m, h].astype(np.float64)
            err = x @ w + b - y
            w, b = w - 0.1 * x.T @ err / len(y), b - 0.1 * err.mean()
        out.append(np.concatenate([-w, [-b]]))
    return np.array(out)


def _one_round(batch, **options):
    result = dj.train_diloco(
        linear_loss, _params(), [batch], num_rounds=1, num_workers=M, inner_steps=H,
        inner_optimizer=INNER, outer_optimizer=OUTER, backend="shard_map", **options,
    )  # fmt: skip
    mean = -np.concatenate([np.asarray(result.params["w"]), [float(result.params["b"])]])
    return mean, result


def test_clip_scales_the_mean_delta_by_its_global_norm():
    batch = _batch(0)
    mean = _np_deltas(batch).mean(axis=0)
    norm = np.linalg.norm(mean)
    for phi in (0.5 * norm, 2 * norm):
        got, _ = _one_round(batch, outer_clip=phi)
        np.testing.assert_allclose(got, mean * min(1.0, phi / (norm + 1e-6)), rtol=1e-5)
    # a bound it never reaches multiplies by exactly 1: bit for bit the unclipped round
    plain, _ = _one_round(batch)
    loose, _ = _one_round(batch, outer_clip=1e9)
    np.testing.assert_array_equal(loose, plain)


@pytest.mark.parametrize("temperature", [1.0, 0.05])
def test_norm_softmax_weights(temperature):
    batch = _batch(1, scales=(1.0, 2.0, 0.5, 4.0))
    deltas = _np_deltas(batch)
    norms = np.linalg.norm(deltas, axis=1)
    w = np.exp(-norms / temperature)
    want = (w[:, None] * deltas).sum(axis=0) / w.sum()
    got, result = _one_round(batch, weighting="norm_softmax", temperature=temperature)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert result.history[0]["excluded_workers"] == []


def test_softmax_of_equal_norms_is_the_mean():
    batch = _batch(2)
    batch = {k: np.repeat(v[:1], M, axis=0) for k, v in batch.items()}  # identical workers
    plain, _ = _one_round(batch)
    soft, _ = _one_round(batch, weighting="norm_softmax")
    np.testing.assert_allclose(soft, plain, rtol=1e-6)


def np_ewma_skip(norms, threshold, alpha, warmup):
    """Per worker: which rounds are skipped, by the EWMA z-score of its own kept norms."""
    skipped = np.zeros(norms.shape, bool)
    for m in range(norms.shape[1]):
        mean = var = 0.0
        seen = 0
        for r, x in enumerate(norms[:, m]):
            if seen and r >= warmup and (x - mean) / np.sqrt(max(var, 1e-30)) > threshold:
                skipped[r, m] = True
                continue
            if seen == 0:
                mean, var = x, 0.0
            else:
                diff = x - mean
                mean, var = mean + alpha * diff, (1 - alpha) * (var + alpha * diff**2)
            seen += 1
    return skipped


def test_anomaly_statistics_against_numpy():
    rng = np.random.default_rng(3)
    norms = rng.uniform(1.0, 1.2, size=(12, 3)).astype(np.float32)
    norms[7, 1] = 5.0  # a spike after the warm-up
    norms[2, 2] = 9.0  # one during it: not skipped, and it joins the statistics
    rule = faults.AnomalySkip(threshold=3.0, alpha=0.3, warmup_rounds=4)
    stats = faults.initial_stats(3, 1)[0]
    got = []
    for r in range(12):
        x = jnp.asarray(norms[r])
        out = faults.anomalous(x, stats, jnp.int32(r), rule)
        stats = faults.updated_stats(x, stats, ~out, rule)
        got.append(np.asarray(out))
    want = np_ewma_skip(norms.astype(np.float64), 3.0, 0.3, 4)
    np.testing.assert_array_equal(np.array(got), want)
    assert want[7, 1] and not want[2, 2]


def np_deltas_from(theta, batch):
    """Each worker's float64 delta (w then b) after H SGD steps from θ = (w, b)."""
    out = []
    for m in range(M):
        w, b = theta[:DIM].copy(), theta[DIM]
        for h in range(H):
            x, y = batch["x"][m, h].astype(np.float64), batch["y"][m, h].astype(np.float64)
            err = x @ w + b - y
            w, b = w - 0.1 * x.T @ err / len(y), b - 0.1 * err.mean()
        out.append(theta - np.concatenate([w, [b]]))
    return np.array(out)


def test_anomalous_worker_is_left_out_of_the_round():
    """Worker 2's targets jump 30x in the last round: against a NumPy run of the same rule
    (outer SGD(1), each worker's EWMA statistics of its own norms), the same workers are
    left out in the same rounds and θ ends the same."""
    # The same data each round: the norms shrink smoothly as θ converges, then one jumps.
    rounds = [_batch(10) for r in range(7)]
    rounds[6]["y"][2] *= 30
    rule = faults.AnomalySkip(threshold=3.0, alpha=0.3, warmup_rounds=3)
    result = dj.train_diloco(
        linear_loss, _params(), rounds, num_rounds=7, num_workers=M, inner_steps=H,
        inner_optimizer=INNER, outer_optimizer=OUTER, anomaly=rule, exclude_nonfinite=False,
    )  # fmt: skip
    theta, stats, skipped = np.zeros(DIM + 1), [[0.0, 0.0, 0] for _ in range(M)], []
    for r, batch in enumerate(rounds):
        deltas = np_deltas_from(theta, batch)
        out = []
        for m, x in enumerate(np.linalg.norm(deltas, axis=1)):
            mean, var, seen = stats[m]
            if r >= rule.warmup_rounds and (x - mean) / np.sqrt(max(var, 1e-30)) > 3.0:
                out.append(m)
                continue
            diff = x - mean
            stats[m] = [x, 0.0, 1] if seen == 0 else [
                mean + 0.3 * diff, 0.7 * (var + 0.3 * diff**2), seen + 1
            ]  # fmt: skip
        kept = [m for m in range(M) if m not in out]
        theta = theta - deltas[kept].mean(axis=0)
        skipped.append(out)
    assert [h["excluded_workers"] for h in result.history] == skipped
    assert skipped == [[], [], [], [], [], [], [2]]
    got = np.concatenate([np.asarray(result.params["w"]), [float(result.params["b"])]])
    np.testing.assert_allclose(got, theta, rtol=1e-4, atol=1e-6)


def test_softmax_and_anomaly_wire_bytes_match_the_compiled_round():
    params = {"w": jnp.zeros(256), "b": jnp.float32(0)}
    batch = {"x": jnp.ones((M, H, 2, 256)), "y": jnp.ones((M, H, 2))}
    options = dict(weighting="norm_softmax", anomaly=True)
    state = dj.init_state(params, M, inner_optimizer=INNER, outer_optimizer=OUTER, anomaly=True)
    round_fn = functools.partial(
        dj.diloco_round, linear_loss, inner_optimizer=INNER, outer_optimizer=OUTER,
        backend=dj.make_backend("shard_map", M), **options,
    )  # fmt: skip
    got = hlo.wire_bytes(jax.jit(round_fn).lower(state, batch).compile())
    want = comm.round_wire_bytes(params, None, M, weighted=True, softmax=True)
    assert got == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(outer_clip=0.0), "outer_clip"),
        (dict(outer_clip=-1.0), "outer_clip"),
        (dict(weighting="norm_softmax", temperature=0.0), "temperature"),
        (dict(weighting="softmax"), "weighting"),
        (dict(anomaly="yes"), "anomaly"),
    ],
)
def test_bad_edit_options(options, match):
    with pytest.raises(ValueError, match=match):
        _one_round(_batch(0), **options)


def test_bad_anomaly_settings():
    for kwargs, match in [
        (dict(threshold=0.0), "threshold"),
        (dict(alpha=1.5), "alpha"),
        (dict(warmup_rounds=-1), "warmup_rounds"),
    ]:
        with pytest.raises(ValueError, match=match):
            faults.AnomalySkip(**kwargs)

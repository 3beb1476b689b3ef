"""NoLoCo (`DiLoCo(gossip=NoLoCo(...))`): each worker averages its delta and its outer weights
with a random group, never all workers. Checked against a NumPy reference written from the
authors' code (Adam inner steps, heavy-ball outer step with the consensus term) on every
backend, its degenerate case (one group of all workers is DiLoCo), its groups, the bytes its
compiled round sends per device (constant in M), and its refusals."""

import math

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from quick import quick
from reference import NpAdamWorkers, linear_loss, make_data, precision

import diloco_jax as dj
from diloco_jax import NoLoCo, hlo
from diloco_jax.noloco import groups

INNER_LR, OUTER_LR, MOMENTUM = 0.05, 0.7, 0.5


def _np_noloco(w0, b0, rounds, group_size, consensus, seed):
    """float64 NoLoCo as `jkolehm/noloco`'s `SparseOptimizerC` runs it: each worker's own
    outer weights φ_m and heavy-ball momentum, Adam inner steps whose state persists, and at
    each sync g_m = mean_G(φ - θ) - consensus (mean_G φ - φ_m); trace = g + α trace,
    φ -= lr trace. Returns each worker's φ [M, 3], [M]."""
    num_workers = rounds[0]["x"].shape[0]
    phi = np.tile(np.append(np.float64(w0), np.float64(b0)), (num_workers, 1))
    trace = np.zeros_like(phi)
    inner = NpAdamWorkers(num_workers, INNER_LR)
    for r, batch in enumerate(rounds):
        theta = inner.run(phi, batch["x"].astype(np.float64), batch["y"].astype(np.float64))
        delta = phi - theta
        grad = np.empty_like(phi)
        for group in groups(seed, r, num_workers, group_size):
            mean_delta, mean_phi = delta[group].mean(axis=0), phi[group].mean(axis=0)
            for m in group:
                grad[m] = mean_delta - consensus * (mean_phi - phi[m])
        trace = grad + MOMENTUM * trace
        phi = phi - OUTER_LR * trace
    return phi[:, :3], phi[:, 3]


def _method(**noloco):
    return dj.DiLoCo(
        inner=optax.adam(INNER_LR),
        outer=optax.sgd(OUTER_LR, momentum=MOMENTUM),
        gossip=NoLoCo(**noloco),
    )


def _params(dtype=np.float32):
    return {"w": np.asarray([0.3, -0.2, 0.1], dtype), "b": dtype(0.5)}


def _train(rounds, method, dtype=np.float32, **options):
    return dj.train_diloco(
        linear_loss, _params(dtype), rounds, num_rounds=len(rounds),
        num_workers=rounds[0]["x"].shape[0], inner_steps=rounds[0]["x"].shape[1],
        method=method, **options,
    )  # fmt: skip


CASES = [(4, 2, 1.0), (8, 2, 0.5), (8, 4, 1.0)]


@pytest.mark.parametrize(("num_workers", "group_size", "consensus"), CASES)
def test_float64_noloco_is_the_numpy_reference(num_workers, group_size, consensus):
    rounds = make_data(np.random.default_rng(1), 4, num_workers, 3)
    rounds = [{k: v.astype(np.float64) for k, v in r.items()} for r in rounds]
    w, b = _np_noloco([0.3, -0.2, 0.1], 0.5, rounds, group_size, consensus, seed=7)
    with precision("float64"):
        got = _train(rounds, _method(group_size=group_size, consensus=consensus, seed=7),
                     np.float64, backend="vmap")  # fmt: skip
        own = got.state.parts["gossip"].theta
        np.testing.assert_allclose(np.asarray(own["w"]), w, rtol=0, atol=1e-12)
        np.testing.assert_allclose(np.asarray(own["b"]), b, rtol=0, atol=1e-12)
        # The run's params: the workers' mean.
        np.testing.assert_allclose(np.asarray(got.params["w"]), w.mean(0), rtol=0, atol=1e-12)
        assert got.state.params is None


@pytest.mark.parametrize(
    "backend",
    quick(["vmap", "sequential", "shard_map", "pmap", "two_a_device"], {"vmap", "shard_map"}),
)
def test_float32_noloco_is_the_numpy_reference_on_every_backend(backend):
    """Eight workers: alone on one device, one per device, or two on each of 4 devices (a
    partner on the same device or another one)."""
    rounds = make_data(np.random.default_rng(2), 3, 8, 3)
    # Seed 1's partners are m ^ 5, m ^ 1, m ^ 3: with two workers a device, a partner on
    # another device in the other slot, the other slot on the same device, and both.
    w, b = _np_noloco([0.3, -0.2, 0.1], 0.5, rounds, 2, 1.0, seed=1)
    if backend == "two_a_device":
        backend = dj.make_backend("shard_map", 8, jax.devices()[:4])
    got = _train(rounds, _method(seed=1), backend=backend)
    own = got.state.parts["gossip"].theta
    np.testing.assert_allclose(np.asarray(own["w"]), w, rtol=0, atol=3e-5)
    np.testing.assert_allclose(np.asarray(own["b"]), b, rtol=0, atol=3e-5)
    # The workers no longer agree (they would under an all-reduce).
    assert np.ptp(np.asarray(own["b"])) > 1e-3


def test_noloco_on_a_user_mesh_keeps_the_params_sharding():
    """Workers over the mesh's "workers" axis, each worker's params split over "fsdp"."""
    mesh = jax.make_mesh((4, 2), ("workers", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rounds = make_data(np.random.default_rng(3), 2, 4, 3, dim=4)
    params = {"w": np.asarray([0.3, -0.2, 0.1, 0.4], np.float32), "b": np.float32(0.5)}
    run = lambda **kw: dj.train_diloco(  # noqa: E731
        linear_loss, params, rounds, num_rounds=2, num_workers=4, inner_steps=3,
        method=_method(seed=5), **kw,
    )  # fmt: skip
    on_mesh = run(mesh=mesh, param_sharding=lambda path, x: P("fsdp") if x.ndim else P())
    on_vmap = run(backend="vmap")
    own = on_mesh.state.parts["gossip"].theta["w"]
    assert own.sharding.spec == P("workers", "fsdp")
    # Each worker's outer state too (the momentum of w), and the result's params.
    assert on_mesh.state.parts["gossip"].outer[0].trace["w"].sharding.spec == P("workers", "fsdp")
    assert on_mesh.params["w"].sharding.spec == P("fsdp")
    np.testing.assert_allclose(
        np.asarray(own), np.asarray(on_vmap.state.parts["gossip"].theta["w"]), atol=3e-6
    )


def test_one_group_of_all_workers_is_diloco_with_the_same_outer_rule():
    rounds = make_data(np.random.default_rng(4), 3, 4, 3)
    rounds = [{k: v.astype(np.float64) for k, v in r.items()} for r in rounds]
    outer = optax.sgd(OUTER_LR, momentum=MOMENTUM)
    with precision("float64"):
        noloco = _train(rounds, _method(group_size=4), np.float64, backend="vmap")
        diloco = _train(rounds, dj.DiLoCo(inner=optax.adam(INNER_LR), outer=outer),
                        np.float64, backend="vmap")  # fmt: skip
        for name in ("w", "b"):
            own = np.asarray(noloco.state.parts["gossip"].theta[name])
            for m in range(4):
                np.testing.assert_allclose(own[m], diloco.params[name], rtol=0, atol=1e-12)
        got = [r["outer_grad_norm"] for r in noloco.history]
        want = [r["outer_grad_norm"] for r in diloco.history]
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(("num_workers", "group_size"), [(8, 2), (8, 4), (16, 4), (4, 4)])
def test_each_sync_splits_the_workers_into_cosets(num_workers, group_size):
    seen = set()
    for sync in range(20):
        g = groups(11, sync, num_workers, group_size)
        assert g.shape == (num_workers // group_size, group_size)
        assert sorted(g.ravel().tolist()) == list(range(num_workers))
        # A coset of a subgroup under XOR: the XOR differences are the same in every group.
        differences = {frozenset(int(a) ^ int(g[i, 0]) for a in g[i]) for i in range(len(g))}
        assert len(differences) == 1
        seen.add(g.tobytes())
    assert len(seen) > 1 or group_size == num_workers
    np.testing.assert_array_equal(groups(11, 3, num_workers, group_size),
                                  groups(11, 3, num_workers, group_size))  # fmt: skip


def test_a_pair_partner_is_uniform_over_the_other_workers():
    """Worker 0's partner over 1,400 syncs at M = 8: each of the 7 others about 200 times
    (binomial sd 13; 5 sd bounds)."""
    counts = np.zeros(8, int)
    for sync in range(1400):
        g = groups(2, sync, 8, 2)
        pair = g[np.any(g == 0, axis=1)][0]
        counts[pair[pair != 0][0]] += 1
    assert counts[0] == 0
    assert np.all(np.abs(counts[1:] - 200) < 5 * math.sqrt(1400 * (1 / 7) * (6 / 7)))


def _round_program(num_workers, num_devices, group_size=2, dim=64):
    backend = dj.make_backend("shard_map", num_workers, jax.devices()[:num_devices])
    params = {"w": np.zeros(dim, np.float32), "b": np.float32(0)}
    method = _method(group_size=group_size)
    state = dj.init_state(params, num_workers, method)
    batch = make_data(np.random.default_rng(0), 1, num_workers, 2, dim=dim)[0]
    step = dj.jit_round(linear_loss, method, backend=backend)
    return step.lower(state, batch).compile().as_text()


@pytest.mark.parametrize("group_size", quick([2, 4], {2}))
def test_the_bytes_each_device_sends_do_not_grow_with_the_workers(group_size):
    """Two workers a device at M = 4, 8 and 16: each stage of the group mean moves the
    device's two workers' Δ and φ (float32) to one other device, whatever M is; the only
    all-reduces are the round's two float32 metrics."""
    per_worker = 2 * (64 + 1) * 4 * int(math.log2(group_size))  # Δ and φ, a stage each
    for num_workers in (4, 8, 16):
        num_devices = num_workers // 2
        text = _round_program(num_workers, num_devices, group_size)
        reduced = [c for c in hlo.collectives(text) if c.op != "collective-permute"]
        assert [(c.op, c.operand_bytes) for c in reduced] == [("all-reduce", 8)]  # the metrics
        metrics = 2 * (num_devices - 1) / num_devices * 8
        assert hlo.wire_bytes(text) == 2 * per_worker + metrics
        entries = _method(group_size=group_size).gossip.transfers(
            [np.zeros(64, np.float32), np.zeros((), np.float32)]
        )
        assert dj.comm.wire_bytes(entries, num_workers) == per_worker


def test_the_history_reports_the_exchange_bytes():
    rounds = make_data(np.random.default_rng(5), 2, 4, 2)
    got = _train(rounds, _method(), backend="vmap")
    # Per worker per round: Δ and φ (4 floats each, float32) to one partner, plus the loss'
    # and the outer grad norm's all-reduce (2 (M-1)/M x 4 bytes each).
    want = 2 * 4 * 4 + 2 * (2 * 3 / 4 * 4)
    assert got.history[-1]["wire_bytes"] == round(2 * want)
    assert got.history[-1]["bytes_communicated"] == 2 * 2 * 4 * 4  # Δ and φ, 2 rounds


def test_a_resumed_noloco_run_is_the_uninterrupted_one(tmp_path):
    rounds = make_data(np.random.default_rng(6), 4, 4, 2)
    whole = _train(rounds, _method(seed=9), backend="vmap")
    _train(rounds[:2], _method(seed=9), backend="vmap", checkpoint_dir=tmp_path,
           checkpoint_every=1)  # fmt: skip
    resumed = _train(rounds, _method(seed=9), backend="vmap", checkpoint_dir=tmp_path,
                     checkpoint_every=1)  # fmt: skip
    for name in ("w", "b"):
        np.testing.assert_array_equal(
            resumed.state.parts["gossip"].theta[name], whole.state.parts["gossip"].theta[name]
        )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(group_size=3), "group_size must be a power of 2 >= 2"),
        (dict(group_size=1), "group_size must be a power of 2 >= 2"),
        (dict(group_size=True), "group_size must be a power of 2 >= 2"),
        (dict(consensus=-0.1), "consensus must be a finite number >= 0"),
        (dict(consensus=float("nan")), "consensus must be a finite number >= 0"),
        (dict(seed=-1), r"seed must be an integer in \[0, 2\*\*32\)"),
        (dict(seed=2**32), r"seed must be an integer in \[0, 2\*\*32\)"),
    ],
)
def test_bad_fields_are_refused(fields, message):
    with pytest.raises(ValueError, match=f"NoLoCo.{message}"):
        NoLoCo(**fields)


@pytest.mark.parametrize(
    ("options", "what"),
    [
        (dict(schedule=dj.Streaming(2)), "schedule"),
        (dict(delay=dj.Eager(1)), "delay"),
        (dict(compression="int8"), "compression"),
        (dict(state_sync=dj.StateSync(mu=2)), "state_sync"),
        (dict(weights=dj.Weights(drop_probability=0.1)), "weights"),
        (dict(weights=dj.Weights(exclude_nonfinite=True)), "weights"),
    ],
)
def test_combinations_it_cannot_run_are_refused(options, what):
    with pytest.raises(ValueError, match=f"NoLoCo \\(gossip=\\) can't be combined with {what}"):
        dj.DiLoCo(gossip=NoLoCo(), **options)


@pytest.mark.parametrize("num_workers", [6, 1, 3])
def test_worker_counts_it_cannot_group_are_refused(num_workers):
    rounds = make_data(np.random.default_rng(7), 1, num_workers, 2)
    with pytest.raises(ValueError, match=f"NoLoCo needs num_workers a power of 2 and >= "
                       f"group_size=2 .*got num_workers={num_workers}"):  # fmt: skip
        _train(rounds, _method(), backend="vmap")


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (dict(outer_state_memory="pinned_host"), "outer_state_memory='pinned_host'"),
        (dict(shard_outer_over_workers=True), "shard_outer_over_workers"),
    ],
)
def test_run_options_it_cannot_run_with_are_refused(option, message):
    rounds = make_data(np.random.default_rng(8), 1, 4, 2)
    with pytest.raises(ValueError, match=f"{message} does not run with NoLoCo"):
        _train(rounds, _method(), backend="shard_map", **option)


def test_the_shorthand_builds_the_part_and_heavy_ball_is_its_default_outer_rule():
    method = dj.method.method_from_options(None, {"gossip_group_size": 4}, caller="t")
    assert method.gossip == NoLoCo(4)
    rounds = make_data(np.random.default_rng(9), 2, 4, 2)
    rounds = [{k: v.astype(np.float64) for k, v in r.items()} for r in rounds]
    with precision("float64"):
        default = dj.train_diloco(linear_loss, _params(np.float64), rounds, num_rounds=2,
                                  num_workers=4, inner_steps=2, inner_optimizer=optax.adam(0.05),
                                  gossip_group_size=2, backend="vmap")  # fmt: skip
        spec = dj.DiLoCo(inner=optax.adam(0.05), outer=optax.sgd(0.7, momentum=0.5),
                         gossip=NoLoCo(2))  # fmt: skip
        explicit = _train(rounds, spec, np.float64, backend="vmap")
        np.testing.assert_array_equal(default.params["w"], explicit.params["w"])


def test_the_lm_config_builds_noloco_with_a_heavy_ball_outer_rule():
    from diloco_jax.lm.config import make_config, method, outer_optimizer

    cfg = make_config(
        "micro", gossip_group_size=2, outer_optimizer="heavy_ball", outer_momentum=0.5
    )
    assert method(cfg).gossip == NoLoCo(2)
    opt = outer_optimizer(cfg)
    state = opt.init(np.zeros(1, np.float32))
    first, state = opt.update(np.ones(1, np.float32), state)
    second, _ = opt.update(np.ones(1, np.float32), state)
    # Heavy ball, lr 0.7 (the default), momentum 0.5: trace 1 then 1 + 0.5; update -lr trace.
    np.testing.assert_allclose([first[0], second[0]], [-0.7, -0.7 * 1.5], rtol=1e-6)

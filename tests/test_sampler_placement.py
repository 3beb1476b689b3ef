"""Where a Sampler's arrays live: `worker_arrays` (leading dim M) only on their worker's
devices, and on a mesh each array split over a worker's own devices by `sharding` /
`worker_sharding`. Runs equal the host-fed run of the same batches (the batches are built in
NumPy, independently of the Sampler), per-device bytes are what the layout says (worked out
by hand), and bad layouts are ValueErrors naming the field."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from quick import quick

import diloco_jax as dj

M, H, R, B = 2, 3, 2, 4
N = 1024  # tokens in each worker's stream
L = 4  # a window: 3 inputs and a target


def linear_loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


PARAMS = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.float32(0.5)}


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _streams(num_workers=M):
    return np.random.default_rng(0).normal(size=(num_workers, N)).astype(np.float32)


def _offsets(r, m, h):
    """Window starts of (round r, worker m, step h), drawn in NumPy from its own seed."""
    return np.random.default_rng([r, m, h]).integers(0, N - L, size=B).astype(np.int32)


def _offset_table(num_rounds, num_workers):
    return np.stack(
        [
            np.stack([np.stack([_offsets(r, m, h) for h in range(H)]) for r in range(num_rounds)])
            for m in range(num_workers)
        ]
    )  # fmt: skip  [M, R, H, B]


def _draw(arrays, r, m, h, mine):
    """B windows of worker m's own stream by elementwise gather (readable where split)."""
    idx_BxL = mine["offsets"][r, h][:, None] + jnp.arange(L)
    win = mine["stream"][idx_BxL]
    return {"x": win[:, :3] * arrays["scale"], "y": win[:, 3]}


def _sampler(num_workers=M, num_rounds=R, **layout):
    worker_arrays = {
        "stream": _streams(num_workers),
        "offsets": _offset_table(num_rounds, num_workers),
    }
    return dj.Sampler({"scale": jnp.float32(0.5)}, _draw, worker_arrays=worker_arrays, **layout)


def _host_rounds(num_rounds=R):
    """The same batches built on the host: leaves [M, H, B, ...] per round."""
    streams, table = _streams(), _offset_table(num_rounds, M)
    out = []
    for r in range(num_rounds):
        win = streams[np.arange(M)[:, None, None, None], table[:, r][..., None] + np.arange(L)]
        out.append({"x": win[..., :3] * np.float32(0.5), "y": win[..., 3]})
    return out


def _assert_same(a, b, exact=True):
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        if exact:
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["vmap", "shard_map", "pmap"])
def test_worker_arrays_equal_host_batches(backend):
    kw = dict(num_rounds=R, num_workers=M, inner_steps=H, backend=backend)
    host = dj.train_diloco(linear_loss, PARAMS, _host_rounds(), **kw)
    graph = dj.train_diloco(linear_loss, PARAMS, _sampler(), **kw)
    _assert_same(graph, host)
    assert graph.history == host.history


def test_train_sync_and_train_async_read_worker_arrays():
    rounds = _host_rounds()
    steps = [{k: v[:, 0] for k, v in r.items()} for r in rounds]
    # train_sync draws (round = step index, step 0): the step-0 batch of each "round".
    host = dj.train_sync(linear_loss, PARAMS, steps, num_steps=R, num_workers=M)
    graph = dj.train_sync(linear_loss, PARAMS, _sampler(), num_steps=R, num_workers=M)
    _assert_same(graph, host)
    common = dict(num_workers=M, inner_steps=H, num_updates=3, step_seconds=[1.0, 1.4])
    host = dj.train_async(linear_loss, PARAMS, _host_rounds(3), **common)
    graph = dj.train_async(linear_loss, PARAMS, _sampler(num_rounds=3), **common)
    _assert_same(graph, host)


@pytest.mark.parametrize(
    "shape, names, spec",
    quick([((2, 4), ("workers", "fsdp"), P("fsdp")),
           ((2, 2, 2), ("workers", "fsdp", "tensor"), P(("fsdp", "tensor")))],
          lambda c: len(c[0]) == 3),
)  # fmt: skip
def test_streams_split_over_a_workers_devices_equal_host_batches(shape, names, spec):
    """Each worker's stream split over its 4 devices (one shard of N / 4 tokens on each),
    train_diloco, train_sync and train_async on the mesh equal the host-fed runs."""
    mesh = _mesh(shape, names)
    sampler = _sampler(worker_sharding={"stream": spec, "offsets": P()})
    kw = dict(num_rounds=R, num_workers=M, inner_steps=H)
    _assert_same(
        dj.train_diloco(linear_loss, PARAMS, sampler, mesh=mesh, **kw),
        dj.train_diloco(linear_loss, PARAMS, _host_rounds(), backend="vmap", **kw),
        exact=False,
    )
    steps = [{k: v[:, 0] for k, v in r.items()} for r in _host_rounds()]
    _assert_same(
        dj.train_sync(linear_loss, PARAMS, sampler, num_steps=R, num_workers=M, mesh=mesh),
        dj.train_sync(linear_loss, PARAMS, steps, num_steps=R, num_workers=M),
        exact=False,
    )
    common = dict(num_workers=M, inner_steps=H, num_updates=2, step_seconds=[1.0, 1.4])
    _assert_same(
        dj.train_async(linear_loss, PARAMS, sampler, mesh=mesh, **common),
        dj.train_async(linear_loss, PARAMS, _host_rounds(), **common),
        exact=False,
    )
    placed = dj.sampler.place_sampler(sampler, dj.make_backend("auto", M, mesh=mesh))
    stream = placed.worker_arrays["stream"]
    assert {s.data.shape for s in stream.addressable_shards} == {(1, N // 4)}
    assert {s.data.shape for s in placed.worker_arrays["offsets"].addressable_shards} == {
        (1, R, H, B)
    }
    for shard in stream.addressable_shards:  # device d of worker m holds its own N/4 tokens
        m, cols = shard.index[0].start, shard.index[1]
        np.testing.assert_array_equal(shard.data[0], _streams()[m, cols])


def test_a_shared_stream_split_inside_each_worker():
    """`sharding` splits `arrays` over a worker's devices (replicated over workers): each of
    the 8 devices holds N / 4 tokens of the one stream every worker reads."""
    stream = _streams(1)[0]

    def draw(arrays, r, m, h):
        offs = jax.random.randint(jax.random.key(0), (B,), 0, N - L)
        win = arrays["stream"][(offs + 7 * m + h)[:, None] + jnp.arange(L)]
        return {"x": win[:, :3], "y": win[:, 3]}

    whole = dj.Sampler({"stream": stream}, draw)
    split = dj.Sampler({"stream": stream}, draw, sharding=P("fsdp"))
    kw = dict(num_rounds=R, num_workers=M, inner_steps=H)
    mesh = _mesh((2, 4), ("workers", "fsdp"))
    _assert_same(
        dj.train_diloco(linear_loss, PARAMS, split, mesh=mesh, **kw),
        dj.train_diloco(linear_loss, PARAMS, whole, backend="vmap", **kw),
        exact=False,
    )
    placed = dj.sampler.place_sampler(split, dj.make_backend("auto", M, mesh=mesh))
    assert {s.data.shape for s in placed.arrays["stream"].addressable_shards} == {(N // 4,)}
    # data_parallel's axis inside a worker is "data"; "fsdp" is not one of its axes
    on_data = dj.Sampler({"stream": stream}, draw, sharding=P("data"))
    _assert_same(
        dj.train_diloco(linear_loss, PARAMS, on_data, data_parallel=4, **kw),
        dj.train_diloco(linear_loss, PARAMS, whole, backend="vmap", **kw),
        exact=False,
    )
    with pytest.raises(ValueError, match=r"Sampler sharding\['stream'\] = .* names 'fsdp'"):
        dj.train_diloco(linear_loss, PARAMS, split, data_parallel=4, **kw)


def _round_argument_bytes(sampler, num_workers):
    """Per-device argument bytes of the compiled round on a (workers, data) mesh of 8."""
    mesh = _mesh((num_workers, 8 // num_workers), ("workers", "data"))
    backend = dj.make_backend("auto", num_workers, mesh=mesh)
    placed = dj.sampler.place_sampler(sampler, backend)
    sgd = optax.sgd(0.1)
    method = dj.DiLoCo(inner=sgd, outer=sgd)
    state = dj.init_state(PARAMS, num_workers, method)
    round_ = jax.jit(
        lambda s, d: dj.diloco_round(
            linear_loss, s, d, method, backend, num_workers=num_workers, inner_steps=H
        )
    )
    return round_.lower(state, placed).compile().memory_analysis().argument_size_in_bytes


def test_per_device_bytes_of_a_sampler_do_not_grow_with_workers():
    """A corpus of 8 N float32 tokens dealt to M workers, each worker's rows split over its
    8 / M devices: every device holds N of them (4 N bytes) for M = 2, 4 and 8. The same
    corpus as one replicated array costs every device all 32 N bytes."""

    def draw(arrays, r, m, h, mine):
        win = mine["stream"][(jnp.arange(B) * 5 + h)[:, None] + jnp.arange(L)]
        return {"x": win[:, :3], "y": win[:, 3]}

    corpus = np.random.default_rng(0).normal(size=8 * N).astype(np.float32)
    dealt, whole = {}, {}
    for num_workers in (2, 4, 8):
        rows = corpus.reshape(num_workers, -1)
        split = dj.Sampler({}, draw, worker_arrays={"stream": rows}, worker_sharding=P("data"))
        dealt[num_workers] = _round_argument_bytes(split, num_workers)
        replicated = dj.Sampler(
            {"rows": rows}, lambda a, r, m, h: draw(a, r, m, h, {"stream": a["rows"][m]})
        )
        whole[num_workers] = _round_argument_bytes(replicated, num_workers)
    assert len(set(dealt.values())) == 1
    for num_workers in (2, 4, 8):
        assert whole[num_workers] - dealt[num_workers] == 32 * N - 4 * N


def _only_stream(spec):
    return {"stream": spec, "offsets": P()}


@pytest.mark.parametrize(
    "layout, backend, match",
    [
        (dict(worker_sharding=_only_stream(P("tensor"))), "mesh",
         r"Sampler worker_sharding\['stream'\] = P\('tensor',\) names 'tensor', not an axis"),
        (dict(worker_sharding=_only_stream(P("workers"))), "mesh", "names the worker axis"),
        (dict(worker_sharding=_only_stream(P(None, "fsdp"))), "mesh",
         r"\['stream'\] = P\(None, 'fsdp'\) has more entries than the leaf's 1 dims"),
        (dict(worker_sharding=_only_stream(P("fsdp"))), "vmap",
         r"Sampler worker_sharding\['stream'\] = P\('fsdp',\) names 'fsdp', not an axis of "
         r"the mesh \('workers',\)"),
        (dict(sharding={"scale": P("fsdp")}), "mesh", r"Sampler sharding\['scale'\] .* more "),
        (dict(worker_sharding=P("fsdp")), "mesh", r"worker_sharding\['offsets'\] = .*: dim 0 "
         "of size 2 is not divisible by 4"),
    ],
)  # fmt: skip
def test_bad_layouts_name_the_field(layout, backend, match):
    kw = dict(num_rounds=R, num_workers=M, inner_steps=H)
    where = dict(mesh=_mesh((2, 4), ("workers", "fsdp"))) if backend == "mesh" else {}
    with pytest.raises(ValueError, match=match):
        dj.train_diloco(linear_loss, PARAMS, _sampler(**layout), **where, **kw)


def test_bad_worker_arrays_and_specs_are_refused():
    kw = dict(num_rounds=R, inner_steps=H)
    with pytest.raises(ValueError, match=r"worker_arrays\['offsets'\] must have leading dim "
                       r"num_workers = 3, got shape \(2, 2, 3, 4\)"):  # fmt: skip
        dj.train_diloco(linear_loss, PARAMS, _sampler(), num_workers=3, **kw)
    with pytest.raises(ValueError, match=r"dim 0 of size 1023 is not divisible by 4"):
        odd = dj.Sampler(
            {},
            _draw,
            worker_arrays={"stream": _streams()[:, :-1], "offsets": _offset_table(R, M)},
            worker_sharding=_only_stream(P("fsdp")),
        )
        dj.train_diloco(
            linear_loss, PARAMS, odd, num_workers=M, mesh=_mesh((2, 4), ("workers", "fsdp")), **kw
        )
    with pytest.raises(ValueError, match="Sampler sharding must be a PartitionSpec"):
        dj.Sampler({}, _draw, sharding={"a": "fsdp"})
    with pytest.raises(ValueError, match="sample must be callable"):
        dj.Sampler({}, None)
    with pytest.raises(ValueError, match="leading dim num_workers = 3"):
        dj.train_async(
            linear_loss, PARAMS, _sampler(), num_workers=3, inner_steps=H, num_updates=1,
            step_seconds=[1.0, 1.0, 1.0],
        )  # fmt: skip
    # M comes from worker_arrays when num_workers is not given to the low-level round
    sgd = optax.sgd(0.1)
    method = dj.DiLoCo(inner=sgd, outer=sgd)
    state = dj.init_state(PARAMS, M, method)
    new, _ = dj.diloco_round(linear_loss, state, _sampler(), method, inner_steps=H)
    assert new.round == 1

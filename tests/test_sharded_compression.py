"""Compression of sharded leaves on a user's mesh: each device encodes and exchanges its own
shards (the codec's blocks per shard), so a sharded compressed run is the unsharded run of
the same model with every shard as a leaf of its own. The model here is elementwise in its
params, so its gradients do not depend on how a leaf is split: the two runs differ only
where the exchange does. The cross-worker collectives the compiler emits carry exactly
`wire_bytes_per_device`."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from quick import quick

import diloco_jax as dj
from diloco_jax import hlo
from diloco_jax import placement as placement_lib

M, H, R = 2, 2, 2
SHAPES = {"w": (16, 64), "b": (64,), "c": (8,)}
MESHES = {  # mesh shape, axis names, param specs: a leaf whole on every device (c) in both
    "fsdp4": ((2, 4), ("workers", "fsdp"), {"w": P(None, "fsdp"), "b": P("fsdp"), "c": P()}),
    "fsdp2xtensor2": (
        (2, 2, 2), ("workers", "fsdp", "tensor"),
        {"w": P("fsdp", "tensor"), "b": P("tensor"), "c": P()},
    ),
}  # fmt: skip


def loss(params, batch):
    wide = (batch["x"] * params["w"] + params["b"] - batch["y"]) ** 2
    return jnp.mean(wide) + jnp.mean((params["c"] - batch["z"]) ** 2)


def _params():
    rng = np.random.default_rng(0)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


def _rounds():
    rng = np.random.default_rng(1)
    return [
        {
            "x": rng.normal(size=(M, H, 16, 64)).astype(np.float32),
            "y": rng.normal(size=(M, H, 16, 64)).astype(np.float32),
            "z": rng.normal(size=(M, H, 16, 8)).astype(np.float32),
        }
        for _ in range(R)
    ]


def _pieces(shape, spec, sizes):
    """Each dim's number of pieces under `spec` on a mesh of axis `sizes`."""
    out = []
    for dim in range(len(shape)):
        entry = spec[dim] if dim < len(spec) else None
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        out.append(int(np.prod([sizes[n] for n in names])))
    return out


def _split(params, specs, sizes):
    """Every shard of every leaf as a leaf of its own: {(name, block index): array}."""
    out = {}
    for name, x in params.items():
        pieces = _pieces(x.shape, specs[name], sizes)
        for index in itertools.product(*(range(n) for n in pieces)):
            cut = tuple(
                slice(i * (s // n), (i + 1) * (s // n))
                for i, s, n in zip(index, x.shape, pieces, strict=True)
            )
            out[f"{name}{index}"] = x[cut]
    return out


def _join(split, specs, sizes):
    """`_split`'s inverse, for arrays or tracers."""
    out = {}
    for name, shape in SHAPES.items():
        pieces = _pieces(shape, specs[name], sizes)
        blocks = np.empty(pieces, dtype=object)
        for index in itertools.product(*(range(n) for n in pieces)):
            blocks[index] = split[f"{name}{index}"]

        out[name] = _concatenated(blocks, len(pieces))
    return out


def _concatenated(blocks, ndim, dim=0):
    """A nested object array of blocks joined along every dim."""
    if dim == ndim - 1:
        return jnp.concatenate(list(blocks), axis=dim)
    return jnp.concatenate([_concatenated(b, ndim, dim + 1) for b in blocks], axis=dim)


CASES = {  # codec (two-stage, error feedback, gather: top-k, SparseLoCo), schedule, delay, weights
    "int8-fsdp2xtensor2": ("fsdp2xtensor2", dict(compression="int8")),
    "int4_ef-fsdp4": ("fsdp4", dict(compression="int4,ef=1", exclude_nonfinite=False)),
    "topk-fsdp2xtensor2": ("fsdp2xtensor2", dict(compression="topk:0.1")),
    "sparseloco-fsdp4": ("fsdp4", dict(compression="sparseloco")),
    "int8_fragments-fsdp4": ("fsdp4", dict(compression="int8", fragments=2)),
    "int8_delayed-fsdp2xtensor2": ("fsdp2xtensor2", dict(compression="int8", outer_delay=1)),
    "int4_ef_softmax-fsdp2xtensor2": (  # weighted: each worker's weight beside its payload
        "fsdp2xtensor2",
        dict(compression="int4,ef=1", weighting="norm_softmax", temperature=2.0),
    ),
    "int8_drops-fsdp4": ("fsdp4", dict(compression="int8", drop_probability=0.5, drop_seed=1)),
    "int8_eager-fsdp4": (
        "fsdp4",
        dict(compression="int8", outer_delay=1, eager=True, exclude_nonfinite=False),
    ),
}


@pytest.mark.parametrize(
    "case", quick(CASES, {"int4_ef-fsdp4", "topk-fsdp2xtensor2", "int8_fragments-fsdp4"})
)
def test_a_sharded_compressed_run_is_the_run_of_its_shards_as_leaves(case):
    mesh_name, options = CASES[case]
    shape, names, specs = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    sizes = dict(zip(names, shape, strict=True))
    if "fragments" in options:  # the split run's leaves in the fragments of their own leaf
        split_names = sorted(_split(_params(), specs, sizes))
        fragments_of = lambda n: {"b": 0, "c": 1, "w": 0}[n[0]]  # noqa: E731
        split_fragments = {n: fragments_of(n) for n in split_names}
        options_split = options | dict(fragments=split_fragments)
        options = options | dict(fragments={"b": 0, "c": 1, "w": 0})
    else:
        options_split = options
    common = dict(
        num_rounds=R, num_workers=M, inner_steps=H, inner_optimizer=optax.sgd(0.1),
    )  # fmt: skip
    got = dj.train_diloco(
        loss, _params(), _rounds(), mesh=mesh, param_sharding=specs, **common, **options
    )
    ref = dj.train_diloco(
        lambda q, b: loss(_join(q, specs, sizes), b),
        _split(_params(), specs, sizes),
        _rounds(),
        **common,
        **options_split,
    )
    want = _join(ref.params, specs, sizes)
    for name in SHAPES:
        # The gather exchanges' decoded means round a last bit differently in the two
        # programs (XLA fuses them apart).
        np.testing.assert_allclose(got.params[name], want[name], rtol=1e-6, atol=1e-7)
        assert got.params[name].sharding.spec == specs[name]
    for a, b in zip(got.history, ref.history, strict=True):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-6)
    # A worker's devices send its shards; the worker's figure is the unsharded exchange's
    # (checked here without fault options: those add the weights' bytes).
    faults = "weighting" in options or "drop_probability" in options
    assert faults or got.history[-1]["wire_bytes"] == dj.comm.round_wire_bytes(
        _params(), options["compression"], M, fragments=options.get("fragments")
    ) * R  # fmt: skip
    if "ef=1" in options["compression"]:
        assert got.state.parts["compression"].residual["w"].sharding.spec == P(
            "workers", *specs["w"]
        )


@pytest.mark.parametrize(
    "mesh_name, compression",
    quick(
        [("fsdp2xtensor2", "int8"), ("fsdp4", "topk:0.1"), ("fsdp4", "int4,ef=1")],
        {("fsdp4", "int4,ef=1")},
    ),
)
def test_per_device_wire_bytes_are_the_compiled_cross_worker_collectives(mesh_name, compression):
    shape, names, specs = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    params, batch = _params(), _rounds()[0]
    result = dj.train_diloco(
        loss, params, [batch], num_rounds=1, num_workers=M, inner_steps=H, mesh=mesh,
        param_sharding=specs, compression=compression,
    )  # fmt: skip
    per_device = result.history[0]["wire_bytes_per_device"]
    backend = dj.make_backend("auto", M, mesh=mesh)
    resolved = placement_lib.resolve_param_specs(params, backend.mesh, specs)
    placed = placement_lib.placement(params, backend.mesh, resolved, [(0, 1, 2)])
    state = dj.init_state(params, M, compression=compression)
    state = jax.device_put(state, placed.shardings(state))
    round_fn = functools.partial(
        dj.diloco_round, loss, backend=backend, compression=compression, param_specs=resolved
    )
    compiled = jax.jit(round_fn).lower(state, backend.place_batches(batch, 2)).compile()
    assert hlo.cross_worker_wire_bytes(compiled, M, 8) == per_device
    # By hand for int8 on fsdp2xtensor2: a device holds w [8, 32] (8 blocks of 32 codes + a
    # float32 scale: 36 bytes), b [32] (1 block) and c [8] (1 block, padded), in two
    # exchanges (the split leaves, then c): 9 blocks padded to 10 rows, then 1 padded to 2;
    # each sends (M - 1) / M of its rows in the all-to-all and all-gathers 1/M of them; and
    # the loss all-reduce, 4 bytes.
    if (mesh_name, compression) == ("fsdp2xtensor2", "int8"):
        assert per_device == (10 * 36 / 2 + 5 * 36) + (2 * 36 / 2 + 36) + 4


@pytest.mark.parametrize(
    "param_specs, match",
    [
        ((P(), P()), "one PartitionSpec per param leaf \\(3\\)"),
        ([P(), "fsdp", P()], "must hold PartitionSpecs, got 'fsdp'"),
        ({"w": P()}, "must be a tuple of one PartitionSpec per param leaf"),
    ],
)
def test_bad_param_specs_name_the_argument(param_specs, match):
    backend = dj.make_backend("auto", M, mesh=jax.make_mesh((M, 4), ("workers", "fsdp")))
    state = dj.init_state(_params(), M, compression="int8")
    with pytest.raises(ValueError, match=match):
        dj.diloco_round(
            loss, state, _rounds()[0], backend=backend, compression="int8",
            param_specs=param_specs,
        )  # fmt: skip


def test_cross_worker_bytes_need_whole_workers():
    with pytest.raises(ValueError, match="num_devices \\(8\\) must be a multiple"):
        hlo.cross_worker_wire_bytes("", 3, 8)

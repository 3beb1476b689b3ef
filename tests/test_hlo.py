"""Collectives read from optimized HLO, on 8 fake CPU devices (see conftest.py).

Expected byte counts are arithmetic on shapes (elements * itemsize), never the parser's output.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_jax import hlo

N = 8  # devices
ALL = (tuple(range(N)),)  # replica_groups of a collective over every device


def _mesh(shape=(N,), names=("d",)):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _shard_map(f, in_specs, out_specs, mesh=None):
    mesh = _mesh() if mesh is None else mesh
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def _compiled(f, *args):
    return f.lower(*args).compile()


def _as_sets(groups):
    return {frozenset(g) for g in groups}


def test_psum_f32_is_one_all_reduce_of_4000_bytes():
    f = _shard_map(lambda a: jax.lax.psum(a, "d"), P("d"), P("d"))
    compiled = _compiled(f, jnp.ones((N * 1000,), jnp.float32))
    (c,) = hlo.collectives(compiled)
    assert c.op == "all-reduce"
    assert c.operand_dtypes == ("f32",)
    assert c.operand_shapes == ((1000,),)
    assert c.operand_bytes == c.result_bytes == 1000 * 4
    assert c.replica_groups == ALL
    assert not c.in_loop
    assert hlo.communication_bytes(compiled) == 1000 * 4
    assert hlo.communication_bytes(compiled, ops="all-gather") == 0


def test_accepts_lowered_compiled_and_text():
    f = _shard_map(lambda a: jax.lax.psum(a, "d"), P("d"), P("d"))
    lowered = f.lower(jnp.ones((N * 10,), jnp.float32))
    compiled = lowered.compile()
    expected = hlo.collectives(compiled)
    assert hlo.collectives(lowered) == expected
    assert hlo.collectives(compiled.as_text()) == expected
    with pytest.raises(TypeError):
        hlo.collectives(42)
    with pytest.raises(ValueError):
        hlo.communication_bytes(compiled, ops=["all-reduce", "psum"])


def test_pmap_psum():
    f = jax.pmap(lambda a: jax.lax.psum(a, "i"), axis_name="i")
    (c,) = hlo.collectives(_compiled(f, jnp.ones((N, 1000), jnp.float32)))
    assert (c.op, c.operand_bytes, c.replica_groups) == ("all-reduce", 1000 * 4, ALL)


def test_pmean_of_pytree_counts_every_leaf_once():
    # XLA CPU combines the two leaves into one tuple-shaped all-reduce
    # `(f32[1000], f32[30,4]) all-reduce(%a, %b)`; the total must match either way.
    f = _shard_map(
        lambda t: jax.lax.pmean(t, "d"), ({"w": P("d"), "b": P("d")},), {"w": P("d"), "b": P("d")}
    )
    tree = {"w": jnp.ones((N * 1000,), jnp.float32), "b": jnp.ones((N * 30, 4), jnp.float32)}
    cs = hlo.collectives(_compiled(f, tree))
    assert {c.op for c in cs} == {"all-reduce"}
    leaf_bytes = 1000 * 4 + 30 * 4 * 4
    assert sum(c.operand_bytes for c in cs) == leaf_bytes
    assert sum(c.result_bytes for c in cs) == leaf_bytes
    assert sorted(s for c in cs for s in c.operand_shapes) == [(30, 4), (1000,)]


@pytest.mark.parametrize(
    "dtype, hlo_dtype, itemsize",
    [(jnp.int8, "s8", 1), (jnp.uint8, "u8", 1), (jnp.int32, "s32", 4)],
)
def test_integer_all_gather_keeps_dtype(dtype, hlo_dtype, itemsize):
    f = _shard_map(lambda a: jax.lax.all_gather(a, "d"), P("d"), P("d"))
    (c,) = hlo.collectives(_compiled(f, jnp.ones((N * 256,), dtype)))
    assert c.op == "all-gather"
    assert c.operand_dtypes == (hlo_dtype,)
    assert c.operand_bytes == 256 * itemsize  # the local shard, not the gathered result
    assert c.result_bytes == N * 256 * itemsize


def test_collective_in_scan_body_is_counted_once_and_flagged():
    def f(a):
        def body(carry, _):
            return carry + 0.5 * jax.lax.psum(carry, "d"), None

        return jax.lax.scan(body, a, None, length=3)[0]

    compiled = _compiled(_shard_map(f, P("d"), P("d")), jnp.ones((N * 1000,), jnp.float32))
    (c,) = hlo.collectives(compiled)
    assert c.op == "all-reduce" and c.in_loop
    # Static count: once, not 3 times (the trip count).
    assert hlo.communication_bytes(compiled) == 1000 * 4


# What XLA CPU (jax 0.10.2) actually communicates for low-precision floats: it widens them
# before the collective. bf16 -> f32 for psum *and* for all_gather / ppermute (which do no
# arithmetic); f8e4m3fn -> f16. So on CPU a bf16 psum of 1000 elements moves 4000 bytes, not
# 2000. GPU/TPU backends may keep bf16; byte counts measured on CPU describe the CPU program.
@pytest.mark.parametrize(
    "collective, dtype, wire_dtype, nbytes",
    [
        ("psum", jnp.bfloat16, "f32", 1000 * 4),
        ("psum", jnp.float8_e4m3fn, "f16", 1000 * 2),
        ("psum", jnp.float16, "f16", 1000 * 2),  # f16 is kept
        ("all_gather", jnp.bfloat16, "f32", 1000 * 4),
    ],
)
def test_low_precision_collectives_are_widened_on_cpu(collective, dtype, wire_dtype, nbytes):
    fn = {"psum": jax.lax.psum, "all_gather": jax.lax.all_gather}[collective]
    f = _shard_map(lambda a: fn(a, "d"), P("d"), P("d"))
    (c,) = hlo.collectives(_compiled(f, jnp.ones((N * 1000,), dtype)))
    assert c.operand_dtypes == (wire_dtype,)
    assert c.operand_bytes == nbytes


def test_reduce_scatter_permute_all_to_all():
    def f(a):
        rs = jax.lax.psum_scatter(a, "d", tiled=True)  # f32[1000] -> f32[125]
        pp = jax.lax.ppermute(a, "d", [(i, (i + 1) % N) for i in range(N)])
        a2a = jax.lax.all_to_all(a.reshape(N, -1), "d", 0, 0)
        return rs, pp, a2a

    compiled = _compiled(
        _shard_map(f, P("d"), (P("d"), P("d"), P("d"))), jnp.ones((N * 1000,), jnp.float32)
    )
    by_op = {}
    for c in hlo.collectives(compiled):
        by_op.setdefault(c.op, []).append(c)
    assert set(by_op) == {"reduce-scatter", "collective-permute", "all-to-all"}
    (rs,) = by_op["reduce-scatter"]
    assert (rs.operand_bytes, rs.result_bytes) == (1000 * 4, 125 * 4)
    (pp,) = by_op["collective-permute"]
    assert pp.operand_bytes == 1000 * 4
    assert pp.replica_groups == tuple((i, (i + 1) % N) for i in range(N))  # source_target_pairs
    # XLA may split the all-to-all into N f32[1,125] operands; the total is the local buffer.
    assert sum(c.operand_bytes for c in by_op["all-to-all"]) == 1000 * 4
    assert hlo.communication_bytes(compiled, ops=("reduce-scatter", "all-to-all")) == 2 * 4000


def test_no_collectives():
    compiled = _compiled(jax.jit(lambda a: a * 2), jnp.ones((N * 1000,), jnp.float32))
    assert hlo.collectives(compiled) == []
    assert hlo.communication_bytes(compiled) == 0


def test_gspmd_replica_groups_on_2d_mesh():
    # Plain jit + shardings: XLA prints mesh-axes replica groups, e.g.
    # replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}.
    mesh = _mesh((2, 4), ("a", "b"))
    ids = np.arange(N).reshape(2, 4)  # logical device ids laid out as the mesh
    x = jnp.ones((40, 80), jnp.float32)
    sharding = NamedSharding(mesh, P("b", "a"))  # dim 0 over b (4), dim 1 over a (2)

    (c,) = hlo.collectives(_compiled(jax.jit(lambda a: a.sum(0), in_shardings=sharding), x))
    assert c.operand_bytes == (80 // 2) * 4  # local partial column sums, f32[40]
    assert _as_sets(c.replica_groups) == _as_sets(ids)  # devices that differ only in b

    (c,) = hlo.collectives(_compiled(jax.jit(lambda a: a.sum(1), in_shardings=sharding), x))
    assert c.operand_bytes == (40 // 4) * 4
    assert _as_sets(c.replica_groups) == _as_sets(ids.T)  # devices that differ only in a


def test_shard_map_psum_over_one_axis_of_2d_mesh():
    mesh = _mesh((2, 4), ("a", "b"))
    f = _shard_map(lambda v: jax.lax.psum(v, "b"), P(("a", "b")), P("a"), mesh=mesh)
    (c,) = hlo.collectives(_compiled(f, jnp.ones((N * 100,), jnp.float32)))
    assert c.operand_bytes == 100 * 4
    assert c.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))


# Hand-written HLO in the printed style of jax 0.10.2: operands by name only (one given inline
# with its type, as older XLA printed them), a combined tuple all-reduce, async start/done pairs
# (which XLA CPU never emits), iota replica groups, a while loop whose body calls a computation.
HANDWRITTEN = """\
HloModule handwritten, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%inner (ip: f32[16]) -> f32[16] {
  %ip = f32[16]{0} parameter(0)
  ROOT %ar.inner = f32[16]{0} all-reduce(%ip), channel_id=4, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
}

%body (bp: (s32[], f32[16])) -> (s32[], f32[16]) {
  %bp = (s32[], f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%bp), index=0
  %v = f32[16]{0} get-tuple-element(%bp), index=1
  %ags = (f32[16]{0}, f32[128]{0}) all-gather-start(%v), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}
  %agd = f32[128]{0} all-gather-done(%ags)
  %sl = f32[16]{0} slice(%agd), slice={[0:16]}
  %c = f32[16]{0} call(%sl), to_apply=%inner
  ROOT %t = (s32[], f32[16]{0}) tuple(%i, %c)
}

%cond (cp: (s32[], f32[16])) -> pred[] {
  %cp = (s32[], f32[16]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  %lim = s32[] constant(5)
  ROOT %lt = pred[] compare(%ci, %lim), direction=LT
}

ENTRY %main (p0: f32[10], p1: bf16[3,4], p2: s4[6], p3: f32[16]) -> f32[16] {
  %p0 = f32[10]{0} parameter(0)
  %p1 = bf16[3,4]{1,0} parameter(1)
  %p2 = s4[6]{0} parameter(2)
  %p3 = f32[16]{0} parameter(3)
  %ar = (f32[10]{0}, bf16[3,4]{1,0}, s4[6]{0}) all-reduce(f32[10]{0} %p0, %p1, %p2), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %cps = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(%p3), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[16]{0} collective-permute-done(%cps)
  %rss = ((f32[16]{0}), f32[2]{0}) reduce-scatter-start(%cpd), channel_id=5, replica_groups={}, dimensions={0}, to_apply=%add
  %rsu = ((f32[16]{0}), f32[2]{0}) reduce-scatter-update(%rss)
  %rsd = f32[2]{0} reduce-scatter-done(%rsu)
  %a2a = (f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, /*index=5*/f32[2]{0}) all-to-all(%rsd, %rsd, %rsd, %rsd, %rsd, /*index=5*/%rsd), channel_id=6, replica_groups=mesh['x'=2,'y'=4], device_ids=([2,2,2]T(1,0,2)) {'y':(2)2}
  %zero = s32[] constant(0)
  %init = (s32[], f32[16]{0}) tuple(%zero, %p3)
  %w = (s32[], f32[16]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[16]{0} get-tuple-element(%w), index=1
}
"""  # noqa: E501 (instructions kept on one line, as XLA prints them)


def test_handwritten_hlo():
    cs = {c.name: c for c in hlo.collectives(HANDWRITTEN)}
    assert set(cs) == {"ar", "cps", "rss", "a2a", "ags", "ar.inner"}  # no "-done"/"-update"

    ar = cs["ar"]  # combined: f32[10] + bf16[3,4] + packed s4[6]
    assert ar.op == "all-reduce"
    assert ar.operand_dtypes == ("f32", "bf16", "s4")
    assert ar.operand_shapes == ((10,), (3, 4), (6,))
    assert ar.operand_bytes == ar.result_bytes == 10 * 4 + 12 * 2 + 6 // 2
    assert ar.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert (ar.computation, ar.in_loop) == ("main", False)

    cps = cs["cps"]  # result from the -done, not the start's (in, out, ctx, ctx) tuple
    assert (cps.op, cps.operand_bytes, cps.result_bytes) == ("collective-permute", 64, 64)
    assert cps.replica_groups == ((0, 1), (1, 0))

    rss = cs["rss"]  # start -> update -> done
    assert (rss.op, rss.operand_bytes, rss.result_bytes) == ("reduce-scatter", 16 * 4, 2 * 4)
    assert rss.replica_groups == ()

    a2a = cs["a2a"]
    assert (a2a.op, a2a.operand_bytes, a2a.result_bytes) == ("all-to-all", 6 * 8, 6 * 8)
    # mesh x=2, y=4 over devices arange(8).reshape(2,2,2).transpose(1,0,2).reshape(2,4)
    # = [[0,1,4,5],[2,3,6,7]]; groups vary along the minor half of y.
    assert a2a.replica_groups == ((0, 1), (4, 5), (2, 3), (6, 7))

    ags = cs["ags"]
    assert (ags.op, ags.operand_bytes, ags.result_bytes) == ("all-gather", 16 * 4, 128 * 4)
    assert ags.replica_groups == ALL
    assert (ags.computation, ags.in_loop) == ("body", True)

    inner = cs["ar.inner"]  # called from the loop body: also in the loop
    assert inner.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert (inner.computation, inner.in_loop) == ("inner", True)

    total = 67 + 64 + 64 + 48 + 64 + 64
    assert hlo.communication_bytes(HANDWRITTEN) == total
    assert hlo.communication_bytes(HANDWRITTEN, ops="all-reduce") == 67 + 64


def test_handwritten_hlo_test_style():
    # XLA unit-test style: no "%", indented, an instruction continued on the next line.
    text = """
    HloModule m, is_scheduled=true

    reduce_add {
      x = f32[] parameter(0)
      y = f32[] parameter(1)
      ROOT _ = f32[] add(x, y)
    }

    ENTRY main {
      p0 = f32[4] parameter(0)
      p1 = bf16[2,8] parameter(1)
      ars = (f32[4], bf16[2,8]) all-reduce-start(p0, p1),
          replica_groups={{0,1}}, to_apply=reduce_add
      ard = (f32[4], bf16[2,8]) all-reduce-done(ars)
      cb = f32[4] collective-broadcast(p0), replica_groups={{0,1}}
      ROOT t = ((f32[4], bf16[2,8]), f32[4]) tuple(ard, cb)
    }
    """
    ars, cb = hlo.collectives(text)
    assert (ars.op, ars.name, ars.operand_bytes, ars.result_bytes) == (
        "all-reduce",
        "ars",
        4 * 4 + 16 * 2,
        4 * 4 + 16 * 2,
    )
    assert ars.replica_groups == ((0, 1),)
    assert (cb.op, cb.operand_bytes) == ("collective-broadcast", 4 * 4)

"""Communication read from the compiled program.

`collectives` lists every collective in a jitted function's *optimized* HLO (what
``jax.jit(f).lower(*args).compile().as_text()`` prints), with the bytes each device contributes,
so a test can prove e.g. that one DiLoCo round all-reduces exactly ``|theta| * itemsize`` bytes.

Counting rules:

* ``operand_bytes`` is the size of the op's operands on one device: the full buffer for
  all-reduce / reduce-scatter / all-to-all / collective-permute, the local shard for all-gather,
  the sum over all operands for variadic ("combined") ops. It is the payload, not wire traffic
  (a ring all-reduce moves ``2 * (n - 1) / n`` times that per device).
* Async pairs (``all-reduce-start``/``-done``, ``all-gather-start``/``-done``, ...) count once,
  at the start; ``result_bytes`` then comes from the matching done. Generic ``async-start``
  wrappers are not counted themselves: the collective inside the wrapped computation is.
* Every computation is scanned (entry, while bodies, called computations, fusions), and each
  instruction counts once per *static* occurrence: a collective in a ``lax.scan`` body of length
  100 counts once, not 100 times. ``Collective.in_loop`` tells that it sits (transitively) in a
  while body or condition, so callers can multiply by their own trip count.
* A ``conditional``'s branches (``lax.cond``/``lax.switch``) are alternatives: one runs.
  ``Collective.branch`` names the outermost conditional and branch a collective sits in, and
  `wire_bytes` counts, for each conditional, its costliest branch.
* Dtypes are what XLA actually communicates. On CPU, XLA widens some collectives before they
  run (jax 0.10.2: bf16 -> f32 for all-reduce, all-gather, reduce-scatter and
  collective-permute; f8 -> f16; u4/s4 -> 8 bits), so byte counts taken on CPU describe the CPU
  program, not necessarily a GPU/TPU one.
* Not covered: send/recv, ragged-all-to-all, and collectives hidden in custom calls.
"""

import math
import re
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import numpy as np

from diloco_jax.comm import ring_wire_bytes  # noqa: F401 (the ring formula, for its callers here)

COLLECTIVE_OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "collective-broadcast",
)

# Bits per element. Sub-byte types are packed, so an s4[3] array takes ceil(12 / 8) = 2 bytes.
_DTYPE_BITS = {
    "pred": 8,
    "s1": 1,
    "u1": 1,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
}


class Collective(NamedTuple):
    """One collective instruction of an optimized HLO module."""

    op: str  # normalized opcode, one of COLLECTIVE_OPS ("-start" stripped)
    name: str  # instruction name, without the leading "%"
    operand_dtypes: tuple[str, ...]  # HLO dtype names, e.g. ("f32", "bf16")
    operand_shapes: tuple[tuple[int, ...], ...]
    operand_bytes: int  # per device: sum of the operands' sizes
    result_bytes: int  # per device: size of the result (of the matching "-done" if async)
    # Parsed replica_groups, whichever form XLA printed ({{0,1},{2,3}}, iota [2,2]<=[4], or
    # mesh axes mesh['x'=2,'y'=2] {'y'}); for collective-permute, the source_target_pairs.
    # () when absent or empty (all devices). With use_global_device_ids=true (jit, shard_map,
    # pmap in jax 0.10) the ids are logical: positions in the program's device assignment.
    replica_groups: tuple[tuple[int, ...], ...]
    computation: str  # name of the computation the instruction sits in
    in_loop: bool  # its computation is (transitively) called from a while body or condition
    # (conditional instruction, branch index) of the outermost conditional branch it sits in
    # (transitively); None outside every conditional.
    branch: tuple[str, int] | None = None


def collectives(compiled_or_text: Any) -> list[Collective]:
    """Every collective of an optimized HLO module, in textual order.

    Args:
      compiled_or_text: a `jax.stages.Compiled`, a `jax.stages.Lowered` (compiled here), or
        the optimized HLO text itself.
    """
    text = _hlo_text(compiled_or_text)
    out: list[Collective] = []
    for module in _split_modules(text):
        out.extend(_module_collectives(module))
    return out


def communication_bytes(compiled_or_text: Any, ops: str | Iterable[str] | None = None) -> int:
    """Sum of `Collective.operand_bytes` over the module, optionally only for `ops`."""
    if isinstance(ops, str):
        ops = (ops,)
    wanted = None if ops is None else set(ops)
    if wanted is not None and not wanted <= set(COLLECTIVE_OPS):
        raise ValueError(f"unknown ops {sorted(wanted - set(COLLECTIVE_OPS))}")
    return sum(
        c.operand_bytes for c in collectives(compiled_or_text) if wanted is None or c.op in wanted
    )


def cross_worker_wire_bytes(compiled_or_text: Any, num_workers: int, num_devices: int) -> float:
    """`wire_bytes` of the collectives outside loops whose groups pair devices of different
    workers, on a mesh of `num_devices` with the worker axis first (device i is worker
    i // (num_devices / num_workers)): what a device sends to the other workers in a round,
    the figure `train_diloco`'s "wire_bytes_per_device" stands for. The collectives inside a
    worker (fsdp gathers, tensor-parallel reductions) are left out."""
    if num_workers < 1 or num_devices % num_workers:
        raise ValueError(
            f"num_devices ({num_devices}) must be a multiple of num_workers ({num_workers})"
        )
    per_worker = num_devices // num_workers
    total = 0.0
    for c in collectives(compiled_or_text):
        groups = c.replica_groups
        if c.in_loop or not groups or len({d // per_worker for d in groups[0]}) < 2:
            continue
        total += ring_wire_bytes(c.op, c.operand_bytes, len(groups[0]))
    return total


def wire_bytes(compiled_or_text: Any, num_devices: int | None = None) -> float:
    """Bytes each device sends on the wire for the module's collectives (outside loops),
    under ring algorithms over each collective's group of n devices: all-reduce 2(n-1)/n x
    its operand, all-gather (n-1) x its (local) operand, all-to-all and reduce-scatter
    (n-1)/n x their operand, collective-permute its operand. A collective printed with no
    replica groups spans `num_devices` (required then). Of a conditional's branches only the
    costliest counts (one runs). In-loop collectives raise: their trip count is the caller's
    to know."""
    return one_path_total(
        collectives(compiled_or_text),
        lambda c: ring_wire_bytes(c.op, c.operand_bytes, participants(c, num_devices)),
    )


def participants(c: Collective, num_devices: int | None) -> int:
    """How many devices take part in `c` as the ring formula counts them: its group's size
    (2 for a collective-permute, a send to one peer), or `num_devices` for a collective
    printed without groups (ValueError when that is None)."""
    if c.op == "collective-permute":
        return 2
    n = len(c.replica_groups[0]) if c.replica_groups else num_devices
    if n is None:
        raise ValueError(f"collective {c.name} spans all devices: pass num_devices")
    return n


def one_path_total(found: Iterable[Collective], cost) -> float:
    """The sum of `cost(c)` over the collectives one run of the program executes: every one
    outside conditionals, and of each conditional the costliest branch (one runs). In-loop
    collectives raise ValueError: their trip count is the caller's to know."""
    total, branches = 0.0, {}
    for c in found:
        if c.in_loop:
            raise ValueError(f"collective {c.name} sits in a loop: multiply it yourself")
        if c.branch is None:
            total += cost(c)
        else:
            per_branch = branches.setdefault(c.branch[0], {})
            per_branch[c.branch[1]] = per_branch.get(c.branch[1], 0.0) + cost(c)
    return total + sum(max(costs.values()) for costs in branches.values())


def depends_on(compiled_or_text: Any, name: str, opcode: str) -> bool:
    """Whether instruction `name` (e.g. a collective from `collectives`) reads, through its
    operands' dataflow in its own computation, the result of an instruction of `opcode`
    (e.g. "while": the inner loop). An instruction that calls a computation holding one (XLA
    0.12's CPU compiler outlines a while loop into a `call`) counts as one. False means the
    two may run at the same time."""
    text = _hlo_text(compiled_or_text)
    for module in _split_modules(text):
        instrs = _parse_module(module)
        found = [ins for ins in instrs if ins.name == name]
        if not found:
            continue
        holding = _computations_holding(instrs, opcode)
        computation = found[0].computation
        local = {ins.name: ins for ins in instrs if ins.computation == computation}
        seen, stack = set(), [found[0].name]
        while stack:
            ins = local.get(stack.pop())
            if ins is None or ins.name in seen:
                continue
            seen.add(ins.name)
            if ins.name != name and (ins.opcode == opcode or _called(ins) & holding):
                return True
            stack.extend(op for op, _ in ins.operands)
        return False
    raise ValueError(f"no instruction named {name!r} in the module")


def _called(ins: "_Instr") -> set[str]:
    """Names of the computations `ins` calls (loop bodies, fusions, to_apply, branches)."""
    names: set[str] = set()
    for m in _CALLEES.finditer(ins.attrs):
        names.update(n.strip().lstrip("%") for n in m.group(1).strip("{}").split(","))
    return names - {""}


def _computations_holding(instrs: list["_Instr"], opcode: str) -> set[str]:
    """Computations that hold an instruction of `opcode`, directly or through their calls."""
    holding = {ins.computation for ins in instrs if ins.opcode == opcode}
    callers = [(ins.computation, _called(ins)) for ins in instrs]
    grew = True
    while grew:
        grew = False
        for computation, called in callers:
            if computation not in holding and called & holding:
                holding.add(computation)
                grew = True
    return holding


# --------------------------------------------------------------------------- text access


def _hlo_text(x: Any) -> str:
    if isinstance(x, str):
        return x
    if isinstance(x, jax.stages.Lowered):  # its as_text() is StableHLO: compile first
        x = x.compile()
    if isinstance(x, jax.stages.Compiled):
        text = x.as_text()
        if not text:
            raise ValueError("compiled object has no HLO text")
        return text
    raise TypeError(f"expected jax.stages.Compiled, jax.stages.Lowered or str, got {type(x)}")


def _split_modules(text: str) -> list[str]:
    parts = re.split(r"^(?=HloModule\b)", text, flags=re.MULTILINE)
    return [p for p in parts if p.strip()]


# --------------------------------------------------------------------------- parsing


class _Instr(NamedTuple):
    name: str
    type_text: str
    opcode: str
    operands: tuple[tuple[str, str], ...]  # (name, inline type text or "")
    attrs: str
    computation: str


_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\b.*\{\s*$")
_INSTR_START = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?=\(|[a-z][a-z0-9]*\[)")
_COMMENT = re.compile(r"/\*.*?\*/")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_IOTA_GROUPS = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(
    r"mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\((?:\[([\d,]+)\](?:T\(([\d,]+)\))?|([\d,\s]+))\))?"
    r"\s*\{([^}]*)\}"
)
_CALLEES = re.compile(
    r"\b(?:body|condition|calls|to_apply|branch_computations|true_computation|"
    r"false_computation|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)


def _matching(s: str, i: int) -> int:
    """Index just past the bracket group opening at s[i]."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = []
    for j in range(i, len(s)):
        ch = s[j]
        if ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return j + 1
    raise ValueError(f"unbalanced brackets in HLO: {s[i : i + 80]!r}")


def _split_top(s: str) -> list[str]:
    """Split on commas outside any brackets."""
    parts, depth, start = [], 0, 0
    for j, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(s[start:j])
            start = j + 1
    parts.append(s[start:])
    return [p.strip() for p in parts if p.strip()]


def _parse_instr(line: str, computation: str) -> _Instr | None:
    m = _INSTR_START.match(line)
    if m is None:
        return None
    i = m.end()
    end = _matching(line, i) if line[i] == "(" else i + len(line[i:].split(None, 1)[0])
    type_text = line[i:end]
    m_op = _OPCODE.match(line, end)
    if m_op is None:
        return None
    opcode = m_op.group(1)
    open_paren = m_op.end() - 1
    close = _matching(line, open_paren)
    operands = []
    for piece in _split_top(_COMMENT.sub("", line[open_paren + 1 : close - 1])):
        toks = piece.rsplit(None, 1)
        op_name = toks[-1].lstrip("%")
        operands.append((op_name, toks[0] if len(toks) == 2 else ""))
    return _Instr(
        name=m.group(1),
        type_text=type_text,
        opcode=opcode,
        operands=tuple(operands),
        attrs=line[close:],
        computation=computation,
    )


def _parse_module(text: str) -> list[_Instr]:
    """All instructions of one module; continuation lines are joined to their instruction."""
    instrs: list[_Instr] = []
    computation: str | None = None
    pending: list[str] = []

    def flush() -> None:
        if pending and computation is not None:
            ins = _parse_instr(" ".join(pending), computation)
            if ins is not None:
                instrs.append(ins)
        pending.clear()

    for raw in text.splitlines():
        line = raw.strip()
        if computation is None:
            m = _HEADER.match(line)
            if m and not line.startswith("HloModule") and "=" not in line.split()[0]:
                computation = m.group(1)
        elif line.startswith("}"):
            flush()
            computation = None
        elif _INSTR_START.match(line):
            flush()
            pending.append(line)
        elif pending and line:
            pending.append(line)
    flush()
    return instrs


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a (possibly tuple) HLO type, layouts ignored."""
    out = []
    for m in _ARRAY.finditer(_COMMENT.sub("", type_text)):
        dims = []
        for d in m.group(2).split(","):
            d = d.strip().removeprefix("<=")
            if not d:
                continue
            if not d.isdigit():
                raise ValueError(f"unbounded dynamic dimension in {type_text!r}")
            dims.append(int(d))
        out.append((m.group(1), tuple(dims)))
    return out


def dtype_bits(dtype: str) -> int:
    """Bits per element of an HLO element type ("f32", "bf16", "s8", "f8e4m3fn", ...); a
    ValueError naming an unknown one."""
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    m = re.fullmatch(r"f(\d+)e\d+m\d+\w*", dtype)  # f8e4m3fn, f8e5m2, f6e2m3fn, f4e2m1fn, ...
    if m:
        return int(m.group(1))
    raise ValueError(f"unknown HLO dtype {dtype!r}")


def _nbytes(arrays: Iterable[tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.ceil(math.prod(dims) * dtype_bits(dt) / 8) for dt, dims in arrays)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _iota(reshape: list[int], perm: str | None) -> np.ndarray:
    """XLA iota tile assignment: arange, reshaped, optionally transposed."""
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    return ids.transpose(_ints(perm)) if perm else ids


def _groups(attrs: str, key: str) -> tuple[tuple[int, ...], ...]:
    """replica_groups / source_target_pairs, in any of XLA's three printed forms."""
    m = re.search(rf"\b{key}=", attrs)
    if m is None:
        return ()
    i = m.end()
    if attrs.startswith("{", i):  # explicit list of lists: {{0,1},{2,3}} or {}
        body = attrs[i + 1 : _matching(attrs, i) - 1]
        return tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", body))
    if m := _IOTA_GROUPS.match(attrs, i):  # iota: [G,S]<=[d0,d1,...]T(perm)
        ids = _iota(_ints(m.group(2)), m.group(3)).reshape(_ints(m.group(1))[0], -1)
    elif m := _MESH_GROUPS.match(attrs, i):  # mesh axes: mesh['x'=2,'y'=4] {'y'}
        ids = _mesh_groups(*m.groups())
    else:
        raise ValueError(f"cannot parse {key} in {attrs[i : i + 80]!r}")
    return tuple(tuple(int(v) for v in row) for row in ids)


def _mesh_groups(mesh: str, iota: str | None, perm: str | None, explicit: str | None, axes: str):
    """Expand XLA's MeshAxesReplicaGroupList (mirrors its flattened_replica_groups)."""
    sizes = [int(n) for _, n in re.findall(r"'([^']*)'=(\d+)", mesh)]
    index = {name: k for k, (name, _) in enumerate(re.findall(r"'([^']*)'=(\d+)", mesh))}
    if iota is not None:
        devices = _iota(_ints(iota), perm)
    elif explicit is not None:
        devices = np.array(_ints(explicit))
    else:
        devices = np.arange(math.prod(sizes))
    refs: dict[int, list[tuple[int, int] | None]] = {}  # mesh axis -> [(pre_size, size) | None]
    for name, pre, size in re.findall(r"'([^']*)'(?::\((\d+)\)(\d+))?", axes):
        refs.setdefault(index[name], []).append((int(pre), int(size)) if pre else None)
    dims: list[int] = []
    grouped: list[int] = []
    group_size = 1
    for axis, full in enumerate(sizes):
        axis_refs = refs.get(axis)
        if not axis_refs:
            dims.append(full)
            continue
        if axis_refs == [None]:
            grouped.append(len(dims))
            dims.append(full)
            group_size *= full
            continue
        # Sub-axes "x":(pre)size: split the axis into [pre, size, rest] pieces, major first.
        sub = [r for r in axis_refs if r is not None]
        position = {}
        prefix = 1
        for pre, size in sorted(sub):
            if pre != prefix:
                dims.append(pre // prefix)
                prefix = pre
            position[(pre, size)] = len(dims)
            dims.append(size)
            prefix *= size
            group_size *= size
        if prefix != full:
            dims.append(full // prefix)
        grouped.extend(position[r] for r in sub)
    rest = [d for d in range(len(dims)) if d not in grouped]
    return devices.reshape(dims).transpose(rest + grouped).reshape(-1, group_size)


def _branches(instrs: list["_Instr"], callees: dict[str, set[str]]) -> dict:
    """Computation -> (conditional, branch index) of the outermost conditional branch that
    calls it, transitively (a conditional nested in a branch counts as part of that branch:
    its own branches then add up, an upper bound)."""
    reach: dict[tuple[str, int], set[str]] = {}
    where: dict[str, str] = {}  # conditional -> the computation it sits in
    for ins in instrs:
        if ins.opcode != "conditional":
            continue
        where[ins.name] = ins.computation
        m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
        if m:
            names = [n.strip().lstrip("%") for n in m.group(1).split(",")]
        else:  # lax.cond's two-branch form
            names = re.findall(r"\b(?:true|false)_computation=%?([\w.\-]+)", ins.attrs)
        for index, root in enumerate(names):
            seen, stack = set(), [root]
            while stack:
                comp = stack.pop()
                if comp not in seen:
                    seen.add(comp)
                    stack.extend(callees.get(comp, ()))
            reach[(ins.name, index)] = seen
    inside = set().union(*reach.values()) if reach else set()
    out = {}
    for (cond, index), comps in reach.items():
        if where[cond] not in inside:  # outermost
            out |= {comp: (cond, index) for comp in comps}
    return out


def _module_collectives(text: str) -> list[Collective]:
    instrs = _parse_module(text)
    by_name = {ins.name: ins for ins in instrs}
    by_comp: dict[str, dict[str, _Instr]] = {}
    for ins in instrs:
        by_comp.setdefault(ins.computation, {})[ins.name] = ins

    # Computations reachable from a while body/condition.
    callees: dict[str, set[str]] = {}
    loop_roots: set[str] = set()
    for ins in instrs:
        for m in _CALLEES.finditer(ins.attrs):
            names = {n.strip().lstrip("%") for n in m.group(1).strip("{}").split(",")}
            callees.setdefault(ins.computation, set()).update(n for n in names if n)
        if ins.opcode == "while":
            for key in ("body", "condition"):
                m = re.search(rf"\b{key}=%?([\w.\-]+)", ins.attrs)
                if m:
                    loop_roots.add(m.group(1))
    in_loop, stack = set(), list(loop_roots)
    while stack:
        c = stack.pop()
        if c not in in_loop:
            in_loop.add(c)
            stack.extend(callees.get(c, ()))

    branch_of = _branches(instrs, callees)

    # "-done" result shapes, keyed by the start they complete (through any "-update").
    done_types: dict[str, str] = {}
    for ins in instrs:
        if ins.opcode.endswith("-done") and ins.operands:
            src = by_name.get(ins.operands[0][0])
            while src is not None and src.opcode.endswith("-update") and src.operands:
                src = by_name.get(src.operands[0][0])
            if src is not None:
                done_types[src.name] = ins.type_text

    out = []
    for ins in instrs:
        op = ins.opcode.removesuffix("-start")
        if op not in COLLECTIVE_OPS:
            continue
        operands = ins.operands
        if op == "collective-permute" and "slice_sizes=" in ins.attrs:
            operands = operands[:1]  # in-place form: (input, output buffer, indices...)
        arrays = []
        for name, inline_type in operands:
            if not inline_type:
                src = by_comp.get(ins.computation, {}).get(name) or by_name.get(name)
                if src is None:
                    raise ValueError(f"cannot resolve operand %{name} of %{ins.name}")
                inline_type = src.type_text
            arrays.extend(_arrays(inline_type))
        result_type = done_types.get(ins.name, ins.type_text)
        key = "source_target_pairs" if op == "collective-permute" else "replica_groups"
        out.append(
            Collective(
                op=op,
                name=ins.name,
                operand_dtypes=tuple(dt for dt, _ in arrays),
                operand_shapes=tuple(dims for _, dims in arrays),
                operand_bytes=_nbytes(arrays),
                result_bytes=_nbytes(_arrays(result_type)),
                replica_groups=_groups(ins.attrs, key),
                computation=ins.computation,
                in_loop=ins.computation in in_loop,
                branch=branch_of.get(ins.computation),
            )
        )
    return out

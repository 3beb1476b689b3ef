"""What a run can hold, checked before anything is allocated or written: counts in the int32
JAX counts steps in, seeds in the 32 bits a PRNG key takes from them, a state within the
memory of the devices it goes to, and the data's leading dims before a state is built for
them."""

import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

INT32_MAX = 2**31 - 1  # a state's round and step counters, optax's count: int32
SEED_MAX = 2**32 - 1  # jax.random.key keeps 32 bits of a seed (without jax_enable_x64)


def check_count(name: str, value: Any, minimum: int, maximum: int = INT32_MAX) -> None:
    """ValueError naming `name` unless `value` is an integer in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value > maximum:
        raise ValueError(f"{name} must be at most {maximum:,}, got {value!r}")


def check_steps(what: str, count: int, per: int) -> None:
    """ValueError when `count` iterations of `per` steps each pass the int32 step counter."""
    if count * per > INT32_MAX:
        raise ValueError(
            f"{what}: {count:,} x {per:,} = {count * per:,} steps, more than the {INT32_MAX:,} "
            "an int32 step counter holds"
        )


def nbytes(tree: Any) -> int:
    """Bytes of a pytree's leaves (arrays or their `jax.ShapeDtypeStruct`s)."""
    return sum(
        int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
    )


def memory_of(devices: Sequence[jax.Device]) -> int | None:
    """Bytes `devices` hold together: CPU devices share this host's memory; each other device
    holds its `memory_stats()["bytes_limit"]`. None when that is not known."""
    if all(d.platform == "cpu" for d in devices):
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    total = 0
    for device in {d.id: d for d in devices}.values():
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        total += int(stats["bytes_limit"])
    return total


def check_fits(what: str, needed: int, devices: Sequence[jax.Device]) -> None:
    """ValueError naming `what` when `needed` bytes (a lower bound of what a run allocates,
    spread over `devices`) exceed what they hold together (`memory_of`); in a multi-process
    run, this process's devices and their share of it."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    if not local:
        return
    needed = needed * len(local) // len(devices)
    devices = local
    have = memory_of(devices)
    if have is not None and needed > have:
        where = (
            "this host's memory"
            if all(d.platform == "cpu" for d in devices)
            else f"the memory of its {len(devices)} {devices[0].platform} device(s)"
        )
        raise ValueError(
            f"{what} needs at least {_gb(needed)}, more than the {_gb(have)} of {where}"
        )


def check_first_item(data: Any, lead: tuple[int, ...], what: str) -> None:
    """The first item of `data` when it is a sequence (a list of batches; nothing is drawn
    from an iterator), checked like every item the run reads: each leaf's leading dims must
    be `lead` (named `what`, e.g. "[num_workers, inner_steps]"). ValueError otherwise."""
    if not isinstance(data, Sequence) or isinstance(data, str) or len(data) == 0:
        return
    for leaf in jax.tree.leaves(data[0]):
        shape = tuple(np.shape(leaf))
        if shape[: len(lead)] != lead:
            raise ValueError(
                f"data item 0: every leaf must have leading dims {what} = {lead}, got shape {shape}"
            )


def _gb(n: int) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"

"""Multi-process runs on JAX's own distributed runtime, and host<->global array helpers.

One Python process per host (or per GPU): every process calls `initialize` before anything else
touches JAX devices, then runs the same program on the same host data. `jax.devices()` then
lists the devices of all processes, the "shard_map" backend's worker mesh spans them, and
`train_diloco` / `train_sync` build global arrays from the (identical, or with
`process_local_data` each process's own) host data and hand back global arrays; `to_host`
copies them whole to every host.

`initialize` takes the coordinator address, process count and process id as arguments, or from
the environment: DILOCO_COORDINATOR ("HOST:PORT"), DILOCO_NUM_PROCESSES, DILOCO_PROCESS_ID. With
none of them set it leaves discovery to `jax.distributed.initialize` itself (SLURM, Open MPI,
TPU pods and the JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID variables).
"""

import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

ENV_COORDINATOR = "DILOCO_COORDINATOR"
ENV_NUM_PROCESSES = "DILOCO_NUM_PROCESSES"
ENV_PROCESS_ID = "DILOCO_PROCESS_ID"
MAX_TIMEOUT_S = 7 * 24 * 3600


DEFAULT_TIMEOUT_S = 300  # JAX's own initialization timeout


class CoordinatorUnreachable(ConnectionError):
    """No coordinator answered at the address within the connect timeout."""


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    platform: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    heartbeat_timeout: int | None = None,
) -> None:
    """Joins this process to a multi-process JAX run (call once, before using devices).

    Args:
      coordinator: "HOST:PORT" of process 0's coordinator service; default DILOCO_COORDINATOR.
      num_processes: N >= 1; default DILOCO_NUM_PROCESSES.
      process_id: 0 <= I < N; default DILOCO_PROCESS_ID.
      platform: the platform the run uses ("cpu", "gpu", "tpu"); default the first entry of
        JAX_PLATFORMS, if set. On "cpu" the cross-process collectives go through gloo, and
        with more than one process the persistent compilation cache is off for this process
        (JAX 0.12 hangs in a cached program's cross-process collectives).
      timeout: seconds > 0 to wait for the coordinator and for every process to join.
      heartbeat_timeout: whole seconds >= 1 after which JAX's coordination service takes a
        silent process for dead and ends the others (JAX's default, 100 s, when None).

    With all three unset (arguments and DILOCO_* variables), JAX detects the cluster itself.
    Raises ValueError when only some of them are given, or one is malformed or out of range;
    CoordinatorUnreachable when process I > 0 finds nothing listening at `coordinator`
    within `timeout` (JAX itself would end the process, later, blaming another task).
    """
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if not math.isfinite(timeout) or timeout > MAX_TIMEOUT_S:
        raise ValueError(f"timeout must be at most {MAX_TIMEOUT_S} seconds, got {timeout!r}")
    if heartbeat_timeout is not None and (
        isinstance(heartbeat_timeout, bool)
        or not isinstance(heartbeat_timeout, int)
        or not 1 <= heartbeat_timeout <= MAX_TIMEOUT_S
    ):
        raise ValueError(
            f"heartbeat_timeout must be None or whole seconds in [1, {MAX_TIMEOUT_S}], got "
            f"{heartbeat_timeout!r}"
        )
    coordinator = coordinator if coordinator is not None else os.environ.get(ENV_COORDINATOR)
    num_processes = _int_or_env("num_processes", num_processes, ENV_NUM_PROCESSES)
    process_id = _int_or_env("process_id", process_id, ENV_PROCESS_ID)
    given = {
        "coordinator": coordinator,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    missing = [name for name, value in given.items() if value is None]
    if 0 < len(missing) < len(given):
        raise ValueError(
            f"coordinator, num_processes and process_id go together; missing {missing} "
            f"(arguments or {ENV_COORDINATOR} / {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID})"
        )
    if not missing:
        _check_explicit(coordinator, num_processes, process_id)
    platform = platform or (os.environ.get("JAX_PLATFORMS") or "").split(",")[0] or None
    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if num_processes != 1:
            # JAX 0.12's CPU client hangs in the cross-process collectives of a program it
            # loads from the persistent compilation cache (compiled by an earlier cluster, or
            # by the same worker group before a restart); JAX 0.10's does not. So a
            # multi-process CPU run compiles its programs afresh.
            jax.config.update("jax_enable_compilation_cache", False)
    seconds = max(1, math.ceil(timeout))  # JAX takes whole seconds
    beat = {} if heartbeat_timeout is None else {"heartbeat_timeout_seconds": heartbeat_timeout}
    if missing:
        jax.distributed.initialize(initialization_timeout=seconds, **beat)
        return
    if process_id != 0:  # process 0 serves the coordinator; the others must reach it
        wait_for_coordinator(coordinator, timeout)
    jax.distributed.initialize(
        coordinator, num_processes, process_id, initialization_timeout=seconds, **beat
    )


def wait_for_coordinator(coordinator: str, timeout: float) -> None:
    """Returns once something accepts TCP connections at `coordinator` ("HOST:PORT"); raises
    CoordinatorUnreachable after `timeout` seconds of trying."""
    host, _, port = coordinator.rpartition(":")
    host = host.strip("[]")  # an IPv6 address in brackets
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(left, 5))):
                return
        except OSError as error:
            reason = error.strerror or type(error).__name__
        if time.monotonic() + 0.5 >= deadline:
            raise CoordinatorUnreachable(
                f"no coordinator at {coordinator} after {timeout:g} s ({reason}): start process "
                "0 first, or check the address"
            )
        time.sleep(0.5)


def _int_or_env(name: str, value: int | None, env: str) -> int | None:
    if value is not None:
        return value
    raw = os.environ.get(env)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{env} must be an integer for {name}, got {raw!r}") from None


def _check_explicit(coordinator: str, num_processes: int, process_id: int) -> None:
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator must be HOST:PORT, got {coordinator!r}")
    for name, value in (("num_processes", num_processes), ("process_id", process_id)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")


def is_multiprocess() -> bool:
    """Whether this run spans several JAX processes."""
    return jax.process_count() > 1


def to_host(tree: Any) -> Any:
    """Every leaf as a host NumPy array, readable on every process.

    Fully addressable leaves are copied; fully replicated global arrays are read from this
    process's own shard; any other global array (e.g. per-worker values split over processes)
    is all-gathered, a collective: every process must call `to_host` on the same tree.
    """
    leaves = jax.tree.leaves(tree)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return jax.device_get(tree)  # one call: starts every copy before waiting on any
    return jax.tree.map(_leaf_to_host, tree)


def _leaf_to_host(x: Any) -> Any:
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return jax.device_get(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def place_global(place: Callable[[Any], Any], tree: Any) -> Any:
    """`place(tree)`; in a multi-process run, leaf by leaf from host copies (global arrays are
    built from identical host data on every process), typed PRNG keys through their key data."""
    if not is_multiprocess():
        return place(tree)
    return jax.tree.map(lambda leaf: _place_leaf(place, leaf), tree)


def _place_leaf(place: Callable[[Any], Any], leaf: Any) -> Any:
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        data = place(np.asarray(jax.device_get(jax.random.key_data(leaf))))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
    return place(to_host(leaf))

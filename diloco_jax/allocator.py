"""The elastic runtime's processes allocate with mimalloc (`cmeel-mimalloc`, installed with
the package on Linux x86-64), preloaded where it is installed.

Why: each sync allocates and frees buffers of θ's size (θ's pieces for the wire, the pushed
deltas, the merged θ). glibc's malloc hands such blocks back to the kernel when they are
freed and faults them in again at the next sync, so most of a sync's CPU time was the
kernel's; mimalloc keeps and reuses them. A 100 MB θ synced between 2 workers took 0.88 s
per sync with glibc's malloc and 0.50 s with mimalloc on the same 2 cores
(benchmarks/elastic_sync.py). An allocator decides addresses, never values.

`python -m diloco_jax.elastic run` (and the LM app's `--elastic`) starts its processes with
it; `syncer` and `worker` started on their own start again with it before they do anything.
DILOCO_JAX_MALLOC=0 turns it off.
"""

import os
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path

SWITCH_ENV = "DILOCO_JAX_MALLOC"
MIMALLOC = Path(sysconfig.get_paths()["purelib"]) / "cmeel.prefix" / "lib" / "libmimalloc.so"


def preloaded(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with mimalloc first in LD_PRELOAD, where it is installed and not turned off (a
    copy; unchanged where it is already there)."""
    env = dict(env)
    if env.get(SWITCH_ENV, "1") == "0" or sys.platform != "linux" or not MIMALLOC.exists():
        return env
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if str(MIMALLOC) not in preload:
        env["LD_PRELOAD"] = ":".join([str(MIMALLOC), *preload])
    return env


def restart_preloaded(argv: list[str]) -> None:
    """Replaces this process (the same pid) with `python -m diloco_jax.elastic *argv` under
    mimalloc, where this one runs without it and it is installed and not turned off; else
    returns."""
    env = preloaded(os.environ)
    if env.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD"):
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "diloco_jax.elastic", *argv], env)


__all__ = ["MIMALLOC", "SWITCH_ENV", "preloaded", "restart_preloaded"]

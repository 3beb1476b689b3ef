"""Test setup: 8 fake CPU devices, set before any JAX backend initializes, and one persistent
JAX compilation cache per test run.

The cache: many tests compile a program another test (or the same test) already compiled: a
fresh loss function or optimizer object misses jit's in-memory cache though the program is
the same, the pytest-xdist workers compile each other's programs, and the CLI processes that
tests start compile the same model again. The process that starts the run (the xdist
controller, or the only process without xdist) makes an empty directory and removes it when
it exits; the workers and every subprocess inherit it through JAX_COMPILATION_CACHE_DIR. A
hit loads the very executable a miss would have compiled, so bit-for-bit checks see the same
program. DILOCO_JAX_TEST_CACHE=0 turns it off (JAX_COMPILATION_CACHE_DIR set beforehand is
used as it is).

The allocator: where the package installed mimalloc (`cmeel-mimalloc`, Linux x86-64;
`diloco_jax.allocator`), the processes this one starts (the xdist workers, the CLI and
multi-process runs) preload it.
XLA's CPU compiler, most of the suite's time, spent about a sixth of it in glibc's malloc and
free (perf, on the golden replay); with mimalloc the suite took 8 min 20 s - 8 min 41 s
against 9 min 26 s - 9 min 51 s without on the same 2 cores (it changes no result: an
allocator decides addresses, not values). DILOCO_JAX_TEST_MALLOC=0 turns it off.

The compiler's effort: once XLA's HLO passes have fixed the program (fusions, collectives,
buffers), its CPU compiler spends much of a compile optimizing each kernel with LLVM. The
suite compiles with `jax_disable_most_optimizations` (LLVM at -O0), set through
JAX_DISABLE_MOST_OPTIMIZATIONS so that the CLI and multi-process runs the tests start do the
same. The optimized HLO, which the byte and memory tests read, is the one a user's run
compiles (tests/test_golden.py checks that); a small round compiles in about a quarter less
time (0.30 s -> 0.23 s), and the suite took 6 min 42 s against 8 min 47 s - 9 min 20 s at
full optimization (the same 1320 tests and 2 cores, the same evening). Machine code at -O0
may round differently (at -O0, 90 of the 109 replayed golden cases differ in some bit), so
the tests that hold today's programs to recorded bits (the golden replay, the format-1
checkpoints) use the `users_compiler` fixture: every program they run is compiled as a
user's run compiles it.
DILOCO_JAX_TEST_FULL_OPT=1 compiles the whole suite that way."""

import atexit
import importlib.metadata
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ.get("DILOCO_JAX_TEST_CACHE", "1") != "0" and not os.environ.get(
    "JAX_COMPILATION_CACHE_DIR"
):
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="diloco-jax-test-jit-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    # Every program that takes a moment to compile (the default, 1 s, would skip most).
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

if os.environ.get("DILOCO_JAX_TEST_FULL_OPT", "0") != "1":
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# The MFU fields' peak, given rather than timed (a 2048^3 matmul, ~2 s in each CLI process the
# suite starts); tests/test_mfu.py times it.
os.environ.setdefault("DILOCO_JAX_PEAK_FLOPS", "5e10")


from diloco_jax.allocator import preloaded  # noqa: E402 (after the settings above)

if os.environ.get("DILOCO_JAX_TEST_MALLOC", "1") != "0":
    os.environ.update(preloaded(os.environ))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


# The XLA (jaxlib) whose compiled programs made the recorded bits of tests/data (the golden
# replay, the format-1 checkpoints): the oldest stack's, constraints/oldest.txt. Another XLA
# fuses and rounds otherwise, so the tests marked `xla_bits` run on this one only.
RECORDED_JAXLIB = "0.10.2"


def pytest_collection_modifyitems(config, items):
    running = importlib.metadata.version("jaxlib")
    if running == RECORDED_JAXLIB:
        return
    skip = pytest.mark.skip(
        reason=f"held to bits recorded with XLA of jaxlib {RECORDED_JAXLIB}; this is jaxlib "
        f"{running}, whose compiler rounds and fuses otherwise"
    )
    for item in items:
        if "xla_bits" in item.keywords:
            item.add_marker(skip)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml's addopts): one worker per CPU this process may use, at most
    4 (each worker holds a few GB: JAX with 8 fake devices and its compiled programs)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cpus or 1, 4))


@pytest.fixture(scope="module")
def users_compiler():
    """Every program the module's tests run compiled as a user's run compiles it (XLA's full
    optimization), none reused from the suite's -O0 compiles; the suite's setting after them.
    Module-scoped: pytest sets it up before the first of the module's tests a process runs
    and tears it down before that process runs another module's test."""
    suite_setting = jax.config.read("jax_disable_most_optimizations")
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", suite_setting)
        jax.clear_caches()

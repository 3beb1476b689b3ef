"""The elastic runtime's processes run under mimalloc where the package installed it
(`diloco_jax.allocator`)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from diloco_jax import allocator

ROOT = Path(__file__).resolve().parents[1]
needs_mimalloc = pytest.mark.skipif(
    sys.platform != "linux" or not allocator.MIMALLOC.exists(),
    reason="mimalloc is installed with the package on Linux x86-64 only",
)


@needs_mimalloc
def test_preloaded_puts_mimalloc_first_once_and_can_be_turned_off():
    lib = str(allocator.MIMALLOC)
    assert allocator.preloaded({})["LD_PRELOAD"] == lib
    given = {"LD_PRELOAD": "/x/a.so:/x/b.so", "OTHER": "1"}
    made = allocator.preloaded(given)
    assert made == {"LD_PRELOAD": f"{lib}:/x/a.so:/x/b.so", "OTHER": "1"}
    assert given == {"LD_PRELOAD": "/x/a.so:/x/b.so", "OTHER": "1"}  # not changed
    assert allocator.preloaded(made) == made  # once
    assert "LD_PRELOAD" not in allocator.preloaded({"DILOCO_JAX_MALLOC": "0"})


TASK = """
import os
from pathlib import Path


def make_task():
    maps = Path("/proc/self/maps").read_text()
    Path(os.environ["ALLOCATOR_OUT"]).write_text(f"{os.getpid()}\\n{maps}")
    raise ValueError("the task stops here")
"""


@needs_mimalloc
@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_syncer_started_on_its_own_runs_under_mimalloc_in_the_same_process(tmp_path, switch):
    """`python -m diloco_jax.elastic syncer` started without the preload starts again with
    it before anything else (the same pid: a cluster's launcher still holds it), unless
    DILOCO_JAX_MALLOC=0."""
    (tmp_path / "allocator_task.py").write_text(TASK)
    out = tmp_path / "maps"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), ALLOCATOR_OUT=str(out),
               DILOCO_JAX_MALLOC=switch, DILOCO_JAX_SECRET="s" * 32)  # fmt: skip
    argv = [sys.executable, "-m", "diloco_jax.elastic", "syncer", "--task",
            "allocator_task:make_task", "--dir", str(tmp_path / "syncer")]  # fmt: skip
    process = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2, stderr
    assert stderr.strip().splitlines()[-1].endswith("ValueError: the task stops here")
    pid, maps = out.read_text().split("\n", 1)
    assert int(pid) == process.pid
    assert (str(allocator.MIMALLOC.resolve()) in maps) == (switch == "1")

"""The README's worked mesh example runs as written (8 fake devices), and what its comments
say holds: the specs kept, the bytes each device sends, the same run through the low-level
loop."""

import contextlib
import io
import pathlib
import re

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _mesh_example() -> str:
    text = README.read_text()
    section = text[text.index("## Several devices per worker, several hosts") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_mesh_example_runs_and_its_comments_hold(capfd):
    """...and compiles without XLA's warnings, which XLA's C++ logging writes to the
    process's stderr (file descriptor 2, what `capfd` reads) while it compiles: the example's
    programs are compiled by this test alone in a run, so none comes from the cache."""
    namespace, printed = {}, io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_mesh_example(), str(README), "exec"), namespace)
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    result, state, mesh = namespace["result"], namespace["state"], namespace["mesh"]
    assert result.params["w1"].sharding.spec == P("fsdp", "tensor")
    assert result.state.inner_opt_state[0].mu["w1"].sharding.spec == P("workers", "fsdp", "tensor")
    # |θ| = 16 x 64 + 64 + 64 x 8 = 1600 float32 a round per worker; per device w1 and w2 a
    # quarter, b1 a half (416); plus the loss and the exclusion count, 4 bytes each; R = 3.
    assert printed.getvalue().split() == [str(3 * (4 * 1600 + 8)), str(3 * (4 * 416 + 8))]
    # The low-level loop: the same program, so the same bits, mesh and shardings.
    for a, b in zip(jax.tree.leaves(result.state), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding and b.sharding.mesh == mesh

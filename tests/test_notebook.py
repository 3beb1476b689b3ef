"""notebooks/quickstart.ipynb runs top to bottom (micro preset) so it can't rot, and its install
cell installs from the enclosing checkout, else from DILOCO_JAX_REPO."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).parent.parent
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("DILOCO_NOTEBOOK_PRESET", "micro")
    monkeypatch.setenv("DILOCO_NOTEBOOK_OUT", str(tmp_path / "out"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    assert (tmp_path / "out" / "summary.json").exists()
    runs = {"diloco", "pretrain", "sync_1worker", "sync_data_parallel"}
    assert {p.name for p in (tmp_path / "out" / "tensorboard").iterdir()} == runs
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2
    assert any("w error" in o.get("text", "") for o in outputs)
    assert any("TensorBoard logs:" in o.get("text", "") for o in outputs)


def _install_cell() -> dict:
    """The install cell's functions, with diloco_jax importable (so the cell installs nothing)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    source = next(c.source for c in nb.cells if c.cell_type == "code" and "pip" in c.source)
    assert "github.com/diloco-jax" not in source  # no placeholder URL
    namespace: dict = {}
    exec(source, namespace)
    return namespace


def test_install_cell_prefers_the_enclosing_checkout(tmp_path):
    cell = _install_cell()
    checkout = ["-e", str(ROOT.resolve())]
    assert cell["install_args"](ROOT / "notebooks", None) == checkout
    assert cell["install_args"](ROOT / "notebooks", "https://example.org/x.git") == checkout
    url = "https://example.org/me/diloco-jax.git"
    assert cell["install_args"](tmp_path, url) == [f"git+{url}"]
    assert cell["install_args"](tmp_path, f"git+{url}") == [f"git+{url}"]
    assert cell["install_args"](tmp_path, str(ROOT)) == [str(ROOT)]  # a local clone
    with pytest.raises(RuntimeError, match="DILOCO_JAX_REPO"):
        cell["install_args"](tmp_path, None)

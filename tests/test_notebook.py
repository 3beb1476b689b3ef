"""notebooks/quickstart.ipynb runs top to bottom (micro preset) so it can't rot."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("DILOCO_NOTEBOOK_PRESET", "micro")
    monkeypatch.setenv("DILOCO_NOTEBOOK_OUT", str(tmp_path / "out"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    assert (tmp_path / "out" / "summary.json").exists()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2
    assert any("w error" in o.get("text", "") for o in outputs)

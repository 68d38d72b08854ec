"""examples/quickstart.ipynb runs top to bottom (nbclient), so the walkthrough cannot rot."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"


def test_quickstart_notebook_executes():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    ).execute()
    text = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "ValueError: top_p" in text
    assert "prompt is empty" in text and "max_model_len" in text
    assert "finished with 2 tokens" in text

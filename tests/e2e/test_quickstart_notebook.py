"""notebooks/quickstart.ipynb, executed as a reader would run it (a real Jupyter kernel, nbclient), and kept free of
outputs in git."""

import os
import pathlib

import nbformat

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = REPO_ROOT / "notebooks" / "quickstart.ipynb"


def test_the_committed_notebook_has_no_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.outputs == [] and cell.execution_count is None for cell in code)


# In the default run, as issue 39 asks (CI executes the notebook): 240 s on the shared 2-core machine under load ~20
# (a kernel, the warm-up and RL compiles, the engine's start). Its programs are the main job test's (same shapes),
# so the test run's shared compilation cache makes it cheaper.
def test_the_notebook_runs_the_loop_step_by_step(monkeypatch):
    """Every cell runs without error in a fresh kernel started in notebooks/ (the kernel inherits the test run's
    compilation cache and CPU platform, and imports this checkout): four RL steps, the hook's record, the plot."""
    from nbclient import NotebookClient

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    text = "\n".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                     for output in cell.outputs if output.output_type == "stream")
    assert [line.split(":")[0] for line in text.splitlines() if line.startswith("step ")] == [
        f"step {step}" for step in range(1, 5)]
    assert "best step " in text
    images = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
              if "image/png" in output.get("data", {})]
    assert len(images) == 1
    errors = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
              if output.output_type == "error"]
    assert errors == [], errors

"""notebooks/inspect.ipynb: every code cell runs, in order, in one namespace (as Jupyter would),
and what it shows agrees with the planner's own numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "inspect.ipynb"


@pytest.mark.slow
def test_notebook_runs_and_agrees_with_the_planner(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    nb = json.loads(NOTEBOOK.read_text())
    assert nb["nbformat"] == 4
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert len(cells) >= 8
    (tmp_path / "traces").symlink_to(ROOT / "traces")
    monkeypatch.chdir(tmp_path)  # the notebook's relative paths; its out/ goes here
    ns: dict = {}
    for i, src in enumerate(cells):
        exec(compile(src, f"{NOTEBOOK.name}[code cell {i}]", "exec"), ns)

    plans, curves, cmp = ns["plans"], ns["curves"], ns["cmp"]
    assert plans["capuchin"].predictions.feasible
    # the curves are re-simulated from the plans' decisions: their peaks are the plans' own
    peaks = curves.groupby("plan")["live_bytes"].max()
    for name, plan in plans.items():
        assert peaks[name] == plan.predictions.predicted_peak_bytes, name
    assert peaks["baseline"] == plans["capuchin"].predictions.baseline_peak_bytes
    frame = ns["capuchin"].plans_frame(plans)
    assert list(frame.index) == list(plans)
    assert frame.loc["capuchin", "overhead_pct"] == pytest.approx(
        100 * plans["capuchin"].predictions.predicted_overhead
    )
    png = tmp_path / "out" / "transformer-50pct-policies.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(cmp.frame) == 9 and set(cmp.frame["policy"]) == {"capuchin", "recompute", "dtr"}
    assert (cmp.frame["budget_fraction"] < 0.81).all()

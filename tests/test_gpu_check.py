"""scripts/gpu-check.sh: its dry run exercises on CPU the plumbing a GPU machine runs (the gpu
tests, the main job with --device, both benchmarks, the profiles, the bitwise check) and writes
the report; the host probe needs CUDA and is left out."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def test_gpu_check_parses_and_refuses_bad_usage(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gpu"
    r = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", str(out)], capture_output=True, text=True, timeout=900
    )
    report = (out / "gpu-check.md").read_text()
    assert r.returncode == 0, report
    assert "- device: cpu" in report and "Dry run on CPU" in report
    rows = [line.split("|") for line in report.splitlines() if line.endswith(".log |")]
    steps = {r[1].strip(): r[2].strip() for r in rows}
    assert steps == {
        "environment": "0",
        "gpu-tests": "0",
        "main-job": "0",
        "benchmark-runtime": "0",
        "benchmark-dynamic": "0",
        "bitwise": "0",
        "profile": "0",
        "cprofile": "0",
    }
    bitwise = (out / "bitwise.log").read_text()
    assert bitwise.count("bitwise equal") == 3
    assert "dynamic mode" in (out / "main-job.log").read_text()

"""Training in a thread other than the script's is refused by ``capuchin trace`` with one line
naming the thread, and nothing is written (Note [Training in another thread] in
tracer/record.py); the old message blamed the warm-up."""

from __future__ import annotations

from pathlib import Path

from capuchin.cli import main
from click.testing import CliRunner

SCRIPT = Path(__file__).resolve().parent / "frameworks" / "reader_thread.py"


def test_training_in_another_thread_is_refused_by_the_tracer(tmp_path):
    out = tmp_path / "t.parquet"
    r = CliRunner().invoke(main, ["trace", "-o", str(out), str(SCRIPT), "--mode", "train"])
    assert r.exit_code != 0
    errors = [line for line in r.output.splitlines() if line.startswith("capuchin: error:")]
    assert len(errors) == 1, r.output
    assert "optimizer.step() ran in thread" in errors[0] and "warm-up" not in errors[0]
    assert "Traceback" not in r.output
    assert not out.exists()


def test_a_reader_thread_is_no_training_and_traces(tmp_path):
    out = tmp_path / "t.parquet"
    r = CliRunner().invoke(
        main, ["trace", "-o", str(out), str(SCRIPT), "--mode", "ema", "--steps", "8"]
    )
    assert r.exit_code == 0, r.output
    assert out.exists()

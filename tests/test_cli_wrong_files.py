"""A file of the wrong kind given where another is expected: one line that says what the file is."""

from __future__ import annotations

from pathlib import Path

import pytest
from capuchin.cli import main
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
MLP_TRACE = ROOT / "traces" / "mlp.trace.parquet"


def test_run_with_a_trace_as_plan_says_it_is_a_trace_not_a_plan(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    r = CliRunner().invoke(main, ["run", "--plan", str(MLP_TRACE), str(script)])
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1, r.output
    assert f"{MLP_TRACE}: a Parquet file (a trace?), not a plan" in lines[0]
    assert "codec" not in lines[0]


@pytest.mark.parametrize("command", [["show"], ["run", "--plan"]])
def test_a_binary_file_as_plan_is_not_a_plan(tmp_path, command):
    bad = tmp_path / "p.json"
    bad.write_bytes(b"\xb5\x00\xff binary")
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    args = [*command, str(bad)] + ([str(script)] if command[0] == "run" else [])
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1
    assert r.output.strip() == f"capuchin: error: {bad}: not a plan (a binary file, not JSON text)"


def test_show_states_a_small_trace_cap_in_its_own_unit():
    from dataclasses import replace

    from capuchin.tracer.reader import load_trace
    from capuchin.tracer.summary import format_summary, summarize

    s = replace(
        summarize(load_trace(MLP_TRACE)), trace_budget_bytes=1024, measured_peak_bytes=1536 * 1024
    )
    cap = [ln for ln in format_summary(s).splitlines() if ln.startswith("cap")]
    assert cap and "traced under 1.00 KiB by passive eviction: measured peak 1.50 MiB" in cap[0]


@pytest.mark.parametrize("name", ["p.json", "t.parquet"])
def test_show_of_a_name_written_per_rank_names_the_rank_files(tmp_path, name):
    from capuchin.distributed import rank_path

    for rank in (0, 1):
        rank_path(tmp_path / name, rank).write_text("x")
    r = CliRunner().invoke(main, ["show", str(tmp_path / name)])
    assert r.exit_code == 1
    stem, suffix = name.split(".")
    assert r.output.strip() == (
        f"capuchin: error: {tmp_path / name}: no such file; it was written per rank: "
        f"{tmp_path / f'{stem}.rank0.{suffix}'}, {tmp_path / f'{stem}.rank1.{suffix}'}; show one of them"
    )

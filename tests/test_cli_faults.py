"""Bad input and faults through the `capuchin` command: one clear line, the documented exit code
(docs/errors.md), nothing lost, nothing half-written. One test (or group) per case of the list
these were found in, numbered as there; the signal tests send SIGTERM and SIGINT to a real
`capuchin trace` while it writes its file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from capuchin.cli import main
from capuchin.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_USAGE, CapuchinError
from capuchin.planner.api import make_plan
from capuchin.tracer.reader import load_trace, write_trace
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
MLP_TRACE = ROOT / "traces" / "mlp.trace.parquet"

# A small training script. MARKER (argv[1], if given) is created when the script starts, so a
# test can tell whether any work was done.
TRAIN = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text("ran")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        opt.zero_grad()
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
""")


def cli(*args) -> object:
    """The command in this process (click's runner): exit code, stdout and stderr apart."""
    return CliRunner().invoke(main, [str(a) for a in args])


def _default_sigint() -> None:
    """In the child: SIGINT back to its default. A shell without job control starts a background
    command (`pytest ... &`, scripts/stress-test.sh run with `&`) with SIGINT ignored, every
    process below inherits that, and Python then installs no KeyboardInterrupt handler: the
    command would not see the Ctrl-C these tests send, as it does in a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def cli_process(*args, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """The command as a user runs it: its own process, real stderr and exit status."""
    return subprocess.run(
        [sys.executable, "-m", "capuchin.cli", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=_default_sigint,
    )


def one_line_error(r) -> str:
    """The error of a failed command: its last line, the only one starting `capuchin: error:`
    (progress lines may come before it), and no traceback."""
    assert r.exit_code != 0
    assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit), repr(
        r.exception
    )
    err = r.stderr.strip().splitlines()
    assert err and err[-1].startswith("capuchin: error: "), r.stderr
    assert sum(ln.startswith("capuchin: error: ") for ln in err) == 1, r.stderr
    assert "Traceback" not in r.output + r.stderr
    return err[-1]


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A folder holding the training script, a regular file ``afile``, the bundled mlp trace
    and a plan of it at 60% of its peak; the current directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "afile").write_text("a regular file\n")
    tr = load_trace(MLP_TRACE)
    write_trace(tr.events, tr.meta, tmp_path / "t.trace.parquet")
    plan = make_plan(tmp_path / "t.trace.parquet", "60%", "swap")
    plan.save(tmp_path / "p.json")
    return tmp_path


# ---- 1. no data loss without --force ------------------------------------------------------------
def test_1_show_never_writes_over_the_plan_nor_an_existing_file_without_force(work):
    plan_bytes = (work / "p.json").read_bytes()
    line = one_line_error(cli("show", "p.json", "--chrome", "p.json"))
    assert "p.json" in line and "input" in line
    line = one_line_error(cli("show", "p.json", "--chrome", "p.json", "--force"))  # never
    assert (work / "p.json").read_bytes() == plan_bytes
    (work / "m.png").write_bytes(b"mine")
    (work / "c.json").write_text("mine")
    for flag, name in (("--plot", "m.png"), ("--chrome", "c.json")):
        line = one_line_error(cli("show", "p.json", flag, name))
        assert name in line and "--force" in line
    assert (work / "m.png").read_bytes() == b"mine" and (work / "c.json").read_text() == "mine"
    line = one_line_error(
        cli(
            "compare",
            "t.trace.parquet",
            "--budget",
            "60%",
            "--policies",
            "swap",
            "--no-search",
            "--plot",
            "m.png",
        )
    )
    assert "m.png" in line and (work / "m.png").read_bytes() == b"mine"
    r = cli("show", "p.json", "--chrome", "c.json", "--force")
    assert r.exit_code == 0, r.output
    assert json.loads((work / "c.json").read_text())["traceEvents"]


# ---- 2. run shows the script's traceback, then one line -----------------------------------------
@pytest.mark.slow
def test_2_run_prints_the_scripts_traceback_then_one_line(work):
    (work / "bad.py").write_text(
        textwrap.dedent("""
        import torch

        def load_data():
            raise ValueError("the data is bad\\nsecond line of the message")

        load_data()
    """)
    )
    r = cli_process("run", "--budget", "1G", "--no-measure", "bad.py", cwd=work)
    assert r.returncode == 1
    err = r.stderr.strip().splitlines()
    assert "Traceback (most recent call last):" in err
    assert any('bad.py", line 5, in load_data' in ln for ln in err)
    assert err[-1] == (
        "capuchin: error: bad.py raised ValueError: the data is bad (more in the traceback above)"
    )
    assert "second line of the message" in r.stderr  # in the traceback, not in the error line
    assert not any("capuchin/runtime" in ln or "runpy" in ln for ln in err)


# ---- 3. outputs checked before any work ---------------------------------------------------------
@pytest.mark.parametrize("out", ["afile/t.parquet", "/proc/x.parquet"])
def test_3_trace_checks_its_output_before_the_script_runs(work, out):
    r = cli("trace", "-o", out, "--force", "train.py", "ran.txt")
    line = one_line_error(r)
    assert line.startswith(f"capuchin: error: {out}: ")
    assert not (work / "ran.txt").exists()  # the script never started


def test_3_run_plan_import_show_check_outputs_first(work):
    line = one_line_error(
        cli("run", "--report", "afile/r.json", "--budget", "1G", "train.py", "ran.txt")
    )
    assert "afile" in line and not (work / "ran.txt").exists()
    assert "afile" in one_line_error(
        cli("plan", "t.trace.parquet", "--budget", "60%", "-o", "afile/p.json")
    )
    log = work / "x.log"
    log.write_text('{"INSTRUCTION":"ANNOTATE","ANNOTATION":"START"}\n')
    assert "afile" in one_line_error(cli("import-dtr", log, "-o", "afile/x.parquet"))
    assert "afile" in one_line_error(cli("show", "p.json", "--plot", "afile/x.png"))
    line = one_line_error(cli("show", "p.json", "--plot", "t.parquet"))
    assert "t.parquet" in line and ".png" in line


@pytest.mark.slow
def test_3_outputs_go_where_they_were_checked_when_the_script_changes_directory(work):
    (work / "sub").mkdir()
    (work / "mover.py").write_text("import os\nos.chdir('sub')\n" + TRAIN)
    r = cli("trace", "-o", "t.parquet", "--iterations", "1", "mover.py")
    assert r.exit_code == 0, r.output
    r = cli("run", "--budget", "1G", "--no-measure", "--report", "r.json", "mover.py")
    assert r.exit_code == 0, r.output
    assert (work / "t.parquet").is_file() and (work / "r.json").is_file()
    assert list((work / "sub").iterdir()) == []


# ---- 4. a file that appears during the run is never replaced without --force ----------------------
@pytest.mark.slow
def test_4_trace_does_not_replace_a_file_written_while_it_ran(work):
    (work / "racer.py").write_text(
        TRAIN.replace(
            "    opt.step()\n",
            "    opt.step()\n    if step == 2:\n        Path('t.parquet').write_text('first')\n",
        )
    )
    r = cli("trace", "-o", "t.parquet", "--iterations", "2", "racer.py")
    line = one_line_error(r)
    assert line.startswith("capuchin: error: t.parquet: exists") and "--force" in line
    assert (work / "t.parquet").read_text() == "first"
    assert not list(work.glob(".t.parquet.*"))


def test_4_the_final_rename_never_replaces_a_file_that_appeared(tmp_path):
    from capuchin.outputs import OutputExistsError, atomic_write

    target = tmp_path / "out.json"
    with pytest.raises(OutputExistsError, match="appeared while this command ran"):
        with atomic_write(target, force=False) as tmp:
            tmp.write_text("second")
            target.write_text("first")  # another command finished first
    assert target.read_text() == "first" and sorted(os.listdir(tmp_path)) == ["out.json"]


# ---- 5. run --budget below the plan's predicted peak ---------------------------------------------
def test_5_run_refuses_a_budget_below_the_plans_peak(work):
    r = cli("run", "--plan", "p.json", "--budget", "1M", "train.py", "ran.txt")
    line = one_line_error(r)
    assert r.exit_code == 2 and "predicted peak" in line and "capuchin plan" in line
    assert not (work / "ran.txt").exists()


# ---- 6. import-dtr refuses a log cut short -------------------------------------------------------
def _dtr_log(n_layers: int, complete: bool) -> str:
    """A forward pass of ``n_layers`` ops each keeping its 1000-byte result for backward; complete:
    a backward pass that releases them (the DTR log format)."""
    lines = [
        {"INSTRUCTION": "ANNOTATE", "ANNOTATION": "START"},
        {"INSTRUCTION": "CONSTANT", "NAME": "w"},
        {"INSTRUCTION": "MEMORY", "NAME": "w", "MEMORY": "100"},
    ]
    prev = "w"
    for i in range(n_layers):
        lines += [
            {
                "INSTRUCTION": "CALL",
                "NAME": "mul",
                "ARGS": [prev, "w"],
                "RESULT": [f"a{i}"],
                "TIME": 10,
                "CONSTANT": False,
            },
            {"INSTRUCTION": "MEMORY", "NAME": f"a{i}", "MEMORY": "1000"},
            {"INSTRUCTION": "ALIAS", "NAME": f"a{i}", "ALIAS": -1},
        ]
        prev = f"a{i}"
    if complete:
        lines.append({"INSTRUCTION": "ANNOTATE", "ANNOTATION": "BACKWARD"})
        for i in reversed(range(n_layers)):
            lines += [
                {
                    "INSTRUCTION": "CALL",
                    "NAME": "mul_backward",
                    "ARGS": [f"a{i}", "w"],
                    "RESULT": [f"g{i}"],
                    "TIME": 10,
                    "CONSTANT": False,
                },
                {"INSTRUCTION": "MEMORY", "NAME": f"g{i}", "MEMORY": "100"},
                {"INSTRUCTION": "ALIAS", "NAME": f"g{i}", "ALIAS": -1},
                {"INSTRUCTION": "RELEASE", "NAME": f"a{i}"},
                {"INSTRUCTION": "RELEASE", "NAME": f"g{i}"},
            ]
    return "".join(json.dumps(d) + "\n" for d in lines)


def test_6_import_dtr_refuses_a_log_cut_before_its_backward_marker(work):
    (work / "cut.log").write_text(_dtr_log(6, complete=False))
    line = one_line_error(cli("import-dtr", "cut.log", "-o", "cut.trace.parquet"))
    assert "cut.log" in line and "before its ANNOTATE BACKWARD marker" in line
    assert not (work / "cut.trace.parquet").exists()
    (work / "whole.log").write_text(_dtr_log(6, complete=True))
    r = cli("import-dtr", "whole.log", "-o", "whole.trace.parquet")
    assert r.exit_code == 0, r.output
    assert set(load_trace("whole.trace.parquet").ops["phase"]) == {"forward", "backward"}


# ---- 7. plan contents validated at load ----------------------------------------------------------
def _bad_plan(work: Path, change) -> Path:
    doc = json.loads((work / "p.json").read_text())
    change(doc)
    path = work / "bad.plan.json"
    path.write_text(json.dumps(doc))
    return path


def _recompute(doc: dict, replay_ops: list, empty: bool) -> None:
    """Decision 0 of ``doc`` made a recompute of storage ``2:0`` replaying ``replay_ops``."""
    d = doc["decisions"][0]
    d.update(storage_id="2:0", method="recompute", evict_op=3, back_op=5, trigger_op=None)
    if not empty:
        d["replay_ops"] = replay_ops
    else:
        d.pop("replay_ops", None)
    doc["actions"] = [[3, "evict_drop", "2:0"], [5, "recompute", "2:0"]]


@pytest.mark.parametrize(
    "change, says",
    [
        (
            lambda d: d["actions"][0].__setitem__(0, 99999),
            "actions[0][0]: 99999 is not an op index",
        ),
        (lambda d: d["actions"][0].__setitem__(2, "x9:9"), "actions[0][2]: storage 'x9:9' has no"),
        (lambda d: d["actions"][0].__setitem__(0, "3"), "actions[0][0]: '3' is not an op index"),
        (
            lambda d: d["provenance"].__setitem__("budget_bytes", "big"),
            "provenance.budget_bytes: 'big' is not an integer",
        ),
        (lambda d: d.__setitem__("ops", {}), "ops: expected a list"),
        (lambda d: d["decisions"][0].__setitem__("evict_op", -1), "decisions[0].evict_op: -1"),
        (lambda d: d["decisions"][0].__setitem__("method", "teleport"), "'teleport' is not"),
        (lambda d: d.__setitem__("op_scratch_bytes", [1, 2]), "op_scratch_bytes: 2 entries for"),
        (lambda d: d["decisions"][0].__setitem__("wraps", "yes"), "wraps: 'yes' is not true"),
        (
            lambda d: d.__setitem__(
                "kinds",
                [
                    {
                        **{k: d[k] for k in ("kind", "predictions", "ops", "decisions")},
                        "iteration": 0,
                        "actions": [[0, "restore", "nope"]],
                    }
                ],
            ),
            "kinds[0].actions[0][2]: storage 'nope' has no decision",
        ),
        # round 3, K5: integers beyond int64 (float range even) are refused at load
        (
            lambda d: d["decisions"][0].__setitem__("size_bytes", 10**400),
            "decisions[0].size_bytes: an integer of 401 digits is too large",
        ),
        (
            lambda d: d["predictions"].__setitem__("predicted_peak_bytes", 10**400),
            "predictions.predicted_peak_bytes: an integer of 401 digits is too large",
        ),
        # round 3, S1: a recompute chain must hold its producer, in order
        (lambda d: _recompute(d, [], True), "a recompute decision needs the ops to replay"),
        (lambda d: _recompute(d, [1], False), "do not include op 2, the producer of 2:0"),
        (lambda d: _recompute(d, [2, 1], False), "[2, 1] are not in increasing order"),
    ],
)
def test_7_plan_contents_are_validated_at_load(work, change, says):
    path = _bad_plan(work, change)
    line = one_line_error(cli("show", path))
    assert f"{path}: plan is malformed: " in line and says in line, line


def test_7_run_refuses_a_malformed_plan_before_the_script_runs(work):
    path = _bad_plan(work, lambda d: d["actions"][0].__setitem__(0, 99999))
    line = one_line_error(cli("run", "--plan", path, "train.py", "ran.txt"))
    assert "99999" in line and not (work / "ran.txt").exists()


# ---- 8. sizes: finite, at least one byte ---------------------------------------------------------
@pytest.mark.parametrize(
    "args, says",
    [
        (["plan", "t.trace.parquet", "--budget", "1e999"], "budget '1e999': too large"),
        (
            ["plan", "t.trace.parquet", "--budget", "60%", "--bandwidth", "1e999"],
            "bandwidth '1e999': too large",
        ),
        (
            ["compare", "t.trace.parquet", "--budget", "1e999", "--policies", "swap"],
            "budget '1e999': too large",
        ),
        (["plan", "t.trace.parquet", "--budget", "1e-3"], "budget '1e-3': must be at least 1 byte"),
        (["plan", "t.trace.parquet", "--budget", "1e999%"], "positive, finite percentage"),
        (["run", "--budget", "0.4", "train.py"], "budget '0.4': must be at least 1 byte"),
    ],
)
def test_8_sizes_are_finite_and_at_least_one_byte(work, args, says):
    line = one_line_error(cli(*args))
    assert says in line, line
    assert not (work / "t.plan.json").exists()


# ---- 9. trace metadata validated at load ---------------------------------------------------------
@pytest.mark.parametrize(
    "field, value, says",
    [
        ("bandwidth_h2d_bytes_per_s", 0, "bandwidth_h2d_bytes_per_s 0 is not a finite rate"),
        ("bandwidth_d2h_bytes_per_s", "fast", "bandwidth_d2h_bytes_per_s 'fast'"),
        ("steady_iteration", 99, "steady_iteration 99 is not one of the recorded iterations"),
        ("iterations", "abc", "iterations 'abc' is not a non-empty list"),
        ("schema_version", "1", "schema_version '1' is not an integer"),
        ("device", "tpu", "device 'tpu'"),
    ],
)
def test_9_trace_metadata_is_validated_at_load(work, field, value, says):
    tr = load_trace("t.trace.parquet")
    setattr(tr.meta, field, value)
    write_trace(tr.events, tr.meta, "bad.trace.parquet")
    for args in (["show", "bad.trace.parquet"], ["plan", "bad.trace.parquet", "--budget", "60%"]):
        line = one_line_error(cli(*args))
        assert "bad.trace.parquet: trace metadata: " in line and says in line, line
    assert not (work / "bad.plan.json").exists()


# ---- 10. SIGTERM and SIGINT while `capuchin trace` writes ---------------------------------------
# The script makes the trace's write slow (pyarrow's writer, called after the script stopped,
# first writes the temporary file, then waits) and says when the write has begun.
SLOW_WRITE = (
    textwrap.dedent("""
    import time
    from pathlib import Path
    import pyarrow.parquet as pq
    _write = pq.write_table
    def slow_write(table, where, **kwargs):
        _write(table, where, **kwargs)
        Path("writing.part").write_text(str(where))
        Path("writing.part").rename("writing")  # whole, for the test that waits for it
        time.sleep(120)
    pq.write_table = slow_write
""")
    + TRAIN
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, code", [(signal.SIGTERM, EXIT_TERMINATED), (signal.SIGINT, EXIT_INTERRUPTED)]
)
def test_10_signal_during_the_write_leaves_no_temporary_and_the_target_intact(work, sig, code):
    (work / "slow.py").write_text(SLOW_WRITE)
    (work / "t.parquet").write_bytes(b"the previous trace")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "capuchin.cli",
            "trace",
            "-o",
            "t.parquet",
            "--force",
            "--iterations",
            "2",
            "slow.py",
        ],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=_default_sigint,
    )
    try:
        deadline = time.monotonic() + 240
        while not (work / "writing").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the write never began"
            time.sleep(0.05)
        tmp = work / (work / "writing").read_text()  # relative to the command's folder
        assert tmp.parent.resolve() == work.resolve() and tmp.name.startswith(".t.parquet.")
        assert tmp.exists()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1] in ("capuchin: terminated", "capuchin: interrupted")
    assert not tmp.exists() and [p.name for p in work.glob(".t.parquet*")] == []
    assert (work / "t.parquet").read_bytes() == b"the previous trace"


def test_10_sigterm_while_a_library_user_writes_removes_the_temporary_and_kills(tmp_path):
    """Outside the command (a script using capuchin.Tracer, or Plan.save) SIGTERM still kills
    the process, after the temporary file is gone."""
    (tmp_path / "writer.py").write_text(
        textwrap.dedent("""
        import time
        from pathlib import Path
        from capuchin.outputs import atomic_write
        with atomic_write("out.txt") as tmp:
            tmp.write_text("partial")
            Path("writing.part").write_text(str(tmp))
            Path("writing.part").rename("writing")
            time.sleep(120)
    """)
    )
    proc = subprocess.Popen([sys.executable, "writer.py"], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "writing").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        tmp = tmp_path / (tmp_path / "writing").read_text()
        assert tmp.exists()
        proc.terminate()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGTERM
    assert not tmp.exists() and not (tmp_path / "out.txt").exists()


# ---- 11. the ILP's time limit ---------------------------------------------------------------------
def test_11_ilp_names_the_time_limit_that_stopped_it(work):
    pytest.importorskip("ortools")
    r = cli("plan", "t.trace.parquet", "--budget", "60%", "--policy", "ilp", "--time-limit", "0.01")
    line = one_line_error(r)
    assert r.exit_code == 2 and "time limit of 0.01 s" in line and "--time-limit" in line


@pytest.mark.parametrize("limit", ["0", "-5"])
def test_11_compare_validates_time_limit_as_plan_does(work, limit):
    for cmd in (
        ["compare", "t.trace.parquet", "--budget", "60%"],
        ["plan", "t.trace.parquet", "--budget", "60%"],
    ):
        r = cli(*cmd, "--time-limit", limit)
        assert r.exit_code == EXIT_USAGE and "--time-limit" in r.output + r.stderr


# ---- 12. exit codes --------------------------------------------------------------------------------
@pytest.mark.slow
def test_12_usage_errors_are_not_the_infeasible_budget_code(work):
    assert cli("plan", "t.trace.parquet").exit_code == EXIT_USAGE  # --budget missing
    assert cli("plan", "--no-such-option", "t.trace.parquet").exit_code == EXIT_USAGE
    assert cli("run", "train.py").exit_code == EXIT_USAGE  # neither --plan nor --budget
    assert cli("plan", "t.trace.parquet", "--budget", "1K").exit_code == 2  # infeasible
    r = cli(
        "max-batch", "--memory", "1M", "--arg", "--batch", "--min", "8", "--max", "4", "train.py"
    )
    assert r.exit_code == EXIT_USAGE and "--min 8 is above --max 4" in r.output + r.stderr


def test_12_plan_names_a_bad_budget_before_an_existing_output(work):
    line = one_line_error(cli("plan", "t.trace.parquet", "--budget", "5O%", "-o", "p.json"))
    assert "'5O%'" in line and "not a percentage" in line


def test_12_import_dtr_names_a_line_without_an_instruction(work):
    (work / "bad.log").write_text('{"NAME": "x0"}\n')
    line = one_line_error(cli("import-dtr", "bad.log", "-o", "d.trace.parquet"))
    assert "bad.log:1" in line and "no INSTRUCTION field" in line
    assert not (work / "d.trace.parquet").exists()


@pytest.mark.slow
def test_12_sigint_exits_130(work):
    (work / "stop.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n")
    r = cli_process("trace", "-o", "s.parquet", "stop.py", cwd=work)
    assert r.returncode == EXIT_INTERRUPTED and "capuchin: interrupted" in r.stderr
    assert not (work / "s.parquet").exists()


# ---- 13. the DTR logs are found from the repository -----------------------------------------------
def test_13_dtr_logs_are_found_beside_the_repository_or_by_variable(monkeypatch, tmp_path):
    from capuchin.tracer.dtr_import import DTR_LOGS_VARIABLE, dtr_logs_path

    monkeypatch.delenv(DTR_LOGS_VARIABLE, raising=False)
    assert dtr_logs_path() == ROOT.resolve().parent / "shared" / "data" / "dtr-logs.zip"
    mine = tmp_path / "logs.zip"
    mine.write_bytes(b"")
    monkeypatch.setenv(DTR_LOGS_VARIABLE, str(mine))
    assert dtr_logs_path() == mine
    monkeypatch.setenv(DTR_LOGS_VARIABLE, str(tmp_path / "missing.zip"))
    with pytest.raises(CapuchinError, match="missing.zip"):
        dtr_logs_path()


# ---- one writer for every output ------------------------------------------------------------------
def test_every_writer_gives_a_new_files_mode_and_leaves_no_temporary(work):
    from capuchin.planner.plan import load_plan
    from capuchin.runtime.report import RunReport

    old = os.umask(0o022)
    try:
        tr = load_trace("t.trace.parquet")
        written = [
            write_trace(tr.events, tr.meta, work / "out" / "w.trace.parquet"),
            load_plan("p.json").save(work / "out" / "w.plan.json"),
            RunReport(budget_bytes=None, device="cpu", plan=None, iterations=[]).save(
                work / "out" / "w.report.json"
            ),
        ]
    finally:
        os.umask(old)
    for path in written:
        assert (path.stat().st_mode & 0o777) == 0o644, path  # as `open(path, "w")` would
    assert sorted(p.name for p in (work / "out").iterdir()) == sorted(p.name for p in written)


# ---- round 3 (../shared/reports/faults.md): outputs ---------------------------------------------
def test_r3_u3_a_dangling_symlink_output_is_refused_before_the_script_runs(work):
    (work / "dangling.json").symlink_to("nonexistent_target.json")
    line = one_line_error(
        cli("run", "--report", "dangling.json", "--budget", "1G", "train.py", "ran.txt")
    )
    assert line == "capuchin: error: dangling.json: exists; use --force to overwrite"
    assert not (work / "ran.txt").exists()


def test_r3_k4_names_over_the_file_system_limit_are_one_line(work):
    long = "y" * 256 + ".json"
    line = one_line_error(cli("plan", "t.trace.parquet", "--budget", "60%", "-o", long))
    assert "a name of 261 bytes; file systems allow at most 255 per name" in line
    deep = "/".join(["d" * 200] * 25) + "/p.json"  # every name legal, the path over PATH_MAX
    line = one_line_error(cli("plan", "t.trace.parquet", "--budget", "60%", "-o", deep))
    assert "cannot use this path (File name too long)" in line
    script = work / ("x" * 250 + ".py")
    script.write_text(TRAIN)
    line = one_line_error(cli("trace", script.name, "ran.txt"))  # default output: a longer name
    assert not (work / "ran.txt").exists()
    assert "file systems allow at most 255 per name" in line


def test_r3_u13_a_legal_255_byte_name_is_written(work):
    name = "x" * 250 + ".json"
    r = cli("plan", "t.trace.parquet", "--budget", "60%", "-o", name)
    assert r.exit_code == 0, r.output
    assert (work / name).is_file() and [
        p.name for p in work.iterdir() if p.name.startswith(".")
    ] == []


@pytest.fixture
def full_folder(work, monkeypatch):
    """``full/``: every final rename into it fails as on a full disk (the probe's empty file is
    created, as a full tmpfs allows)."""
    import errno

    full = work / "full"
    full.mkdir()
    link, replace = os.link, os.replace

    def no_space(real):
        def f(src, dst, *a, **k):
            if Path(os.path.abspath(dst)).parent == full:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(src, dst, *a, **k)

        return f

    monkeypatch.setattr(os, "link", no_space(link))
    monkeypatch.setattr(os, "replace", no_space(replace))
    return full


def _fallback(line: str, path: str) -> Path:
    assert f"{path}: cannot write (No space left on device); its content was written to " in line
    where = Path(line.split("its content was written to ")[1].removesuffix(" instead"))
    assert where.is_file()
    return where


def test_r3_k3_a_full_disk_at_the_final_write_keeps_the_report_elsewhere(work, full_folder):
    r = cli("run", "--budget", "1G", "--no-measure", "--report", "full/r.json", "train.py")
    line = one_line_error(r)
    where = _fallback(line, "full/r.json")
    assert json.loads(where.read_text())["format"] == "capuchin.run-report"
    assert "capuchin run: " in r.stdout  # the run's summary is printed all the same
    assert list(full_folder.iterdir()) == []
    line = one_line_error(cli("plan", "t.trace.parquet", "--budget", "60%", "-o", "full/p.json"))
    assert json.loads(_fallback(line, "full/p.json").read_text())["format"] == "capuchin.plan"
    line = one_line_error(cli("show", "p.json", "--chrome", "full/c.json"))
    _fallback(line, "full/c.json")


def test_r3_k3_a_full_disk_at_the_traces_final_write_keeps_the_trace(work, full_folder):
    line = one_line_error(cli("trace", "-o", "full/t.parquet", "--iterations", "1", "train.py"))
    assert len(load_trace(_fallback(line, "full/t.parquet")).events) > 0


# ---- round 3: the Python API's Runtime -------------------------------------------------------
def _train_under(rt) -> None:
    import runpy

    with rt:
        runpy.run_path("train.py", run_name="__main__")


def test_r3_s5_k7_runtime_report_path_is_checked_before_training(work):
    import capuchin

    (work / "r.json").write_text("PRECIOUS DATA\n")
    with pytest.raises(capuchin.errors.OutputExistsError, match="r.json: exists"):
        capuchin.Runtime(
            device="cpu", budget_bytes=2**30, measure_memory=False, report_path="r.json"
        )
    assert (work / "r.json").read_text() == "PRECIOUS DATA\n"
    (work / "h").mkdir()
    with pytest.raises(CapuchinError, match="h: is a folder"):
        capuchin.Runtime(device="cpu", budget_bytes=2**30, measure_memory=False, report_path="h")
    _train_under(
        capuchin.Runtime(
            device="cpu", budget_bytes=2**30, measure_memory=False, report_path="r.json", force=True
        )
    )
    assert json.loads((work / "r.json").read_text())["format"] == "capuchin.run-report"


def test_r3_k6_the_same_runtime_entered_twice_is_one_clear_error(work):
    import capuchin

    rt = capuchin.Runtime(device="cpu", budget_bytes=2**30, measure_memory=False)
    with rt:
        with pytest.raises(CapuchinError, match="already active"):
            rt.__enter__()
    _train_under(rt)  # and it is usable again afterwards
    assert rt.report.iterations


@pytest.mark.parametrize("budget", [0, -5, 0.5, float("nan"), True, "1G"])
def test_r3_u16_runtime_budget_bytes_is_a_whole_number_of_bytes(budget):
    import capuchin

    with pytest.raises(CapuchinError, match="budget_bytes"):
        capuchin.Runtime(device="cpu", budget_bytes=budget)


# ---- round 3: the training script's exits and odd inputs ----------------------------------------
@pytest.mark.slow
def test_r3_u1_os_exit_0_in_the_script_ends_it_and_the_files_are_written(work):
    """os._exit(0) after the last step: the process ended with status 0, no file and no word."""
    # 3 steps: one warm-up and the 2 traced iterations, then os._exit(0)
    (work / "osexit.py").write_text(
        TRAIN.replace("range(6)", "range(3)") + "import os\nos._exit(0)\n"
    )
    r = cli_process("trace", "-o", "t5.parquet", "--iterations", "2", "osexit.py", cwd=work)
    assert r.returncode == 0, r.stderr
    assert len(load_trace(work / "t5.parquet").events) > 0
    r = cli_process(
        "run", "--budget", "1G", "--no-measure", "--report", "r.json", "osexit.py", cwd=work
    )
    assert r.returncode == 0 and "capuchin run: " in r.stdout, r.stderr
    assert json.loads((work / "r.json").read_text())["iterations"]


def test_r3_u1_os_exit_with_a_status_is_one_line(work):
    (work / "osexit5.py").write_text("import os\nos._exit(5)\n" + TRAIN)
    r = cli_process("trace", "-o", "t.parquet", "osexit5.py", cwd=work)  # (os._exit ended pytest)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
        "capuchin: error: osexit5.py: the script called os._exit(5); no trace written"
    ), r.stderr


def test_r3_u6_sys_exit_with_a_message_is_not_a_status(work):
    (work / "msg.py").write_text("import sys\nsys.exit('fatal: dataset shard missing')\n")
    r = cli("trace", "-o", "t.parquet", "msg.py")
    line = one_line_error(r)
    assert line == (
        "capuchin: error: msg.py: the script exited with status 1 and the message above; "
        "no trace written"
    )
    assert "fatal: dataset shard missing" in r.stderr.splitlines()[-2]


@pytest.mark.parametrize(
    "content", [b"def broken(:\n    pass\n", b"PAR1\x00\x01\x02 binary", b"#!/bin/sh\necho hi\n"]
)
def test_r3_u7_a_script_that_does_not_compile_shows_no_capuchin_or_runpy_frames(work, content):
    (work / "bad.py").write_bytes(content)
    r = cli("trace", "-o", "t.parquet", "bad.py")
    line = one_line_error(r)
    assert line.startswith("capuchin: error: bad.py raised SyntaxError: ")
    assert "runpy" not in r.stderr and "runmain.py" not in r.stderr


def test_r3_u8_module_mode_is_named(work):
    line = one_line_error(cli("trace", "-m", "json.tool"))
    assert "-m: module mode (python -m MODULE) is not supported" in line


def test_r3_u12_a_folder_as_output_is_one_line_and_exit_1(work):
    (work / "outdir").mkdir()
    for args in (
        ["plan", "t.trace.parquet", "--budget", "60%", "-o", "outdir"],
        ["trace", "-o", "outdir", "train.py"],
        ["run", "--budget", "1G", "--report", "outdir", "train.py"],
        ["show", "p.json", "--chrome", "outdir"],
    ):
        r = cli(*args)
        assert r.exit_code == 1 and one_line_error(r).endswith(
            "outdir: is a folder; give a file name"
        )


def test_r3_u14_import_dtr_of_a_device_says_what_it_is(work):
    line = one_line_error(cli("import-dtr", "/dev/null", "-o", "n.parquet"))
    assert "/dev/null: not a regular file" in line


def test_r3_u15_make_plan_iteration_must_be_an_integer(work):
    with pytest.raises(CapuchinError, match=r"iteration '1' is not an integer \(recorded: "):
        make_plan("t.trace.parquet", "60%", iteration="1")


# ---- round 3: size messages ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, says",
    [
        (["trace", "--budget", "-5M", "train.py"], "budget '-5M': must not be negative"),
        (["trace", "--budget", "lots", "train.py"], "budget 'lots': expected bytes or a size"),
        (["run", "--budget", "lots", "train.py"], "budget 'lots': expected bytes or a size"),
        (["max-batch", "--memory", "-1", "--arg", "--batch", "train.py"], "memory '-1': must not"),
        (["max-batch", "--memory", "", "--arg", "--batch", "train.py"], "memory '': expected"),
        (
            ["max-batch", "--memory", "nan", "--arg", "--batch", "train.py"],
            "memory 'nan': expected bytes",
        ),
    ],
)
def test_r3_u9_size_messages_offer_only_what_the_command_takes(work, args, says):
    line = one_line_error(cli(*args))
    assert says in line and "percentage" not in line, line


def test_r3_u9_plan_offers_a_percentage_and_nan_is_not_a_number(work):
    assert "(or a percentage like 60%)" in one_line_error(
        cli("plan", "t.trace.parquet", "--budget", "lots")
    )
    with pytest.raises(CapuchinError, match="budget nan: not a number of bytes"):
        make_plan("t.trace.parquet", float("nan"))


# ---- round 3: capuchin's own output is clean ----------------------------------------------------
@pytest.mark.slow
def test_r3_noise_no_profiler_lines_in_the_users_output(work):
    """The profiler's USDT start/stop lines and the allocator's warning were printed into every
    trace and measured run; the script's own stderr still comes through."""
    (work / "talk.py").write_text(
        TRAIN.replace("opt.step()\n", "opt.step()\n    print('script says hi', file=sys.stderr)\n")
    )
    for args in (
        ["trace", "-o", "t.parquet", "--force", "--iterations", "2", "talk.py"],
        ["run", "--budget", "1G", "talk.py"],
    ):
        r = cli_process(*args, cwd=work)
        assert r.returncode == 0, r.stderr
        assert "script says hi" in r.stderr
        assert "USDT" not in r.stderr and "CPUAllocator" not in r.stderr, r.stderr


MP_SPAWN = textwrap.dedent("""
    import multiprocessing as mp
    import torch

    def worker(q):
        q.put(1)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        torch.manual_seed(0)
        m = torch.nn.Linear(8, 2)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(6):
            ctx.Process(target=worker, args=(q,)).start()
            opt.zero_grad()
            m(torch.randn(4, 8)).sum().backward()
            opt.step()
""")


@pytest.mark.slow
def test_r3_u11_children_of_a_stopped_script_print_nothing_after_wrote(work):
    """U11: spawn-context children outlived the stopped script and printed FileNotFoundError
    tracebacks after `capuchin: wrote`."""
    (work / "mp_spawn.py").write_text(MP_SPAWN)
    r = cli_process("trace", "--iterations", "2", "-o", "mp.parquet", "mp_spawn.py", cwd=work)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "capuchin: wrote mp.parquet", r.stderr
    assert "Traceback" not in r.stderr


def test_r3_k3_a_file_system_with_no_free_block_is_refused_before_the_work(work, monkeypatch):
    """The probe's empty file is created even on a full tmpfs, so the whole job ran first."""
    real = os.statvfs
    full = os.statvfs_result((4096, 4096, 16, 0, 0, 16, 0, 0, 0, 255))

    def statvfs(path):
        return full if Path(os.path.abspath(path)).name == "full" else real(path)

    monkeypatch.setattr(os, "statvfs", statvfs)
    (work / "full").mkdir()
    line = one_line_error(
        cli("run", "--budget", "1G", "--report", "full/r.json", "train.py", "ran.txt")
    )
    assert line.endswith("full/r.json: cannot write in full (No space left on device)")
    assert not (work / "ran.txt").exists()

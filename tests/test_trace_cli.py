"""`capuchin trace` / `capuchin show` on bad input: one-line errors, exit codes, no stray files."""

from __future__ import annotations

import textwrap

import capuchin
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from capuchin.cli import main
from click.testing import CliRunner

_TRAIN = """
import sys
import torch
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
for step in range(steps):
    opt.zero_grad()
    model(torch.randn(8, 16)).square().mean().backward()
    {after_backward}
    opt.step()
    print("did step", step)
{at_end}
"""


def _script(tmp_path, name="train.py", after_backward="pass", at_end=""):
    p = tmp_path / name
    p.write_text(textwrap.dedent(_TRAIN).format(after_backward=after_backward, at_end=at_end))
    return p


def _error_lines(result):
    return [line for line in result.stderr.splitlines() if line.startswith("capuchin: error:")]


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_missing_script(tmp_path):
    r = _invoke("trace", "-o", tmp_path / "o.parquet", tmp_path / "nope.py")
    assert r.exit_code == 1
    (line,) = _error_lines(r)
    assert "nope.py" in line and "no such script" in line
    assert not (tmp_path / "o.parquet").exists()


def test_script_raising_shows_its_traceback_and_writes_nothing(tmp_path):
    script = _script(tmp_path, after_backward="if step == 2: raise ValueError('boom at step 2')")
    out = tmp_path / "o.parquet"
    r = _invoke("trace", "--iterations", "3", "-o", out, script)
    assert r.exit_code == 1
    assert "Traceback" in r.stderr and "train.py" in r.stderr and "boom at step 2" in r.stderr
    assert "runpy" not in r.stderr  # the script's frames, not capuchin's
    (line,) = _error_lines(r)
    assert "ValueError" in line and "no trace written" in line
    assert not out.exists() and list(tmp_path.glob("*.tmp")) == []


def test_script_that_never_steps(tmp_path):
    script = tmp_path / "nostep.py"
    script.write_text(
        "import torch\nfor _ in range(3):\n"
        "    (torch.randn(4, 4, requires_grad=True) * 2).sum().backward()\n"
    )
    out = tmp_path / "o.parquet"
    r = _invoke("trace", "-o", out, script)
    assert r.exit_code == 1
    (line,) = _error_lines(r)
    assert "never called optimizer.step()" in line and "capuchin.step()" in line
    assert not out.exists()


def test_fewer_iterations_than_asked_writes_what_was_recorded(tmp_path):
    script = _script(tmp_path)
    out = tmp_path / "o.parquet"
    r = _invoke("trace", "--iterations", "3", "--warmup", "1", "-o", out, script, "2")
    assert r.exit_code == 0, r.output
    assert "ended after 1 of 3" in r.stderr
    trace = capuchin.load_trace(out)
    assert trace.meta.iterations == [1]
    assert trace.meta.extra["requested_iterations"] == 3


def test_all_iterations_in_warmup_is_an_error(tmp_path):
    script = _script(tmp_path)
    out = tmp_path / "o.parquet"
    r = _invoke("trace", "--warmup", "5", "-o", out, script, "2")
    assert r.exit_code == 1
    (line,) = _error_lines(r)
    assert "warm-up" in line and not out.exists()


def test_script_exit_status(tmp_path):
    script = _script(tmp_path, at_end="sys.exit(3)")
    r = _invoke("trace", "--iterations", "5", "-o", tmp_path / "o.parquet", script, "2")
    assert r.exit_code == 1
    (line,) = _error_lines(r)
    assert "status 3" in line


def test_script_sees_its_argv_main_and_folder(tmp_path):
    (tmp_path / "helper_mod_for_trace.py").write_text("VALUE = 7\n")
    script = _script(
        tmp_path,
        at_end=(
            "import helper_mod_for_trace\n"
            "assert __name__ == '__main__' and sys.argv[0].endswith('train.py'), sys.argv\n"
            "assert helper_mod_for_trace.VALUE == 7\n"
        ),
    )
    r = _invoke("trace", "--iterations", "1", "-o", tmp_path / "o.parquet", script, "3")
    assert r.exit_code == 0, r.output
    # `SCRIPT -- ARGS`: the separator is not passed on
    r = _invoke(
        "trace", "--iterations", "1", "--force", "-o", tmp_path / "o.parquet", script, "--", "3"
    )
    assert r.exit_code == 0, r.output
    assert capuchin.load_trace(tmp_path / "o.parquet").meta.argv == ["3"]


def test_stopped_cleanly_after_the_recorded_iterations(tmp_path):
    script = _script(tmp_path)
    out = tmp_path / "o.parquet"
    r = _invoke(
        "trace", "--iterations", "2", "--warmup", "1", "--plain-steps", "0", "-o", out, script, "50"
    )
    assert r.exit_code == 0, r.output
    assert "did step 2" in r.stdout and "did step 3" not in r.stdout
    meta = capuchin.load_trace(out).meta
    assert meta.plain_iteration_ns is None and "plain_steps 0" in meta.extra["plain_iteration_note"]


def test_plain_steps_after_the_recorded_iterations(tmp_path):
    # Note [Plain step]: 1 warm-up + 2 recorded, 1 plain warm-up, 1 untimed plain step, 2 plain
    # steps, then 3 rounds of a plain step and the runtime on its hot, guarded and slow paths
    # (the first round with a warm-up of the runtime; Note [The runtime in the script's steps]
    # in runtime/calibrate.py): 15 steps; stopped inside the optimizer step of the last of
    # those (step 19), so its print never runs
    script = _script(tmp_path)
    out = tmp_path / "o.parquet"
    r = _invoke("trace", "--iterations", "2", "--warmup", "1", "-o", out, script, "50")
    assert r.exit_code == 0, r.output
    assert "did step 18" in r.stdout and "did step 19" not in r.stdout
    assert "capuchin: plain step " in r.stderr and "median of 3 iteration(s)" in r.stderr
    meta = capuchin.load_trace(out).meta
    assert meta.iterations == [1, 2]
    walls = meta.extra["plain_iteration_wall_s"]
    assert len(walls) == 3 and all(w > 0 for w in walls)
    # the median; the stored intervals are rounded to the microsecond
    assert abs(meta.plain_iteration_ns - sorted(walls)[1] * 1e9) <= 1e3


@pytest.mark.parametrize("steps, timed", [(5, 0), (6, 1), (7, 2), (8, 3), (13, 3)])
def test_plain_step_with_too_few_steps(tmp_path, steps, timed):
    # 3 steps trace (1 warm-up, 2 recorded); a plain interval needs 3 more steps (the plain
    # warm-up, the untimed plain step, the timed one), the second and third one more each (the
    # baseline's steps before the probe); a later round's plain step is not the baseline's
    script = _script(tmp_path, at_end="print('script end')")
    out = tmp_path / "o.parquet"
    r = _invoke("trace", "--iterations", "2", "--warmup", "1", "-o", out, script, str(steps))
    assert r.exit_code == 0, r.output
    assert "script end" in r.stdout  # it ended by itself
    meta = capuchin.load_trace(out).meta
    assert meta.iterations == [1, 2]
    if timed:
        assert len(meta.extra["plain_iteration_wall_s"]) == timed
        assert meta.plain_iteration_ns > 0
    else:
        assert meta.plain_iteration_ns is None
        assert "needs at least 6 optimizer steps" in meta.extra["plain_iteration_note"]
        assert "plain step not timed" in r.stderr


def test_failure_in_the_plain_iterations_keeps_the_trace(tmp_path):
    script = _script(tmp_path, after_backward="assert step < 4, 'late failure'")
    out = tmp_path / "o.parquet"
    r = _invoke("trace", "--iterations", "2", "--warmup", "1", "-o", out, script, "50")
    assert r.exit_code == 0, r.output
    assert "failed after the recorded iterations" in r.stderr and "late failure" in r.stderr
    meta = capuchin.load_trace(out).meta
    assert meta.iterations == [1, 2] and meta.plain_iteration_ns is None


def test_show_corrupt_parquet(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not really parquet")
    r = _invoke("show", bad)
    assert r.exit_code == 1
    (line,) = _error_lines(r)
    assert "bad.parquet" in line and "Parquet" in line


def test_show_foreign_parquet(tmp_path):
    foreign = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({"a": [1, 2, 3]}), foreign)
    r = _invoke("show", foreign)
    assert r.exit_code == 1
    (line,) = _error_lines(r)
    assert "foreign.parquet" in line and "not a capuchin trace" in line


def test_show_missing_file(tmp_path):
    r = _invoke("show", tmp_path / "missing.parquet")
    assert r.exit_code == 1
    (line,) = _error_lines(r)
    assert "missing.parquet" in line


@pytest.mark.parametrize("opt", ["--plot", "--chrome"])
def test_show_plot_options_are_for_plans(tmp_path, opt):
    trace = tmp_path / "t.parquet"
    script = _script(tmp_path)
    assert _invoke("trace", "--iterations", "1", "-o", trace, script).exit_code == 0
    r = _invoke("show", trace, opt, tmp_path / "x.png")
    assert r.exit_code == 1 and "apply to plans" in r.stderr


def test_api_tracer_in_process(tmp_path):
    """The Python API: the with-block stops the training after the recorded iterations."""
    import torch

    model = torch.nn.Linear(8, 2)
    opt = torch.optim.Adam(model.parameters())
    done = []
    out = tmp_path / "api.parquet"
    with capuchin.Tracer(out, iterations=2, warmup=1, log=None):
        for step in range(100):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            done.append(step)
    # warm-up + 2 recorded + 1 plain warm-up + 1 untimed plain step + 2 plain steps + 3 rounds
    # of a plain step and the runtime on its hot, guarded and slow paths, and a warm-up of the
    # runtime: 15; stopped inside the last (Note [Plain step], Note [The runtime in the script's
    # steps] in runtime/calibrate.py)
    assert len(done) == 19
    t = capuchin.load_trace(out)
    assert t.meta.iterations == [1, 2] and t.meta.regular
    assert set(t.ops["phase"]) == {"forward", "backward", "optimizer"}
    with pytest.raises(capuchin.CapuchinError, match="exists; use --force"):
        with capuchin.Tracer(out, log=None):
            pass


def test_two_optimizers_and_accumulation_end_to_end(tmp_path):
    """Through `capuchin trace`: two optimizers stepping together and 2-step gradient accumulation
    make one regular iteration each, holding two forward passes and both optimizers' ops."""
    script = tmp_path / "two.py"
    script.write_text(
        textwrap.dedent("""
        import torch
        torch.manual_seed(0)
        enc, head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)
        o1 = torch.optim.SGD(enc.parameters(), lr=0.1, momentum=0.9)
        o2 = torch.optim.Adam(head.parameters())
        for step in range(6):
            o1.zero_grad(); o2.zero_grad()
            for micro in range(2):
                head(enc(torch.randn(8, 16)).relu()).square().mean().backward()
            o1.step(); o2.step()
    """)
    )
    out = tmp_path / "two.parquet"
    r = _invoke("trace", "--iterations", "2", "-o", out, script)
    assert r.exit_code == 0, r.output
    trace = capuchin.load_trace(out)
    assert trace.meta.regular and trace.meta.iterations == [1, 2]
    ops = trace.ops[trace.ops["iteration"] == 2]
    assert (ops["op_name"] == "aten.addmm.default").sum() == 4  # 2 layers x 2 micro-batches
    opt = ops[ops["phase"] == "optimizer"]
    assert len(opt) and opt["op_index"].min() > ops[ops["phase"] == "backward"]["op_index"].max()
    assert {"aten.lerp_.Scalar", "aten.mul_.Tensor"} <= set(opt["op_name"])  # Adam and SGD


def test_plain_iterations_run_without_the_tracer_mode_or_profiler(tmp_path):
    """Note [Plain step]: the timed iterations see neither the dispatch mode nor the profiler."""
    import torch
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    out = tmp_path / "api.parquet"
    with capuchin.Tracer(out, iterations=2, warmup=1, log=None, plain_steps=2):
        for _ in range(100):
            mode = _get_current_dispatch_mode()
            seen.append((type(mode).__name__ if mode else None, torch.autograd._profiler_enabled()))
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    # the mode: the tracer's in 0-2 (traced) and 3 (the plain warm-up); then an untimed plain
    # step (no mode: 4), one plain step before the probe (no mode: 5) and two rounds of a plain
    # step (no mode: 6 and 11) and the runtime's mode on its hot, guarded and slow paths (Note
    # [The runtime in the script's steps] in runtime/calibrate.py), the first round with a
    # warm-up of the runtime (7). The profiler starts at the first op of iteration 1 and stops at
    # the first op of 3, which ends 2: at the top of each loop body it is on in 2 and 3 only
    tracer, runtime = "_TraceMode", "TrackerMode"
    modes = [tracer] * 4 + [None] * 3 + [runtime] * 4 + [None] + [runtime] * 3
    assert [m for m, _ in seen] == modes
    assert [p for _, p in seen] == [False, False, True, True] + [False] * 11
    assert _get_current_dispatch_mode() is None
    meta = capuchin.load_trace(out).meta
    assert len(meta.extra["plain_iteration_wall_s"]) == 2 and meta.plain_iteration_ns > 0

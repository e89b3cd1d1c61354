"""`capuchin max-batch` faults of the third fault probe (../shared/reports/faults.md, S3, S7, U2,
U4): an option that changes nothing, a script that stops before the verifying run's steps,
signals during the search, and option values that are not numbers or names."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from capuchin.cli import main
from capuchin.errors import EXIT_INTERRUPTED, EXIT_TERMINATED
from capuchin.maxbatch import MaxBatchError, max_batch
from click.testing import CliRunner

from .test_cli_faults import _default_sigint

# parse_known_args: any option is accepted, --batch included, and only --steps is used
IGNORES = """
import argparse
import torch
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=4)
a, _ = p.parse_known_args()
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.01)
for _ in range(a.steps):
    loss = m(torch.randn(16, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

# uses --batch and trains --steps steps; SLOW: each step sleeps and MARK is written once started
USES = """
import argparse, os, time
from pathlib import Path
import torch
p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=4)
p.add_argument("--steps", type=int, default=3)
a = p.parse_args()
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.01)
for _ in range(a.steps):
    if os.environ.get("SLOW"):
        Path(os.environ["SLOW"]).write_text("started")
        time.sleep(1)
    loss = m(torch.randn(a.batch, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _one_line_error(args) -> str:
    res = CliRunner().invoke(main, ["max-batch", *map(str, args)])
    assert res.exit_code == 1, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith("max-batch:")]
    assert len(lines) == 1 and lines[0].startswith("capuchin: error: "), res.stderr
    assert "Traceback" not in res.output
    return lines[0]


def test_an_option_that_does_not_change_memory_is_named_not_answered(tmp_path):
    """S3: every value traced has the same peak; the search said 'largest 8' before."""
    script = tmp_path / "ignores.py"
    script.write_text(IGNORES)
    with pytest.raises(MaxBatchError, match="--batch does not change the script's memory"):
        max_batch(script, memory="64M", arg="--batch", max_value=2, compare=(), log=None)


@pytest.mark.parametrize("arg", ["", "--", " ", "-", "--batch size"])
def test_an_arg_that_is_not_an_option_name_is_refused(tmp_path, arg):
    script = tmp_path / "uses.py"
    script.write_text(USES)
    line = _one_line_error(["--memory", "64M", "--arg", arg, "--no-verify", script])
    assert "expected an option name" in line


def test_max_overhead_nan_is_refused(tmp_path):
    """U4: nan compared false with every bound and let the search choose 0."""
    script = tmp_path / "uses.py"
    script.write_text(USES)
    line = _one_line_error(
        ["--memory", "64M", "--arg", "--batch", "--max-overhead", "nan", "--no-verify", script]
    )
    assert "--max-overhead nan%: must be a percentage >= 0" in line


def test_verified_says_how_many_steps_ran(tmp_path):
    """S7: the script stops after 3 steps; the verifying run was asked for 50."""
    script = tmp_path / "uses.py"
    script.write_text(USES)
    r = max_batch(
        script, ["--steps", "3"], memory="64M", arg="--batch", min_value=4, max_value=4,
        steps=50, compare=(), log=None,
    )  # fmt: skip
    assert r.verify_steps == 50 and r.verified_steps == 3
    assert r.runs["capuchin"]["steps"] == 3
    assert "verified: 3 steps (of --steps 50: the script stopped) at --batch 4" in r.summary()


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, code, says",
    [
        (signal.SIGINT, EXIT_INTERRUPTED, "capuchin: interrupted"),
        (signal.SIGTERM, EXIT_TERMINATED, "capuchin: terminated"),
    ],
)
def test_a_signal_during_the_search_is_the_users_not_the_scripts(tmp_path, sig, code, says):
    """U2: the search turned KeyboardInterrupt and Terminated into the script's failure (rc 1)."""
    script = tmp_path / "uses.py"
    script.write_text(USES)
    mark = tmp_path / "started"
    proc = subprocess.Popen(
        [sys.executable, "-m", "capuchin.cli", "max-batch", "--memory", "64M", "--arg", "--batch",
         "--compare", "", "--max", "4", str(script), "--steps", "30"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "SLOW": str(mark)},
        preexec_fn=_default_sigint,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not mark.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the script never started"
            time.sleep(0.05)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1] == says, err
    assert "raised" not in err


def test_an_option_that_sets_the_steps_is_named_without_tracer_options(tmp_path):
    """U10: `--arg --steps` made the script stop after 1 step; the message advised --warmup,
    an option max-batch does not have."""
    script = tmp_path / "uses.py"
    script.write_text(USES)
    line = _one_line_error(["--memory", "64M", "--arg", "--steps", "--compare", "", script])
    assert "at --steps 1 the script made 1 optimizer step(s), too few to trace" in line
    assert "--warmup" not in line

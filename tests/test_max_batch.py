"""`capuchin max-batch` / `capuchin.max_batch` (Note [Max-batch search] in maxbatch.py): the
search, the verifying run, and one clear line for each kind of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import capuchin
import pytest
import torch
from capuchin.cli import main
from capuchin.maxbatch import MaxBatchError, run_steps
from capuchin.tracer.reader import load_trace
from capuchin.tracer.script import trace_script
from capuchin.tracer.summary import summarize
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "traces"

TINY = """
import argparse
import torch
p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=4)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--fail-above", type=int, default=0)
a = p.parse_args()
if a.fail_above and a.batch > a.fail_above:
    raise ValueError(f"batch {a.batch} is larger than the dataset")
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128),
                        torch.nn.Tanh(), torch.nn.Linear(128, 128), torch.nn.Tanh(),
                        torch.nn.Linear(128, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
for _ in range(a.steps):
    x = torch.randn(a.batch, 64)
    loss = m(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("mb") / "tiny.py"
    path.write_text(TINY)
    return path


def _peak(script, args, tmp_path, name):
    out = trace_script(
        script,
        args,
        output=tmp_path / f"{name}.parquet",
        iterations=1,
        device="cpu",
        log=lambda line: None,
    )
    return summarize(load_trace(out)).peak_bytes


def _one_line_error(args):
    res = CliRunner().invoke(main, ["max-batch", *args])
    assert res.exit_code != 0, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith("max-batch:")]
    assert len(lines) == 1 and lines[0].startswith("capuchin: error: "), res.stderr
    return lines[0]


def test_unknown_arg_is_one_clear_line(tiny):
    line = _one_line_error(["--memory", "64M", "--arg", "--bsz", "--no-verify", str(tiny)])
    assert "does not accept --bsz" in line and str(tiny) in line


def test_memory_below_the_smallest_batch(tiny):
    line = _one_line_error(["--memory", "64K", "--arg", "--batch", "--no-verify", str(tiny)])
    assert "below what --batch 1 needs" in line
    assert "memory 64.00 KiB (65536 B)" in line


def test_script_failing_at_some_batch(tiny):
    line = _one_line_error(
        [
            "--memory",
            "64M",
            "--arg",
            "batch",
            "--compare",
            "",
            "--no-verify",
            "--max",
            "64",
            str(tiny),
            "--fail-above",
            "4",
        ]
    )
    assert "ValueError at --batch 8" in line and "larger than the dataset" in line


def test_bad_options():
    assert "percentage" in _one_line_error(
        ["--memory", "50%", "--arg", "--batch", str(TRACES / "cnn.py")]
    )
    assert "max-overhead" in _one_line_error(
        ["--memory", "8M", "--arg", "--batch", "--max-overhead", "lots", str(TRACES / "cnn.py")]
    )


@pytest.mark.slow
def test_search_finds_the_exact_limits_and_verifies(tiny, tmp_path):
    memory = _peak(tiny, ["--batch", "1024"], tmp_path, "ref") // 2
    res = CliRunner().invoke(
        main,
        [
            "max-batch",
            "--memory",
            str(memory),
            "--arg",
            "--batch",
            "--compare",
            "swap",
            "--steps",
            "3",
            "--min",
            "128",
            "--json",
            str(tiny),
        ],
    )
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    for key in (
        "memory_bytes",
        "unmanaged_max",
        "max_by_policy",
        "policy",
        "chosen",
        "verified_peak_bytes",
        "time_per_sample_ratio",
    ):
        assert key in r
    assert r["memory_bytes"] == memory and r["policy"] == "capuchin"
    u, c = r["unmanaged_max"], r["chosen"]
    assert r["max_by_policy"]["capuchin"] == c and "swap" in r["max_by_policy"]
    # unmanaged: the exact largest batch whose (independently traced) peak fits
    assert _peak(tiny, ["--batch", str(u)], tmp_path, "u") <= memory
    assert _peak(tiny, ["--batch", str(u + 1)], tmp_path, "u1") > memory
    assert c > u
    assert r["verified_peak_bytes"] <= 1.05 * memory
    assert r["time_per_sample_ratio"] > 0
    seen = {cand["value"] for cand in r["candidates"]}
    assert {128, 256, c, c + 1} <= seen  # doubling from --min, bisection down to c / c + 1


def test_api_is_the_cli(tiny, tmp_path):
    assert capuchin.max_batch is not None
    with pytest.raises(MaxBatchError, match="does not accept --nope"):
        capuchin.max_batch(tiny, memory="64M", arg="nope", verify=False, log=None)


# ---- the must-show runs: half the unmanaged peak at a small batch ------------------------------

CASES = [("cnn.py", 8), ("transformer.py", 16), ("hf_resnet.py", 16)]


@pytest.mark.slow
@pytest.mark.parametrize("script,ref_batch", CASES, ids=[c[0] for c in CASES])
def test_max_batch_doubles_the_unmanaged_batch(script, ref_batch, tmp_path):
    if script.startswith("hf_"):
        pytest.importorskip("transformers")
    path = TRACES / script
    memory = _peak(path, ["--batch", str(ref_batch)], tmp_path, "ref") // 2
    r = capuchin.max_batch(
        path, [], memory=memory, arg="--batch", compare=(), steps=4, keep_state=True, log=None
    )
    assert r.unmanaged_max >= 1
    assert r.chosen >= 2 * r.unmanaged_max, r.summary()
    assert r.verified_peak_bytes <= 1.05 * memory, r.summary()
    # bit-identical to plain training at that batch, the same number of steps
    plain = run_steps(path, ["--batch", str(r.chosen)], 4, plan=None, keep_state=True)
    assert plain.state.keys() == r.verified_state.keys()
    bad = [k for k in plain.state if not torch.equal(plain.state[k], r.verified_state[k])]
    assert not bad, bad[:5]


@pytest.mark.slow
def test_runtime_modes_with_no_plan_are_searched_by_real_runs(tmp_path):
    """Note [Runtime modes]: dynamic mode and LRU passive mode as comparison modes: each one's
    largest batch was run under the memory (peak within 1.05x), the next batch up was not, and
    dynamic mode's training at its largest batch is bitwise plain training's."""
    path = TRACES / "cnn.py"
    memory = _peak(path, ["--batch", "8"], tmp_path, "ref") // 2
    r = capuchin.max_batch(
        path,
        [],
        memory=memory,
        arg="--batch",
        compare=("dynamic", "lru"),
        steps=3,
        min_value=4,
        max_value=64,
        verify=False,
        log=None,
    )
    for mode in ("dynamic", "lru"):
        v = r.max_by_policy[mode]
        assert v > r.unmanaged_max, r.summary()
        assert r.runs[mode]["value"] == v
        assert r.runs[mode]["peak_bytes"] <= 1.05 * memory, r.summary()
        if v < 64:  # the search stopped because the next value up did not fit
            up = run_steps(path, ["--batch", str(v + 1)], 3, mode=mode, budget_bytes=memory)
            assert up.peak_bytes > 1.05 * memory, (mode, v, up.peak_bytes, memory)
    v = r.max_by_policy["dynamic"]
    args = ["--batch", str(v)]
    got = run_steps(path, args, 3, mode="dynamic", budget_bytes=memory, keep_state=True)
    plain = run_steps(path, args, 3, plan=None, keep_state=True)
    assert plain.state.keys() == got.state.keys()
    assert not [k for k in plain.state if not torch.equal(plain.state[k], got.state[k])]
    assert "dynamic" in r.summary() and "lru" in r.summary()

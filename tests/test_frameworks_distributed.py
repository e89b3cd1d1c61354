"""torchrun jobs (2 ranks, gloo on CPU): per-rank trace, plan and run (Note [Per-rank files] in
distributed.py), collectives never evicted or replayed (Note [Collectives] in
planner/problem.py), DDP's irregular second iteration (Note [Distributed warm-up]), FSDP2. Each
rank's final state (model state_dict, gradients, optimizer state) is compared with torch.equal
against the same job without capuchin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import capuchin
import pytest
import torch
from capuchin.distributed import per_rank, rank_path, ranked_files, tagged, world
from capuchin.planner.api import plan_files
from capuchin.planner.plan import load_plan
from capuchin.planner.problem import Problem
from capuchin.runtime.engine import rank_plan_path
from capuchin.tracer.reader import load_trace

HERE = Path(__file__).resolve().parent / "frameworks"
REPO = Path(__file__).resolve().parents[1]  # the repository root: the package itself
ROOT = Path(capuchin.__file__).resolve().parents[1]  # the folder above the imported package


def test_per_rank_names(monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert world() == (0, 1) and per_rank("t.parquet") == Path("t.parquet")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert world() == (1, 2)
    assert per_rank("out/t.parquet") == Path("out/t.rank1.parquet")
    assert tagged("capuchin: iteration 2: recorded") == "capuchin[rank 1]: iteration 2: recorded"
    assert rank_path("r.json", 3) == Path("r.rank3.json")
    # a plan: this rank's when it exists, else the one plan for every rank
    (tmp_path / "p.json").write_text("{}")
    assert rank_plan_path(tmp_path / "p.json") == tmp_path / "p.json"
    (tmp_path / "p.rank1.json").write_text("{}")
    assert rank_plan_path(tmp_path / "p.json") == tmp_path / "p.rank1.json"


@pytest.mark.slow
def test_plan_plans_every_rank(tmp_path):
    """`capuchin plan t.parquet -o p.json` with t.rank0/t.rank1.parquet writes p.rank{R}.json."""
    src = REPO / "traces" / "mlp.trace.parquet"
    for r in (0, 1):
        (tmp_path / f"t.rank{r}.parquet").write_bytes(src.read_bytes())
    assert sorted(ranked_files(tmp_path / "t.parquet")) == [0, 1]
    out = plan_files(tmp_path / "t.parquet", "80%", tmp_path / "p.json")
    assert [p.name for _, p in out] == ["p.rank0.json", "p.rank1.json"]
    assert all(load_plan(p).decisions for _, p in out)


def test_python_dash_m_capuchin():
    r = subprocess.run(
        [sys.executable, "-m", "capuchin", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert r.returncode == 0 and "trace" in r.stdout and "Usage: capuchin" in r.stdout, r


def _torchrun(args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            *args,
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _job(tmp_path, extra, budget):
    script = str(HERE / "ddp_mlp.py")
    _torchrun([script, *extra, "--out", "plain.pt"], tmp_path)
    tr = _torchrun(["-m", "capuchin", "trace", "-o", "t.parquet", script, *extra], tmp_path)
    for rank in (0, 1):  # the ranks' progress lines can be told apart
        assert f"capuchin[rank {rank}]: iteration" in tr.stderr, tr.stderr[-2000:]
    assert "\ncapuchin: iteration" not in "\n" + tr.stderr
    assert sorted(ranked_files(tmp_path / "t.parquet")) == [0, 1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", "capuchin", "plan", "t.parquet", "--budget", budget, "-o", "p.json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    run = _torchrun(
        [
            "-m",
            "capuchin",
            "run",
            "--plan",
            "p.json",
            "--report",
            "r.json",
            script,
            *extra,
            "--out",
            "cap.pt",
        ],
        tmp_path,
    )
    assert "diverges" not in run.stderr, run.stderr
    for rank in (0, 1):
        trace = load_trace(tmp_path / f"t.rank{rank}.parquet")
        assert trace.meta.regular, "iterations from 2 on are regular (Note [Distributed warm-up])"
        problem = Problem.from_trace(trace)
        plan = load_plan(tmp_path / f"p.rank{rank}.json")
        comm = {s for s, info in problem.storages.items() if info.communicated}
        assert comm, "the trace records the collectives"
        assert not any(problem.storages[s].evictable for s in comm)
        assert plan.decisions and not {d.storage_id for d in plan.decisions} & comm
        assert not any(
            problem.ops[k].name.startswith(("c10d.", "fsdp."))
            for d in plan.decisions
            for k in d.replay_ops
        )
        plain = torch.load(tmp_path / f"plain.rank{rank}.pt")
        got = torch.load(tmp_path / f"cap.rank{rank}.pt")
        assert len(plain) >= 40 and sorted(plain) == sorted(got)
        assert [k for k in plain if not torch.equal(plain[k], got[k])] == []
        rep = json.loads((tmp_path / f"r.rank{rank}.json").read_text())
        steady = [i for i in rep["iterations"] if i["complete"] and i["iteration"] >= 2]
        assert len(steady) == 4
        assert not any(i["diverged"] for i in steady) and all(i["evictions"] > 0 for i in steady)
        assert all(i["peak_bytes"] <= plan.budget_bytes for i in steady), (
            rank,
            [i["peak_bytes"] for i in steady],
            plan.budget_bytes,
        )
    return tmp_path


@pytest.mark.slow
def test_ddp_two_gloo_ranks(tmp_path):
    _job(tmp_path, [], "70%")


@pytest.mark.slow
def test_fsdp2_two_gloo_ranks(tmp_path):
    """FSDP2 (fully_shard) runs on CPU with gloo in torch 2.13; its layers' activations can only
    be swapped (a replay would read an FSDP-managed weight)."""
    _job(tmp_path, ["--fsdp"], "75%")


@pytest.mark.slow
def test_ddp_two_gloo_ranks_under_cpu_load(tmp_path):
    """The DDP job three times while a process spins on the CPU: a rank once died of SIGSEGV on a
    busy host, likely dynamic mode evicting a gradient bucket that gloo's asynchronous all-reduce
    still read (now never: tests/test_runtime_collectives.py)."""
    burn = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for i in range(3):
            (tmp_path / str(i)).mkdir()
            _job(tmp_path / str(i), [], "70%")
    finally:
        burn.kill()
        burn.wait()

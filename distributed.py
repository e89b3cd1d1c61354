"""Per-rank files under torchrun (``torch.distributed``), without importing torch.

# Note: [Per-rank files]
# Under a world of several ranks (torchrun sets ``WORLD_SIZE`` and ``RANK`` in each process's
# environment) every rank traces, plans and runs its own share of the job: its own model shard,
# data and buckets, so its own trace and plan. The file names the user gives stay the job's names
# and each rank's file gets its rank before the suffix: ``-o t.parquet`` writes
# ``t.rank{R}.parquet``; ``capuchin plan t.parquet -o p.json`` (run once, outside torchrun) finds
# ``t.rank*.parquet`` and writes ``p.rank{R}.json`` for each; ``capuchin run --plan p.json
# --report r.json`` under torchrun loads ``p.rank{R}.json`` (or ``p.json`` itself when there is no
# per-rank plan: one plan for every rank) and writes ``r.rank{R}.json``. A single process (no
# ``WORLD_SIZE``, or 1) keeps the names as given.

# Note: [Distributed warm-up]
# DistributedDataParallel rebuilds its gradient buckets in its second iteration (iteration 1, in
# the order the gradients became ready in iteration 0), so that iteration's ops differ from the
# later ones (measured: 357 ops against 327, the first difference at op 2). Under a world of
# several ranks the tracer therefore warms up for 2 iterations by default, and the runtime
# checks plans from iteration 2 on: iteration 1 runs under the budget guard like iteration 0,
# with no divergence warning and no foreign-plan refusal.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

_RANKED = re.compile(r"\.rank(\d+)$")


def world() -> tuple[int, int]:
    """(rank, world size) of this process as torchrun set them; (0, 1) outside a world."""
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0, 1
    return (rank, size) if size > 1 else (0, 1)


def tagged(line: str) -> str:
    """One of capuchin's stderr lines as this process prints it: under a world of several ranks,
    a leading ``capuchin:`` becomes ``capuchin[rank R]:``, so the ranks' interleaved progress
    lines, warnings and errors can be told apart."""
    rank, size = world()
    if size > 1 and line.startswith("capuchin:"):
        return f"capuchin[rank {rank}]:{line[len('capuchin:') :]}"
    return line


def say(line: str) -> None:
    """Print ``tagged(line)`` to stderr."""
    print(tagged(line), file=sys.stderr, flush=True)


def rank_path(path: str | os.PathLike, rank: int) -> Path:
    """``t.parquet`` -> ``t.rank{rank}.parquet`` (the last suffix stays last)."""
    p = Path(path)
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix}")


def per_rank(path: str | os.PathLike) -> Path:
    """``path`` for this process: its rank's name under a world of several ranks, else as is."""
    rank, size = world()
    return rank_path(path, rank) if size > 1 else Path(path)


def ranked_files(path: str | os.PathLike) -> dict[int, Path]:
    """The per-rank files of ``path`` that exist (``t.rank0.parquet``, ...), by rank."""
    p = Path(path)
    found = {}
    for f in p.parent.glob(f"{p.stem}.rank*{p.suffix}"):
        m = _RANKED.search(f.name[: len(f.name) - len(p.suffix)] if p.suffix else f.name)
        if m:
            found[int(m.group(1))] = f
    return dict(sorted(found.items()))


def default_warmup() -> int:
    """Iterations the tracer runs before recording: 1 (the optimizer creates its state in
    iteration 0), 2 under a world of several ranks (Note [Distributed warm-up])."""
    return 2 if world()[1] > 1 else 1

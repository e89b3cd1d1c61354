"""Largest batch that trains within one memory size: unmanaged, sqrt(n) checkpointing, DTR and
capuchin (and swap-only, recompute-only), with the measured time per sample of each at its own
largest batch. One table for docs/max-batch.md.

    python benchmarks/max_batch.py                       # every model below
    python benchmarks/max_batch.py --models cnn,mlp --steps 5 --json out.json

For each model the memory is half the unmanaged peak at a small reference batch (traced first);
then ``capuchin.max_batch(..., time_all=True)`` searches every policy and runs each at its own
largest batch for ``--steps`` steps (plain training for unmanaged, a ``capuchin.Runtime`` under
the policy's plan otherwise). Times are the median step-to-step wall time / batch, one intra-op
thread; on a shared host compare only numbers from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT.parent))

import capuchin  # noqa: E402
from capuchin.tracer.script import trace_script  # noqa: E402
from capuchin.tracer.summary import summarize  # noqa: E402

T = ROOT / "traces"
# name -> (script, extra args, reference batch, --min)
MODELS = {
    "cnn": (T / "cnn.py", [], 8, 1),
    "transformer": (T / "transformer.py", [], 16, 1),
    "mlp": (T / "mlp.py", [], 2048, 64),
    "hf_resnet": (T / "hf_resnet.py", [], 16, 1),
    "hf_bert": (T / "hf_bert.py", [], 8, 1),
}
SHOWN = ("checkpoint-sqrt", "dtr", "swap", "recompute")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write every result here")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    rows, results = [], {}
    for name in args.models.split(","):
        script, extra, ref, lo = MODELS[name]
        with tempfile.TemporaryDirectory() as tmp:
            t = trace_script(
                script,
                [*extra, "--batch", str(ref)],
                output=Path(tmp) / "r.parquet",
                iterations=1,
                device="cpu",
                log=None,
            )
            peak = summarize(capuchin.load_trace(t)).peak_bytes
        memory = peak // 2
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        r = capuchin.max_batch(
            script,
            extra,
            memory=memory,
            arg="--batch",
            min_value=lo,
            steps=args.steps,
            compare=SHOWN,
            time_all=True,
        )
        took = time.perf_counter() - t0
        load1 = os.getloadavg()[0]
        d = r.to_dict()
        d.update(
            reference_batch=ref,
            reference_peak_bytes=peak,
            seconds=round(took, 1),
            load=[round(load0, 1), round(load1, 1)],
        )
        results[name] = d
        rows.append(_row(name, ref, r, load0, load1))
        print(rows[-1], flush=True)
    print()
    print(
        "| model | memory (half the peak at batch) | unmanaged | checkpoint-sqrt | dtr | "
        "swap | recompute | capuchin | capuchin / unmanaged | verified peak / memory | "
        "load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True))


def _cell(r, policy: str) -> str:
    v = r.unmanaged_max if policy == "unmanaged" else r.max_by_policy.get(policy)
    if v is None:
        return f"n/a ({r.not_applicable.get(policy, '')[:40]})"
    run = r.runs.get(policy)
    t = run.get("time_per_sample_s") if run else None
    return f"{v}" + (f" ({t * 1e3:.2f} ms)" if t else "")


def _row(name, ref, r, load0, load1) -> str:
    ratio = f"{r.chosen / r.unmanaged_max:.2f}x" if r.unmanaged_max else "-"
    ver = f"{r.verified_peak_bytes / r.memory_bytes:.3f}" if r.verified_peak_bytes else "-"
    cells = " | ".join(_cell(r, p) for p in ("unmanaged", *SHOWN, r.policy))
    return (
        f"| {name} | {r.memory_bytes / 2**20:.1f} MiB ({ref}) | {cells} | {ratio} | {ver} | "
        f"{load0:.1f}-{load1:.1f} |"
    )


if __name__ == "__main__":
    main()

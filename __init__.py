"""capuchin: tensor-based GPU memory management for PyTorch training.

Three stages, one file format between each pair (see README.md):

    capuchin.Tracer(...)      -> trace.parquet   (tracer/, needs torch)
    capuchin.make_plan(...)   -> plan.json       (planner/, never imports torch)
    capuchin.Runtime(plan)    -> training under the budget (runtime/, needs torch)

Names are resolved lazily so that ``import capuchin.planner`` does not import torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it (relative to this package)
_EXPORTS = {
    "CapuchinError": ".errors",
    "Tracer": ".tracing",
    "step": ".tracer.hooks",
    "load_trace": ".tracer.reader",
    "Trace": ".tracer.reader",
    "load_plan": ".planner.plan",
    "Plan": ".planner.plan",
    "make_plan": ".planner.api",
    "simulate_plan": ".planner.simulator",
    "compare_policies": ".planner.compare",
    "plans_frame": ".planner.views",
    "memory_curves": ".planner.views",
    "plot_plans": ".planner.views",
    "parse_budget": ".planner.budget",
    "Runtime": ".runtime.engine",
    "max_batch": ".maxbatch",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name], __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'capuchin' has no attribute {name!r}")

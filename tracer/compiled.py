"""``torch.compile`` and CUDA graph capture under capuchin: refused up front (Note [torch.compile],
Note [CUDA graphs]).

# Note: [torch.compile]
# The tracer and the runtime are ``TorchDispatchMode``s that must see every op of the script:
# ids, iteration boundaries and the plan's actions are op by op. TorchDynamo does not compile a
# frame while a dispatch mode is active unless the mode declares itself an infra mode or sets
# ``ignore_compile_internals()`` (torch/_dynamo/convert_frame.py: "non-infra torch dispatch mode
# present, this is not supported today in torch.compile"): it silently runs the frame eagerly.
# The script would then train eagerly under capuchin and compiled without it, and the results
# differ (eager and Inductor kernels round differently). Declaring capuchin's modes
# ``ignore_compile_internals`` would let Dynamo compile, but the compiled code (Inductor's C++ or
# Triton kernels, its own buffer allocations, the activations its forward graph saves for its
# backward graph) then runs without dispatching most of its ops: the trace would miss the
# tensors that live across a compiled region and the runtime could neither evict nor restore
# them, nor keep the budget. So while a tracer or a runtime is installed, ``torch.compile`` and
# ``torch._dynamo.optimize`` raise ``CompileRefused`` at the call, before the script trains:
# one line naming the script's line, why, and what to do. A function compiled before capuchin
# started (the Python API used after ``torch.compile``) is refused at its first call, where
# Dynamo is about to skip it for the mode (``CatchErrorsWrapper._handle_skip`` with that
# reason). When Dynamo is disabled (``TORCHDYNAMO_DISABLE=1``, ``torch._dynamo.config.disable``),
# ``torch.compile`` is a no-op and is let through: the script then trains eagerly with and
# without capuchin alike.

# Note: [CUDA graphs]
# A captured CUDA graph replays its kernels without dispatching a single op: the tracer would
# record the capture once and never the replays, and the runtime could neither evict nor
# restore the tensors the replays read and write (they are the graph's static buffers, read by
# address). The capture itself forbids what the runtime does around ops: querying and
# synchronizing events, reading the RNG state, allocating outside the graph's private pool (an
# error or a silently captured copy). So while a tracer or a runtime with a dispatch mode is
# installed, entering ``torch.cuda.graph`` (which ``make_graphed_callables`` also uses) and
# ``CUDAGraph.capture_begin`` raise ``CudaGraphRefused`` before anything is captured: one line
# naming the script's line. The empty plan installs no dispatch mode and lets graphs be.
"""

from __future__ import annotations

import sys

import torch

from ..errors import CapuchinError


class CompileRefused(CapuchinError):
    """The script called torch.compile while capuchin traces or runs it."""


class CudaGraphRefused(CapuchinError):
    """The script began a CUDA graph capture while capuchin traces or runs it."""


def _caller() -> str:
    """The innermost frame of the script: outside torch, capuchin's own modules and runpy."""
    import os

    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    own = {pkg, *(os.path.join(pkg, d) for d in ("tracer", "runtime", "planner"))}
    torch_dir = os.path.dirname(torch.__file__)

    def skipped(fn: str) -> bool:
        return (
            fn.startswith(("<", torch_dir))
            or os.path.dirname(os.path.abspath(fn)) in own
            or os.path.basename(fn) == "runpy.py"
        )

    f = sys._getframe(1)
    while f is not None and skipped(f.f_code.co_filename):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "the script"


def _disabled() -> bool:
    try:
        return bool(torch._dynamo.config.disable)
    except AttributeError:
        return False


def _graph_refusal(what: str) -> CudaGraphRefused:
    return CudaGraphRefused(
        f"{_caller()}: {what} cannot run under capuchin: a captured CUDA graph replays kernels "
        "without dispatching ops, so capuchin could neither see nor evict and restore their "
        "tensors, and the capture forbids the runtime's own event queries, syncs and "
        "allocations; remove the capture to trace or run the script under capuchin"
    )


class GraphGuard:
    """Replaces ``torch.cuda.graph.__init__`` and ``CUDAGraph.capture_begin`` while installed
    (Note [CUDA graphs]); installed and removed with ``CompileGuard``."""

    saved: tuple = ()

    @classmethod
    def install(cls) -> None:
        graphs = getattr(torch.cuda, "graphs", None)
        if graphs is None or cls.saved:
            return
        cls.saved = (graphs, graphs.graph.__init__, graphs.CUDAGraph.capture_begin)

        def capuchin_graph(self, *args, **kwargs):
            raise _graph_refusal("torch.cuda.graph")

        def capuchin_capture_begin(self, *args, **kwargs):
            raise _graph_refusal("CUDAGraph.capture_begin")

        graphs.graph.__init__ = capuchin_graph
        graphs.CUDAGraph.capture_begin = capuchin_capture_begin

    @classmethod
    def uninstall(cls) -> None:
        if cls.saved:
            graphs, init, capture_begin = cls.saved
            graphs.graph.__init__ = init
            graphs.CUDAGraph.capture_begin = capture_begin
            cls.saved = ()


class CompileGuard:
    """Replaces ``torch.compile`` and ``torch._dynamo.optimize`` while installed (nested
    installs are counted), and refuses CUDA graph capture (``GraphGuard``)."""

    depth = 0
    saved: tuple = ()

    @classmethod
    def install(cls) -> None:
        cls.depth += 1
        if cls.depth > 1:
            return
        import torch._dynamo

        GraphGuard.install()  # Note [CUDA graphs]
        wrapper = _skip_handler_owner()
        handle_skip = getattr(wrapper, "_handle_skip", None)
        cls.saved = (torch.compile, torch._dynamo.optimize, wrapper, handle_skip)
        compile_, optimize = torch.compile, torch._dynamo.optimize

        def capuchin_compile(*args, **kwargs):
            if _disabled():
                return compile_(*args, **kwargs)
            raise CompileRefused(
                f"{_caller()}: torch.compile cannot run under capuchin: TorchDynamo does not "
                "compile while capuchin's dispatch mode watches every op, so the script would "
                "silently train eagerly, with results that differ from the compiled run; "
                "remove torch.compile, or set TORCHDYNAMO_DISABLE=1 to train eagerly both with "
                "and without capuchin"
            )

        def capuchin_optimize(*args, **kwargs):
            if _disabled():
                return optimize(*args, **kwargs)
            raise CompileRefused(
                f"{_caller()}: torch._dynamo.optimize cannot run under capuchin (see "
                "torch.compile): remove it, or set TORCHDYNAMO_DISABLE=1"
            )

        def capuchin_handle_skip(self, result, frame):
            # a model compiled before capuchin started: Dynamo is about to skip it for the mode
            reason = getattr(result, "skip_reason", None) or ""
            if reason.startswith("non-infra torch dispatch mode") and not _disabled():
                raise CompileRefused(
                    f"{_caller()}: a function compiled by torch.compile ran under capuchin, which "
                    "TorchDynamo does not compile under (it would silently run eagerly, with "
                    "results that differ from the compiled run); remove torch.compile, or set "
                    "TORCHDYNAMO_DISABLE=1 to train eagerly both with and without capuchin"
                )
            return handle_skip(self, result, frame)

        torch.compile = capuchin_compile
        torch._dynamo.optimize = capuchin_optimize
        if handle_skip is not None:
            wrapper._handle_skip = capuchin_handle_skip

    @classmethod
    def uninstall(cls) -> None:
        cls.depth = max(0, cls.depth - 1)
        if cls.depth == 0 and cls.saved:
            compile_, optimize, wrapper, handle_skip = cls.saved
            torch.compile, torch._dynamo.optimize = compile_, optimize
            if handle_skip is not None:
                wrapper._handle_skip = handle_skip
            cls.saved = ()
            GraphGuard.uninstall()


def _skip_handler_owner():
    """Dynamo's ``CatchErrorsWrapper`` (whose ``_handle_skip`` sees a compiled frame about to be
    skipped for the mode), or None in a torch without it: there only a function compiled before
    capuchin started goes unrefused (Note [torch.compile])."""
    try:
        from torch._dynamo.convert_frame import CatchErrorsWrapper
    except ImportError:
        return None
    return CatchErrorsWrapper if hasattr(CatchErrorsWrapper, "_handle_skip") else None

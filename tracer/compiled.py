"""``torch.compile`` under capuchin: each compiled region is one op (Note [torch.compile]); CUDA
graph capture refused (Note [CUDA graphs]).

# Note: [torch.compile]
# The tracer and the runtime are ``TorchDispatchMode``s that must see every op of the script:
# ids, iteration boundaries and the plan's actions are op by op. TorchDynamo compiles under a
# dispatch mode only if the mode declares ``ignore_compile_internals()`` (else it silently runs
# the frame eagerly: torch/_dynamo/convert_frame.py, "non-infra torch dispatch mode present"),
# and Inductor's compiled code then runs its kernels without dispatching most of them. So while
# capuchin's modes are installed (``CompileGuard``):
#
# - the modes declare ``ignore_compile_internals()`` and ``supports_higher_order_operators``,
#   and ``torch._inductor.config.wrap_inductor_compiled_regions`` is on: each call of a compiled
#   forward or backward graph reaches the modes as ONE op, the higher-order op
#   ``inductor_compiled_code`` (torch/_inductor/output_code.py ``post_compile``), with every
#   tensor the region reads as its inputs and every tensor it returns as its outputs. The mode
#   pops itself while the region runs, so the region's own kernels and buffers are inside that
#   one op: its time and its scratch memory (tracer/timing.py) are the region's. The wrapper
#   calls the same compiled callable as without capuchin (it only routes the call through the
#   dispatcher while a mode is active), so no kernel changes: the run is bit-identical to the
#   compiled script without capuchin (tests/test_frameworks_compile.py). Eager ops between
#   regions (the loss, the optimizer, graph breaks) come one by one as before.
# - A region op is named ``inductor_compiled_code.<hash>`` (``region_info``): the hash of the
#   region's FX graph (``original_gm``: its code and its inputs' shapes and dtypes), so the same
#   region has the same name in the traced process and in the run, and a recompile for other
#   shapes is another op (a divergence, handled as any other). The saved activations are the
#   outputs of a forward region that a backward region reads; they are ordinary storages of the
#   trace, swapped like any other (evicted after the forward region, restored before the
#   backward region reads them). Inputs a region writes in place (Inductor keeps some input
#   mutations in the graph: batch norm's running statistics, a compiled optimizer step) are
#   its ``copy_`` nodes into placeholders, the op's written inputs.
# - A region is never replayed (``never_replayed`` in tracer/schema.py): its inputs are a list
#   the compiled code consumes, it may draw random numbers inside (Inductor's seeds), and its
#   internal buffers are not the script's. The planner swaps what a policy would recompute
#   through one.
# - Refused up front, with one line (``CompileRefused``), what cannot be managed exactly: CUDA
#   graphs (``mode="reduce-overhead"``/``"max-autotune"``, ``triton.cudagraphs``, the
#   ``cudagraphs`` backend: their replays read and write fixed addresses, which eviction frees);
#   compiled autograd (the backward becomes a compiled graph whose saved tensors no mode sees
#   by region); a backend other than ``inductor``, ``aot_eager`` and ``eager`` (code capuchin
#   cannot see into); Inductor's ``freezing`` (parameters become constants of the compiled
#   code, not region inputs); and a higher-order op other than ``inductor_compiled_code``
#   (``unsupported_hop``). The checks read the config and the options, so they need no GPU.
# - Functions compiled before capuchin's modes were installed hold regions compiled without the
#   wrapper, which the modes cannot see: Dynamo's caches are reset when the guard turns the
#   wrapper on (``torch._dynamo.reset()``; recompiling produces the same code).
# When Dynamo is disabled (``TORCHDYNAMO_DISABLE=1``, ``torch._dynamo.config.disable``),
# ``torch.compile`` is a no-op and the script trains eagerly with and without capuchin alike.
# The hooks (the wrapper flag, the ``inductor_compiled_code`` op, ``original_gm``,
# ``ignore_compile_internals``) are private to torch and were checked on torch 2.13.0. In a torch
# whose Inductor config has no ``wrap_inductor_compiled_regions``, regions cannot be made ops,
# so ``torch.compile`` is refused there while the guard is installed (``_region_wrapper``); where
# Dynamo has no ``CatchErrorsWrapper._handle_skip``, a function compiled under the script's own
# dispatch mode is not refused (``_skip_handler_owner``). Both are read, never assumed: the GPU
# machine's torch is older than the one this was written on.

# Note: [CUDA graphs]
# A captured CUDA graph replays its kernels without dispatching a single op: the tracer would
# record the capture once and never the replays, and the runtime could neither evict nor
# restore the tensors the replays read and write (the graph's static buffers, read by address).
# The capture itself forbids what the runtime does around ops: querying and synchronizing
# events, reading the RNG state, allocating outside the graph's private pool. So while the
# guard is installed (a tracer, a runtime with a dispatch mode), entering ``torch.cuda.graph``
# (which ``make_graphed_callables`` also uses) and ``CUDAGraph.capture_begin`` raise
# ``CudaGraphRefused`` before anything is captured: one line naming the script's line
# (``GraphGuard``). torch.compile's own CUDA graphs are refused at the compile call (above).
# The empty plan installs no dispatch mode and lets graphs be.
"""

from __future__ import annotations

import hashlib
import sys

import torch

from ..errors import CapuchinError
from .schema import REGION_PREFIX

REGION_OP = REGION_PREFIX[:-1]  # the higher-order op's name
ALLOWED_BACKENDS = ("inductor", "aot_eager", "eager")


class CompileRefused(CapuchinError):
    """The script uses torch.compile in a way capuchin cannot manage exactly."""


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


def _cudagraph_options(mode, options) -> bool:
    """Whether ``torch.compile``'s ``mode`` or ``options`` turn on CUDA graphs."""
    if mode is not None:
        try:
            from torch._inductor import list_mode_options

            if list_mode_options(mode).get("triton.cudagraphs"):
                return True
        except RuntimeError:  # an unknown mode: torch.compile itself raises
            pass
    return bool((options or {}).get("triton.cudagraphs"))


def check_compile_call(backend, mode, options) -> None:
    """Refuse a ``torch.compile`` call that capuchin cannot manage exactly (Note [torch.compile])."""
    where = _caller()
    if _cudagraph_options(mode, options) or backend == "cudagraphs":
        what = f'mode="{mode}"' if mode is not None else "CUDA graphs"
        raise CompileRefused(
            f"{where}: torch.compile with {what} cannot run under capuchin: CUDA graphs replay "
            "kernels on fixed addresses, which capuchin's evictions free; use the default mode "
            'or mode="max-autotune-no-cudagraphs"'
        )
    name = backend if isinstance(backend, str) else getattr(backend, "compiler_name", None)
    if not isinstance(name, str):
        name = getattr(backend, "__name__", type(backend).__name__)
    if name not in ALLOWED_BACKENDS:
        raise CompileRefused(
            f"{where}: torch.compile with backend {name!r} cannot run under capuchin, which "
            f"sees inside only the backends {', '.join(ALLOWED_BACKENDS)}"
        )
    opts = options or {}
    if opts.get("freezing"):
        raise CompileRefused(_freezing_reason(where))


def _freezing_reason(where: str) -> str:
    return (
        f"{where}: Inductor's freezing cannot run under capuchin: it makes the parameters "
        "constants of the compiled code, which capuchin can neither see nor account for; "
        "turn torch._inductor.config.freezing off"
    )


def check_config() -> None:
    """Refuse the global settings capuchin cannot manage (read at each compiled region call
    and at install): CUDA graphs, compiled autograd, freezing."""
    if _disabled():
        return
    import torch._dynamo.compiled_autograd as ca
    import torch._inductor.config as ic

    if torch._dynamo.config.compiled_autograd or ca.compiled_autograd_enabled:
        raise CompileRefused(
            f"{_caller()}: compiled autograd cannot run under capuchin: it compiles the "
            "backward pass into one graph whose saved tensors capuchin cannot see one by one; "
            "turn torch._dynamo.config.compiled_autograd off"
        )
    if ic.triton.cudagraphs:
        raise CompileRefused(
            f"{_caller()}: CUDA graphs (torch._inductor.config.triton.cudagraphs) cannot run "
            "under capuchin: their replays use fixed addresses, which capuchin's evictions free"
        )
    if ic.freezing:
        raise CompileRefused(_freezing_reason(_caller()))


def unsupported_hop(func) -> CompileRefused:
    """The refusal of a higher-order op other than a compiled region."""
    return CompileRefused(
        f"{_caller()}: the higher-order op {func.name()} cannot run under capuchin, which "
        f"manages only compiled regions ({REGION_OP}) as one op"
    )


def is_region(func) -> bool:
    """``func`` is the higher-order op of a compiled region."""
    return getattr(func, "_name", None) == REGION_OP and isinstance(
        func, torch._ops.HigherOrderOperator
    )


def is_hop(func) -> bool:
    return isinstance(func, torch._ops.HigherOrderOperator)


def region_facts(callable_) -> tuple[str, bool, tuple[int, ...]]:
    """(name, seeded, written input positions) of a compiled region (Note [torch.compile]),
    computed once per compiled callable. ``callable_`` is the op's first argument: an
    ``InductorCompiledCallable`` or its index in Inductor's side table."""
    from torch._higher_order_ops.wrap import _resolve_inductor_callable

    c = _resolve_inductor_callable(callable_)
    got = getattr(c, "_capuchin_facts", None)
    if got is not None:
        return got
    gm = c.original_gm
    h = hashlib.sha1()
    seeded = False
    writes: list[int] = []
    if gm is None:  # no graph to name it by: the generated module's source file
        code = c.compiled_callable
        h.update(getattr(getattr(code, "__code__", None), "co_filename", repr(code)).encode())
    else:
        h.update(gm.code.encode())
        placeholders = {}
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                placeholders[node] = len(placeholders)
                v = node.meta.get("val")
                shape = tuple(v.shape) if isinstance(v, torch.Tensor) else ()
                h.update(f"{shape}:{getattr(v, 'dtype', None)};".encode())
            elif node.op == "call_function":
                target = node.target
                if torch.Tag.nondeterministic_seeded in getattr(target, "tags", ()):
                    seeded = True
                schema = getattr(target, "_schema", None)
                if schema is None:
                    continue
                for arg, value in zip(schema.arguments, node.args, strict=False):
                    mutated = arg.alias_info is not None and arg.alias_info.is_write
                    if mutated and value in placeholders:
                        writes.append(placeholders[value])
    facts = (f"{REGION_PREFIX}{h.hexdigest()[:16]}", seeded, tuple(sorted(set(writes))))
    try:
        c._capuchin_facts = facts
    except AttributeError:
        pass
    return facts


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


def _skip_handler_owner():
    """Dynamo's ``CatchErrorsWrapper`` (whose ``_handle_skip`` sees a compiled frame about to be
    skipped for a dispatch mode), or None in a torch without it (Note [torch.compile])."""
    try:
        from torch._dynamo.convert_frame import CatchErrorsWrapper
    except ImportError:
        return None
    return CatchErrorsWrapper if hasattr(CatchErrorsWrapper, "_handle_skip") else None


def _region_wrapper() -> bool:
    """Whether this torch's Inductor can wrap compiled regions into one op (Note
    [torch.compile])."""
    import torch._inductor.config as ic

    try:
        ic.wrap_inductor_compiled_regions  # noqa: B018 - a config read that may raise
    except AttributeError:
        return False
    return True


class CompileGuard:
    """While installed (nested installs are counted): ``torch.compile`` and
    ``torch._dynamo.optimize`` check their arguments, Inductor wraps its compiled regions,
    and a function Dynamo would skip for another dispatch mode is refused."""

    depth = 0
    saved: tuple = ()
    wrap_was: bool | None = None

    @classmethod
    def install(cls) -> None:
        cls.depth += 1
        if cls.depth > 1:
            return
        import torch._dynamo
        import torch._inductor.config as ic

        GraphGuard.install()  # Note [CUDA graphs]
        wrapper = _skip_handler_owner()
        handle_skip = getattr(wrapper, "_handle_skip", None)
        cls.saved = (torch.compile, torch._dynamo.optimize, wrapper, handle_skip)
        compile_, optimize = torch.compile, torch._dynamo.optimize
        regions = _region_wrapper()
        cls.wrap_was = ic.wrap_inductor_compiled_regions if regions else None
        if regions and not cls.wrap_was:
            ic.wrap_inductor_compiled_regions = True
            torch._dynamo.reset()  # regions compiled without the wrapper (Note [torch.compile])

        def no_regions(what: str) -> CompileRefused:
            return CompileRefused(
                f"{_caller()}: {what} cannot run under capuchin with torch {torch.__version__}: "
                "its Inductor cannot make a compiled region one op "
                "(torch._inductor.config.wrap_inductor_compiled_regions), so capuchin would "
                "not see the region's tensors; remove it, or set TORCHDYNAMO_DISABLE=1 to "
                "train eagerly both with and without capuchin"
            )

        def capuchin_compile(model=None, **kwargs):
            if not _disabled():
                if not regions:
                    raise no_regions("torch.compile")
                check_compile_call(
                    kwargs.get("backend", "inductor"), kwargs.get("mode"), kwargs.get("options")
                )
            return compile_(model, **kwargs) if model is not None else compile_(**kwargs)

        def capuchin_optimize(*args, **kwargs):
            if not _disabled():
                if not regions:
                    raise no_regions("torch._dynamo.optimize")
                backend = args[0] if args else kwargs.get("backend", "inductor")
                options = getattr(backend, "config", None)  # torch.compile's wrapper of inductor
                check_compile_call(backend, None, options if isinstance(options, dict) else None)
            return optimize(*args, **kwargs)

        def capuchin_handle_skip(self, result, frame):
            # another dispatch mode (the script's own) makes Dynamo run the frame eagerly
            reason = getattr(result, "skip_reason", None) or ""
            if reason.startswith("non-infra torch dispatch mode") and not _disabled():
                raise CompileRefused(
                    f"{_caller()}: a function compiled by torch.compile ran under a dispatch "
                    "mode that TorchDynamo does not compile under, so it would silently run "
                    "eagerly, with results that differ from the compiled run; remove the mode "
                    "or torch.compile"
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
            import torch._inductor.config as ic

            compile_, optimize, wrapper, handle_skip = cls.saved
            torch.compile, torch._dynamo.optimize = compile_, optimize
            if handle_skip is not None:
                wrapper._handle_skip = handle_skip
            cls.saved = ()
            GraphGuard.uninstall()
            if cls.wrap_was is not None:
                ic.wrap_inductor_compiled_regions = cls.wrap_was
                cls.wrap_was = None

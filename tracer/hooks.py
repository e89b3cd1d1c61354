"""Torch-side op indexing shared by the tracer and the runtime.

Both stages must see a training script's ops *identically*: the same iteration boundaries, the same
op indices, the same phase, the same flattening of an op's tensors and the same tensor and storage
ids (Note [Tensor and storage ids] in ``tracer/schema.py``). That is what ties a plan, made offline
from a trace, to the live tensors of a later run. Everything that decides those things lives here.

The API, in the order a ``TorchDispatchMode.__torch_dispatch__`` uses it::

    indexer = OpIndexer(on_iteration_start=..., on_iteration_end=..., on_free=...)
    indexer.install()                     # global optimizer step hooks, capuchin.step()
    ...
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = indexer.begin_op(func, args, kwargs)   # None: not an op we index (profiler.*)
        if op is None:
            return func(*args, **kwargs)
        # op.iteration, op.index, op.phase, op.info (static facts: name, seeded, ...)
        # op.inputs[a] / op.input_ids[a] / op.input_storages[a]: flattened tensor inputs
        # op.written: flat input indices the op writes in place
        out = func(*args, **kwargs)
        indexer.end_op(op, out)
        # op.outputs[j] / op.output_ids[j] ("k:j") / op.output_storages[j]
        # op.output_alloc[j]: the op allocated that storage; op.output_aliases[j]: input index or -1
        return out
    ...
    indexer.finish()                      # closes the last iteration if a step ended it
    indexer.uninstall()

Cost: ``begin_op``/``end_op`` do one dict lookup for the op's static facts and, per tensor, one
``untyped_storage()`` call and two attribute reads; no pytree, no string formatting except the ids
of new tensors. See Note [Iteration boundaries] and Note [Storage identity] below.

Ops issued by the caller's own machinery (the tracer's measurements, the runtime's copies) must run
outside the mode (``torch.utils._python_dispatch._disable_current_modes()``), or they are indexed
as the script's ops.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import materialize
from .compiled import CompileGuard, check_config, is_hop, is_region, region_facts, unsupported_hop
from .schema import Phase, input_id, output_id, resident_id

# Note: [Iteration boundaries]
# An iteration ends with an optimizer step: the global hooks
# torch.optim.optimizer.register_optimizer_step_pre_hook/post_hook fire for every Optimizer, with no
# change to the script. The boundary is taken *lazily*: a step's post-hook only marks the iteration
# as ending; the next op that is not inside an optimizer step starts the next iteration. So several
# optimizers stepping one after the other are ONE iteration (the second step's ops still belong to
# it), gradient accumulation (k forward/backward passes, then one step) is one iteration, and the
# `profiler._record_function_exit` op that Optimizer.step dispatches after its post-hook is filtered
# anyway. A script without torch.optim calls `capuchin.step()` where its step would be. Frees that
# happen between the step and the first op of the next iteration (e.g. `zero_grad(set_to_none=True)`)
# belong to the ending iteration, after its last op.

# Note: [Phases by the autograd engine]
# Backward is what the autograd engine runs: an op dispatched while a graph task executes
# (`torch._C._current_graph_task_id() != -1`, set by the engine on the thread that runs the task),
# wherever it was called from. Optimizer is what `Optimizer.step` runs itself. A closure-based
# step (`optimizer.step(closure)`: LBFGS, and every optimizer under Lightning's automatic
# optimization) calls the script's forward and backward from inside the step; the global pre-hook
# hands the step a wrapped closure that suspends the step while it runs (hooks may replace a
# step's arguments), so its ops are forward or backward, and its first op after a step starts the
# next iteration as any other op would. LBFGS calls its closure several times per step: one
# iteration holds several forward/backward/optimizer rounds.

# Note: [Storage identity]
# A storage is identified by its Python object: PyTorch preserves the UntypedStorage PyObject for as
# long as the C++ StorageImpl lives (`t.untyped_storage() is t.untyped_storage()`, views included),
# so an attribute set on it stays, and a weakref callback fires exactly when the memory is released.
# Addresses (data_ptr) are never used: the allocator reuses them, so they are no identity across
# iterations (only 26% matched in the prototype) nor, after a free, within one. Tensors are named the
# same way (an attribute on the tensor PyObject, also preserved). Names carry the iteration epoch
# they were given in, so "resetting per iteration" is a counter increment, not a sweep.

_ITERATION_BOUNDARY_IGNORED_NAMESPACES = frozenset({"profiler"})


# --------------------------------------------------------------------------------------------
# Static facts about an op (cached per OpOverload)

# Ops that mutate arguments their schema does not mark `(a!)`. Batch norm updates running_mean and
# running_var in training mode although the schema says `Tensor? running_mean`; missing this made
# the prototype's recompute double-update the statistics. Value: (written schema arg positions,
# position of the `training` flag that enables the write, or -1 if always).
UNANNOTATED_WRITES: dict[str, tuple[tuple[int, ...], int]] = {
    "aten::native_batch_norm": ((3, 4), 5),
    "aten::native_batch_norm.out": ((3, 4), 5),
    "aten::cudnn_batch_norm": ((3, 4), 5),
    "aten::cudnn_batch_norm.out": ((3, 4), 5),
    "aten::miopen_batch_norm": ((3, 4), 5),
    "aten::miopen_batch_norm.out": ((3, 4), 5),
    # `_native_batch_norm_legit` and `_batch_norm_with_update` annotate theirs (`Tensor(a!)`).
}


@dataclass(frozen=True)
class OpSchemaInfo:
    """What is known about an op from its schema alone (computed once per OpOverload).

    name: ``str(func)``, e.g. ``"aten.mm.default"`` (the trace's ``op_name``).
    ignored: not indexed (``profiler.*`` marker ops); ``begin_op`` returns None for it.
    seeded: tagged ``nondeterministic_seeded`` (draws random numbers: dropout's bernoulli_, randn).
    write_args: schema argument positions written in place (``(a!)``), kwarg-only ones included.
    write_arg_names: their names (for kwarg-only arguments such as ``out``).
    unannotated_write_args / training_arg: see ``UNANNOTATED_WRITES``.
    """

    name: str
    ignored: bool
    seeded: bool
    write_args: tuple[int, ...]
    write_arg_names: tuple[str, ...]
    unannotated_write_args: tuple[int, ...] = ()
    training_arg: int = -1
    hop: bool = False  # a higher-order op: the facts come per call (``call_info``)
    region_writes: tuple[int, ...] = ()  # a compiled region's inputs written, by list position


_OP_INFO: dict = {}


def op_info(func) -> OpSchemaInfo:
    """The cached ``OpSchemaInfo`` of an ``OpOverload``."""
    info = _OP_INFO.get(func)
    if info is None:
        info = _OP_INFO[func] = _make_op_info(func)
    return info


def call_info(info: OpSchemaInfo, func, args: tuple) -> OpSchemaInfo:
    """The facts of one call of a higher-order op (``info.hop``): a compiled region's, named by
    its graph (Note [torch.compile] in tracer/compiled.py); any other higher-order op is refused."""
    if not is_region(func):
        raise unsupported_hop(func)
    check_config()
    facts = region_facts(args[0])
    got = _REGION_INFO.get(facts)
    if got is None:
        name, seeded, writes = facts
        got = _REGION_INFO[facts] = OpSchemaInfo(
            name=name,
            ignored=False,
            seeded=seeded,
            write_args=(),
            write_arg_names=(),
            hop=True,
            region_writes=writes,
        )
    return got


_REGION_INFO: dict = {}


def _make_op_info(func) -> OpSchemaInfo:
    if is_hop(func):
        return OpSchemaInfo(str(func), False, False, (), (), hop=True)
    name = str(func)
    namespace = getattr(func, "namespace", name.split(".", 1)[0])
    schema = getattr(func, "_schema", None)
    write_args: list[int] = []
    write_names: list[str] = []
    unannotated: tuple[int, ...] = ()
    training = -1
    if schema is not None:
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                write_args.append(i)
                write_names.append(arg.name)
        overload = schema.overload_name
        key = schema.name + (f".{overload}" if overload else "")
        unannotated, training = UNANNOTATED_WRITES.get(key, ((), -1))
    tags = getattr(func, "tags", ())
    return OpSchemaInfo(
        name=name,
        ignored=namespace in _ITERATION_BOUNDARY_IGNORED_NAMESPACES,
        seeded=torch.Tag.nondeterministic_seeded in tags,
        write_args=tuple(write_args),
        write_arg_names=tuple(write_names),
        unannotated_write_args=tuple(unannotated),
        training_arg=training,
    )


def is_seeded(func) -> bool:
    """True if the op draws random numbers (``torch.Tag.nondeterministic_seeded``): replaying it
    needs the RNG state it ran with."""
    return op_info(func).seeded


# --------------------------------------------------------------------------------------------
# Flattening


def flatten_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """An op's tensor inputs in their canonical order: the order of ``torch.utils._pytree``'s
    ``tree_flatten((args, kwargs))`` restricted to tensors: positional args first, then kwargs in
    dict order; a ``Tensor[]`` / ``Tensor?[]`` argument contributes its tensors in list order and
    ``None`` contributes nothing. The position in this list is the trace's ``arg_index`` of INPUT
    and WRITE rows and the ``a`` of ``"x{k}:{a}"`` ids. (Aten schemas nest at most one list deep,
    so this is a fast special case of pytree.)"""
    flat = []
    for a in args:
        if isinstance(a, torch.Tensor):
            flat.append(a)
        elif isinstance(a, (list, tuple)):
            flat.extend(x for x in a if isinstance(x, torch.Tensor))
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                flat.append(a)
            elif isinstance(a, (list, tuple)):
                flat.extend(x for x in a if isinstance(x, torch.Tensor))
    return flat


def flatten_outputs(out) -> list[torch.Tensor]:
    """An op's tensor outputs in order (a Tensor; a tuple/list of Tensors, lists expanded in place;
    non-tensors skipped). The position is the ``j`` of ``"k:j"`` and the ``arg_index`` of OUTPUT
    rows."""
    if isinstance(out, torch.Tensor):
        return [out]
    flat = []
    if isinstance(out, (list, tuple)):
        for o in out:
            if isinstance(o, torch.Tensor):
                flat.append(o)
            elif isinstance(o, (list, tuple)):
                flat.extend(x for x in o if isinstance(x, torch.Tensor))
    return flat


def written_inputs(
    info: OpSchemaInfo, args: tuple, kwargs: dict, flat: list[torch.Tensor]
) -> tuple[int, ...]:
    """Flat input indices (positions in ``flat``, see ``flatten_tensors``) that the op writes in
    place: schema ``(a!)`` arguments plus ``UNANNOTATED_WRITES``. Empty for most ops (fast path)."""
    if info.region_writes:  # list positions of a region's inputs -> flat positions
        pos = [i for i, x in enumerate(args[1]) if isinstance(x, torch.Tensor)]
        return tuple(pos.index(p) for p in info.region_writes if p in pos)
    if not info.write_args and not info.unannotated_write_args:
        return ()
    targets: list = []
    for pos, name in zip(info.write_args, info.write_arg_names, strict=True):
        _collect(args[pos] if pos < len(args) else kwargs.get(name), targets)
    if info.unannotated_write_args:
        t = info.training_arg
        training = True if t < 0 else bool(args[t] if t < len(args) else kwargs.get("training"))
        if training:
            for pos in info.unannotated_write_args:
                if pos < len(args):
                    _collect(args[pos], targets)
    if not targets:
        return ()
    ids = {id(x) for x in targets}
    return tuple(a for a, t in enumerate(flat) if id(t) in ids)


def _collect(value, into: list) -> None:
    if isinstance(value, torch.Tensor):
        into.append(value)
    elif isinstance(value, (list, tuple)):
        into.extend(x for x in value if isinstance(x, torch.Tensor))


def describe_args(args: tuple, kwargs: dict) -> str:
    """A short repr of an op's non-tensor arguments (tensors shown as ``T``): enough to tell two
    calls of one op apart (the trace's ``op_args``). Not on the hot path of the runtime."""

    def r(v):
        if isinstance(v, torch.Tensor):
            return "T"
        if isinstance(v, (list, tuple)):
            inner = ", ".join(r(x) for x in v)
            return f"[{inner}]"
        if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return str(v)
        if isinstance(v, float):
            return repr(v)
        return repr(v) if isinstance(v, (int, bool, str, type(None))) else type(v).__name__

    parts = [r(a) for a in args] + [f"{k}={r(v)}" for k, v in (kwargs or {}).items()]
    return ", ".join(parts)


# --------------------------------------------------------------------------------------------
# Multi-tensor ops split into groups

# Note: [Multi-tensor op split]
# A multi-tensor op (``aten._foreach_*``, ``aten._fused_adam(w)_``, ``_fused_sgd_``,
# ``_fused_adagrad_``, ``aten._amp_foreach_non_finite_check_and_unscale_``) applies one per-element
# computation to each element of its list arguments: element i of the result depends only on
# element i of every list and on the arguments that are not lists (a scalar, ``lr`` as a tensor,
# ``found_inf``, ``grad_scale``, the one tensor of ``_foreach_mul_.Tensor``), which every element
# reads unchanged. Run whole, one op reads every parameter's optimizer state at once (AdamW with
# ``foreach=True``, ``fused=True``, ``clip_grad_norm_``'s ``_foreach_norm``): its working set is
# all of them, and no plan can swap any of it across that op. So the tracer and the runtime both
# run such an op as calls of the same kernel on consecutive sub-lists (``split_calls``), each
# indexed as its own op of the trace with its own working set, and join their results
# (``join_outputs``); the trace and plan formats do not change (a group is an op of the same
# name with shorter lists). The rule depends only on the arguments' shapes and dtypes, never on
# residency (an evicted storage has 0 bytes), so the tracer and the runtime split alike, and it
# is idempotent (a group splits into itself), so stacked modes (tracing under a budget) agree:
# elements are taken in order into a group while its tensors' bytes stay within
# ``SPLIT_GROUP_BYTES``; an element larger than that is a group of its own. Results are
# bit-identical: each element's computation is the same kernel on the same values
# (tests/test_multi_tensor_split.py compares split and whole per op family with torch.equal).
# Kept whole (``split_calls`` returns None): ops outside the allow-list, ``.out`` overloads, an
# op with a per-element tensor that is not a list (``_foreach_addcdiv_.Tensor``'s ``scalars``
# holds one value per element), lists of unequal lengths (an empty list, ``max_exp_avg_sqs``
# without amsgrad, goes to every group as it is), and an op that fits in one group.
SPLIT_GROUP_BYTES = 64 * 1024

# name prefixes (``schema.name``) of the multi-tensor families whose elements are independent
_SPLIT_FAMILIES = (
    "aten::_foreach_",
    "aten::_fused_adam",  # _fused_adam_, _fused_adamw_, their functional forms and tensor_lr
    "aten::_fused_sgd",
    "aten::_fused_adagrad",
    "aten::_amp_foreach_non_finite_check_and_unscale",
)
# non-list tensor arguments that hold one value per list element: the op is kept whole
_PER_ELEMENT_TENSOR_ARGS = frozenset({"scalars"})

SPLIT_SPECS: dict = {}  # OpOverload -> tuple of (position, name, tensor list) or None


def split_spec(func):
    """The list arguments of a splittable multi-tensor op (``(schema position, name, holds
    tensors)``), or None where the op is kept whole (Note [Multi-tensor op split]). Cached."""
    try:
        return SPLIT_SPECS[func]
    except KeyError:
        pass
    spec = None
    schema = getattr(func, "_schema", None)
    if (
        schema is not None
        and schema.name.startswith(_SPLIT_FAMILIES)
        and "out" not in schema.overload_name
    ):
        lists = []
        for i, arg in enumerate(schema.arguments):
            if isinstance(arg.type, torch.ListType):
                lists.append((i, arg.name, str(arg.type.getElementType()) == "Tensor"))
            elif arg.name in _PER_ELEMENT_TENSOR_ARGS and "Tensor" in str(arg.type):
                lists = []
                break
        if any(t for _, _, t in lists):
            spec = tuple(lists)
    SPLIT_SPECS[func] = spec
    return spec


def group_bounds(sizes: list[int], cap: int = SPLIT_GROUP_BYTES) -> list[tuple[int, int]]:
    """Consecutive groups ``[(lo, hi), ...]`` of elements of ``sizes`` bytes: each takes elements
    in order while its bytes stay within ``cap``; an element larger than that is a group of its
    own (Note [Multi-tensor op split])."""
    bounds = []
    lo = 0
    total = 0
    for i, b in enumerate(sizes):
        if i > lo and total + b > cap:
            bounds.append((lo, i))
            lo, total = i, 0
        total += b
    bounds.append((lo, len(sizes)))
    return bounds


def split_calls(func, args: tuple, kwargs: dict, cap: int = SPLIT_GROUP_BYTES):
    """The calls ``[(args, kwargs), ...]`` that run ``func`` in groups of consecutive list
    elements, or None to run it whole (Note [Multi-tensor op split])."""
    spec = SPLIT_SPECS.get(func, 0)
    if spec == 0:
        spec = split_spec(func)
    if spec is None:
        return None
    found = []
    n = -1
    for pos, name, tensors in spec:
        positional = pos < len(args)
        v = args[pos] if positional else kwargs.get(name)
        if v is None:
            continue
        if not isinstance(v, (list, tuple)):
            return None
        if len(v) == 0:
            continue  # an empty list (max_exp_avg_sqs without amsgrad) goes to every group
        if n < 0:
            n = len(v)
        elif len(v) != n:
            return None
        found.append((pos if positional else name, v, tensors))
    if n <= 1:
        return None
    sizes = [0] * n
    for _, v, tensors in found:
        if tensors:
            for i, t in enumerate(v):
                if isinstance(t, torch.Tensor):
                    sizes[i] += t.numel() * t.element_size()
    bounds = group_bounds(sizes, cap)
    if len(bounds) == 1:
        return None
    calls = []
    for lo, hi in bounds:
        a = list(args)
        kw = dict(kwargs)
        for where, v, _ in found:
            part = list(v[lo:hi])
            if isinstance(where, int):
                a[where] = part
            else:
                kw[where] = part
        calls.append((tuple(a), kw))
    return calls


def join_outputs(outs: list):
    """The result of the whole op from its groups' results (``split_calls``): lists concatenated
    in order, a tuple of lists position by position; ``None`` / ``()`` as they are."""
    first = outs[0]
    if isinstance(first, list):
        return [t for o in outs for t in o]
    if isinstance(first, tuple) and first and isinstance(first[0], list):
        return tuple([t for o in outs for t in o[j]] for j in range(len(first)))
    return first


# --------------------------------------------------------------------------------------------
# Storages and ops


class StorageRec:
    """What the indexer knows about one live storage (attached to the storage PyObject).

    serial: registration order (process-unique per indexer; orders resident storages).
    name: the storage id in the epoch ``epoch`` (see Note [Tensor and storage ids]).
    nbytes: the storage's size in bytes when last seen by an op (refreshed on outputs and writes).
    device_type: ``"cpu"`` / ``"cuda"``; memory accounting counts the traced device only.
    start_nbytes / resident_rank: set when it was live at the start of the current iteration.
    user: free slot for the caller (the runtime keeps its per-storage state here).
    """

    __slots__ = (
        "serial",
        "name",
        "epoch",
        "nbytes",
        "device_type",
        "resident_rank",
        "start_nbytes",
        "alive",
        "user",
        "ref",
        "__weakref__",
    )

    def __init__(self, serial: int, nbytes: int, device_type: str):
        self.serial = serial
        self.name = ""
        self.epoch = -1
        self.nbytes = nbytes
        self.device_type = device_type
        self.resident_rank = -1
        self.start_nbytes = 0
        self.alive = True
        self.user = None
        self.ref = None  # weakref to the storage; its callback reports the free

    def __repr__(self) -> str:
        return f"StorageRec({self.name!r}, {self.nbytes} B, {self.device_type})"


class OpEvent:
    """One indexed op call. Filled by ``begin_op`` (inputs) and ``end_op`` (outputs).

    iteration: iteration number (0 = the first op after ``install``).
    index: op index within the iteration (``k``).
    phase: ``Phase`` (optimizer / backward / forward).
    info: the op's static ``OpSchemaInfo``.
    inputs / input_ids / input_storages: flat tensor inputs (``flatten_tensors`` order), their
        tensor ids and ``StorageRec`` (None for tensors without storage, e.g. sparse).
    written: flat input indices written in place (``written_inputs``).
    outputs / output_ids / output_storages: flat tensor outputs (``flatten_outputs``), ids ``"k:j"``.
    output_alloc[j]: True if this op allocated output j's storage (first sight of that storage).
    output_aliases[j]: flat input index whose storage output j shares (a view, an in-place or out=
        result), preferring the identical tensor object; -1 for fresh storage.
    args / kwargs: the call's arguments (kept for the caller; not copied).
    """

    __slots__ = (
        "iteration",
        "index",
        "phase",
        "info",
        "func",
        "args",
        "kwargs",
        "inputs",
        "input_ids",
        "input_storages",
        "written",
        "outputs",
        "output_ids",
        "output_storages",
        "output_alloc",
        "output_aliases",
    )

    def __repr__(self) -> str:
        return f"OpEvent({self.iteration}:{self.index} {self.info.name} {self.phase.value})"


_INDEXER_IDS = itertools.count()
_ACTIVE: list[OpIndexer] = []  # installed indexers; capuchin.step() notifies them


def step() -> None:
    """Mark the end of a training iteration, for scripts that do not use ``torch.optim``.

    Call it where an optimizer step would be (after the parameter update). With an optimizer it is
    not needed: optimizer steps are detected by global hooks. Without an active capuchin tracer or
    runtime it does nothing, so a script can call it unconditionally.
    """
    for indexer in list(_ACTIVE):
        indexer.mark_step()


# Note: [Skipped GradScaler steps]
# ``GradScaler.step`` does not call ``optimizer.step()`` when it finds inf/nan gradients (fp16
# training, typically in its first iterations while the scale settles): no step hook fires, and
# two iterations would become one (a trace recording a merged iteration; a run diverging from
# its plan). While an indexer is installed, ``GradScaler.step`` is wrapped so that a step it
# skipped still ends the iteration, for the optimizer it was given.
_SCALER_STEP = None


def _install_scaler_hook() -> None:
    global _SCALER_STEP
    scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler is None or _SCALER_STEP is not None:
        return
    orig = _SCALER_STEP = scaler.step

    def step(self, optimizer, *args, **kwargs):
        before = [ix.steps_seen for ix in _ACTIVE]
        out = orig(self, optimizer, *args, **kwargs)
        for ix, n in zip(list(_ACTIVE), before, strict=False):
            if ix.steps_seen == n:  # skipped: inf/nan gradients
                ix.mark_step(optimizer)
        return out

    scaler.step = step


def _uninstall_scaler_hook() -> None:
    global _SCALER_STEP
    if _SCALER_STEP is not None and not _ACTIVE:
        torch.amp.GradScaler.step = _SCALER_STEP
        _SCALER_STEP = None


# Note: [Indexers that follow another]
# The global optimizer step hooks live in ordered dicts that torch iterates while it calls them,
# so an indexer cannot register its own from inside a step hook (the next step of that iteration
# raises "mutated during iteration"). An indexer installed with ``leader`` instead hangs off an
# installed indexer: the leader's step hooks call the follower's first (its pre-step may wrap a
# closure, as the leader's own does), and ``capuchin.step()`` reaches both through ``_ACTIVE``.
# The tracer's host-cost calibration uses it to run the runtime over the script's own steps
# from a step hook (Note [The runtime in the script's steps] in runtime/calibrate.py); the
# follower must uninstall before its leader.


class OpIndexer:
    """Iteration boundaries, phases, op indices and tensor/storage ids of the ops it is shown.

    Callbacks (all optional, called synchronously, must not raise unless they mean to abort the
    script, which is how the tracer stops it after the recorded iterations):

    on_iteration_start(iteration): before the first op of ``iteration`` is indexed; the storages
        live at that moment are in ``residents`` (with ``resident_rank`` and ``start_nbytes``).
    on_iteration_end(iteration, last_op_index): the iteration is over (lazily: see Note
        [Iteration boundaries]; or at ``finish()`` after a final step).
    on_free(rec, name, iteration, op_index): storage ``rec`` was released; ``name`` is its id in
        ``iteration``; ``op_index`` is the last op begun in that iteration (-1: before any op).
    on_step(optimizer): an optimizer's step just finished (its post-hook), or ``capuchin.step()``
        was called (optimizer None). Parameters, gradients and optimizer state are all present
        then (``zero_grad(set_to_none=True)`` has not run yet).

    One indexer is installed at a time per script run in practice, but several can coexist: each
    uses its own attribute names on tensors and storages.
    """

    guards_compile = True  # refuse torch.compile while installed (Note [torch.compile])

    def __init__(
        self,
        on_iteration_start: Callable | None = None,
        on_iteration_end: Callable | None = None,
        on_free: Callable | None = None,
        on_step: Callable | None = None,
    ):
        uid = next(_INDEXER_IDS)
        self._tattr = f"_capuchin_t{uid}"  # tensor attribute: (epoch, tensor id)
        self._sattr = f"_capuchin_s{uid}"  # storage attribute: StorageRec
        self.on_iteration_start = on_iteration_start
        self.on_iteration_end = on_iteration_end
        self.on_free = on_free
        self.on_step = on_step
        self.iteration = -1  # -1 until the first op
        self.op_index = -1  # last op begun in the current iteration
        self.in_optimizer = 0  # depth of optimizer steps in progress
        self.step_pending = False  # a step ended; the next non-optimizer op starts an iteration
        self.steps_seen = 0  # optimizer steps (post-hooks) + capuchin.step() calls
        self.optimizers: weakref.WeakSet = weakref.WeakSet()  # every optimizer that stepped
        self.live: dict[int, StorageRec] = {}  # serial -> rec, registration order
        self._by_ref: dict[int, StorageRec] = {}  # id(rec.ref) -> rec, for the free callback
        self.residents: list[StorageRec] = []  # live at the start of the current iteration
        self._serial = itertools.count()
        self._handles: list = []
        # Note [Indexers that follow another]: indexers whose step hooks this one calls
        self.followers: list[OpIndexer] = []
        self._leader: OpIndexer | None = None

    # ---- installation -----------------------------------------------------------------------
    def install(self, leader: OpIndexer | None = None) -> OpIndexer:
        """Register the global optimizer step hooks and make ``capuchin.step()`` reach this one;
        with ``leader`` (an installed indexer), follow its hooks instead (Note [Indexers that
        follow another])."""
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        if leader is not None:
            if self._leader is None and not self._handles:
                self._leader = leader
                leader.followers.append(self)
                _ACTIVE.append(self)
            return self
        if not self._handles:
            self._handles = [
                register_optimizer_step_pre_hook(self._pre_step),
                register_optimizer_step_post_hook(self._post_step),
            ]
            _ACTIVE.append(self)
            materialize.install()  # Note [Batches from workers] in materialize.py
            _install_scaler_hook()  # Note [Skipped GradScaler steps]
            if self.guards_compile:
                CompileGuard.install()  # Note [torch.compile] in tracer/compiled.py
        return self

    def uninstall(self) -> None:
        if self._leader is not None:
            if self in self._leader.followers:
                self._leader.followers.remove(self)
            self._leader = None
        if self._handles and self.guards_compile:
            CompileGuard.uninstall()
        if self._handles:
            materialize.uninstall()
        for h in self._handles:
            h.remove()
        self._handles = []
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        _uninstall_scaler_hook()

    def _pre_step(self, optimizer, args, kwargs):
        for f in list(self.followers):  # Note [Indexers that follow another]
            changed = f._pre_step(optimizer, args, kwargs)
            if changed is not None:
                args, kwargs = changed
        changed = self._own_pre_step(optimizer, args, kwargs)
        return changed if changed is not None or not self.followers else (args, kwargs)

    def _own_pre_step(self, optimizer, args, kwargs):
        self.in_optimizer += 1
        self.optimizers.add(optimizer)
        # Note [Phases by the autograd engine]: a closure runs the script's forward and backward
        # (args[0] is the optimizer itself: the hook sees the arguments of the unbound step)
        if len(args) > 1 and callable(args[1]):
            return (args[0], self._closure(args[1]), *args[2:]), kwargs
        if callable(kwargs.get("closure")):
            return args, {**kwargs, "closure": self._closure(kwargs["closure"])}
        return None

    def _closure(self, closure):
        """``closure`` with the optimizer step it is called from suspended while it runs: its ops
        are forward (and backward, by the autograd engine), and its first op after a step starts
        the next iteration."""
        indexer = self

        def capuchin_closure(*a, **kw):
            depth, indexer.in_optimizer = indexer.in_optimizer, 0
            try:
                return closure(*a, **kw)
            finally:
                indexer.in_optimizer = depth

        return capuchin_closure

    def _post_step(self, optimizer, args, kwargs) -> None:
        for f in list(self.followers):  # Note [Indexers that follow another]
            f._post_step(optimizer, args, kwargs)
        self.in_optimizer = max(0, self.in_optimizer - 1)
        self.mark_step(optimizer)

    def mark_step(self, optimizer=None) -> None:
        """An optimizer step (or ``capuchin.step()``) ended: the current iteration ends at the
        next op that is not inside a step."""
        self.steps_seen += 1
        self.step_pending = True
        if self.on_step is not None:
            self.on_step(optimizer)

    def finish(self) -> bool:
        """End of the script: close the current iteration if a step ended it. Returns True if the
        last iteration was complete (ended by a step), False if ops ran after the last step."""
        if self.step_pending and self.iteration >= 0:
            self.step_pending = False
            if self.on_iteration_end is not None:
                self.on_iteration_end(self.iteration, self.op_index)
            return True
        return self.iteration < 0 or self.op_index < 0

    # ---- phase and boundaries -----------------------------------------------------------------
    def phase(self) -> Phase:
        """Phase of an op issued now (Note [Phases by the autograd engine]): backward while the
        autograd engine runs a graph task (thread-local, so it holds on autograd worker threads
        too), optimizer inside a step outside its closure, else forward."""
        if torch._C._current_graph_task_id() != -1:
            return Phase.BACKWARD
        if self.in_optimizer:
            return Phase.OPTIMIZER
        return Phase.FORWARD

    def _start_iteration(self) -> None:
        if self.iteration >= 0 and self.on_iteration_end is not None:
            self.on_iteration_end(self.iteration, self.op_index)
        self.step_pending = False
        self.iteration += 1
        self.op_index = -1
        residents = list(self.live.values())
        for rank, rec in enumerate(residents):
            rec.resident_rank = rank
            rec.start_nbytes = rec.nbytes
        self.residents = residents
        if self.on_iteration_start is not None:
            self.on_iteration_start(self.iteration)

    # ---- the per-op path ----------------------------------------------------------------------
    def begin_op(self, func, args: tuple, kwargs: dict) -> OpEvent | None:
        """Index one op before it runs: takes a pending iteration boundary, assigns the op index
        and phase, flattens and names the inputs. Returns None for ignored ops (``profiler.*``),
        which get no index."""
        info = _OP_INFO.get(func)
        if info is None:
            info = op_info(func)
        if info.ignored:
            return None
        if info.hop:
            info = call_info(info, func, args)
        if self.iteration < 0 or (self.step_pending and not self.in_optimizer):
            self._start_iteration()
        self.op_index += 1
        k = self.op_index
        epoch = self.iteration
        op = OpEvent()
        op.iteration = epoch
        op.index = k
        op.phase = self.phase()
        op.info = info
        op.func = func
        op.args = args
        op.kwargs = kwargs
        flat = flatten_tensors(args, kwargs)
        op.inputs = flat
        tattr = self._tattr
        ids = []
        recs = []
        for a, t in enumerate(flat):
            tag = getattr(t, tattr, None)
            if tag is not None and tag[0] == epoch:
                tid = tag[1]
            else:
                tid = input_id(k, a)
                try:
                    setattr(t, tattr, (epoch, tid))
                except AttributeError:  # a subclass without __dict__: named anew at each access
                    pass
            ids.append(tid)
            recs.append(self._storage_of(t, tid, epoch)[0])
        op.input_ids = ids
        op.input_storages = recs
        op.written = written_inputs(info, args, kwargs, flat)
        return op

    def end_op(self, op: OpEvent, out) -> OpEvent:
        """Name an op's outputs after it ran (``"k:j"``; an in-place result is renamed too, so the
        id always denotes the value after the op) and find which storages it allocated."""
        outs = flatten_outputs(out)
        op.outputs = outs
        k = op.index
        epoch = op.iteration
        tattr = self._tattr
        ids = []
        recs = []
        allocs = []
        aliases = []
        in_recs = op.input_storages
        for j, t in enumerate(outs):
            tid = output_id(k, j)
            try:
                setattr(t, tattr, (epoch, tid))
            except AttributeError:
                pass
            ids.append(tid)
            rec, fresh = self._storage_of(t, tid, epoch)
            recs.append(rec)
            allocs.append(fresh)
            alias = -1
            if rec is not None and not fresh and rec in in_recs:
                alias = next((a for a, x in enumerate(op.inputs) if x is t), -1)
                if alias < 0:
                    alias = in_recs.index(rec)
            aliases.append(alias)
            if rec is not None and not fresh:
                rec.nbytes = _nbytes(t)
        for a in op.written:
            rec = in_recs[a]
            if rec is not None:
                rec.nbytes = _nbytes(op.inputs[a])
        op.output_ids = ids
        op.output_storages = recs
        op.output_alloc = allocs
        op.output_aliases = aliases
        return op

    def _storage_of(self, t: torch.Tensor, tid: str, epoch: int) -> tuple[StorageRec | None, bool]:
        """The rec of ``t``'s storage, registering it on first sight (-> fresh=True); names it
        ``tid`` if it has no name in this epoch yet."""
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested, ... : no plain storage
            return None, False
        rec = getattr(st, self._sattr, None)
        fresh = rec is None
        if fresh:
            rec = StorageRec(next(self._serial), st.nbytes(), st.device.type)
            setattr(st, self._sattr, rec)
            self.live[rec.serial] = rec
            # a bare weakref with a callback: ~20x cheaper than weakref.finalize (which costs
            # ~7 us per storage); the rec keeps the ref alive, the ref's id finds the rec
            rec.ref = ref = weakref.ref(st, self._dead)
            self._by_ref[id(ref)] = rec
        if rec.epoch != epoch:
            rec.epoch = epoch
            rec.name = tid
        return rec, fresh

    def _dead(self, ref) -> None:
        rec = self._by_ref.pop(id(ref), None)
        if rec is not None:
            self._freed(rec)

    def _freed(self, rec: StorageRec) -> None:
        rec.alive = False
        self.live.pop(rec.serial, None)
        if self.on_free is not None and self.iteration >= 0:
            self.on_free(rec, self.storage_name(rec), self.iteration, self.op_index)

    # ---- naming live things (for the runtime) -------------------------------------------------
    def storage_name(self, rec: StorageRec) -> str:
        """The id of a storage in the current iteration: its name if accessed in it, else
        ``"r{n}"`` (n = rank among the storages live at the iteration start)."""
        if rec.epoch == self.iteration:
            return rec.name
        return resident_id(rec.resident_rank)

    def storage_rec(self, t: torch.Tensor) -> StorageRec | None:
        """The rec of a live tensor's storage, or None if no indexed op has seen it."""
        try:
            return getattr(t.untyped_storage(), self._sattr, None)
        except (RuntimeError, NotImplementedError):
            return None

    def tensor_id(self, t: torch.Tensor) -> str | None:
        """The id ``t`` has in the current iteration, or None if no op has named it yet."""
        tag = getattr(t, self._tattr, None)
        return tag[1] if tag is not None and tag[0] == self.iteration else None


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return 0

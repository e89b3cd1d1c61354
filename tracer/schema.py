"""The trace format, defined once. Imports no torch: the planner reads traces through this module.

A trace is one Parquet file holding one *event table*: one row per tensor access (an op reading,
writing or producing a tensor) plus memory events (a storage freed; a storage resident when an
iteration starts). Everything else (ops, lineage, tensors, the memory curve) is derived from it by
``tracer.reader``. Key-value metadata (``META_KEY``) holds a JSON object described by ``TraceMeta``.

# Note: [Tensor and storage ids]
# Ids are stable across iterations and never memory addresses. Within an iteration, op ``k``'s
# ``j``-th output tensor is ``"k:j"``. A tensor that exists before the iteration (a parameter, an
# optimizer state, a batch loaded earlier, a gradient kept from the last step) is named after its
# first access in the iteration: ``"x{k}:{a}"`` = the ``a``-th tensor argument of op ``k``. A
# storage is named after the tensor that first owned it: the fresh output that allocated it, or
# the pre-existing tensor it was first seen through. Storages resident at iteration start but never
# accessed in it are ``"r{n}"`` (n-th in allocation order). The runtime re-derives the same ids
# as it runs (``tracer.hooks``), which is what ties a plan to live tensors.
# Tensor ids name *values*: an in-place op's result is op ``k``'s output ``"k:0"`` although it is
# the same tensor object as its input (so ``relu_`` reading ``"2:0"`` outputs ``"4:0"``), while
# the storage keeps the one id it got first. A tensor object that no indexed op produced in the
# iteration (a parameter, a ``.data`` alias, a tensor autograd rebuilt) gets an ``x`` id even when
# its storage was allocated in the iteration. SCRATCH rows use the pseudo storage id ``"~{k}"``.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Collection
from dataclasses import asdict, dataclass, field

import pyarrow as pa

SCHEMA_VERSION = 1
META_KEY = b"capuchin.trace"
FILE_SUFFIX = ".trace.parquet"


class IdKind(str, enum.Enum):
    """The four shapes of an id of Note [Tensor and storage ids]."""

    OUTPUT = "output"  # "k:j": output j of op k
    INPUT = "input"  # "x{k}:{a}": pre-existing tensor, a-th tensor argument of op k
    RESIDENT = "resident"  # "r{n}": resident at the start, untouched in the iteration
    SCRATCH = "scratch"  # "~{k}": op k's kernel scratch (a pseudo storage)


# The formatters, one per kind: ids travel as strings (trace rows, plans), built on hot paths.
output_id = "{}:{}".format
input_id = "x{}:{}".format
resident_id = "r{}".format
scratch_id = "~{}".format

_ID_PREFIX = {"x": IdKind.INPUT, "r": IdKind.RESIDENT, "~": IdKind.SCRATCH}


def id_kind(text: str) -> IdKind:
    """The kind of a well-formed id, from its first character (cheap: no parsing)."""
    return _ID_PREFIX.get(text[:1], IdKind.OUTPUT)


@dataclass(frozen=True)
class TensorId:
    """A parsed id of Note [Tensor and storage ids]. ``op_index`` is ``k`` (``n`` for a resident
    id), ``position`` is ``j`` or ``a`` (0 where the kind has none)."""

    kind: IdKind
    op_index: int
    position: int = 0

    def format(self) -> str:
        if self.kind is IdKind.OUTPUT:
            return output_id(self.op_index, self.position)
        if self.kind is IdKind.INPUT:
            return input_id(self.op_index, self.position)
        if self.kind is IdKind.RESIDENT:
            return resident_id(self.op_index)
        return scratch_id(self.op_index)

    @classmethod
    def parse(cls, text: str) -> TensorId:
        """The id ``text`` names; ``ValueError`` when it is not one."""
        kind = id_kind(text)
        body = text if kind is IdKind.OUTPUT else text[1:]
        parts = body.split(":")
        want = 2 if kind in (IdKind.OUTPUT, IdKind.INPUT) else 1
        if len(parts) != want or not all(p.isdigit() and p.isascii() for p in parts):
            raise ValueError(f"not a tensor or storage id: {text!r}")
        return cls(kind, *(int(p) for p in parts))


class Phase(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class Role(str, enum.Enum):
    INPUT = "input"  # the op reads the tensor
    WRITE = "write"  # the op reads and writes the tensor in place (schema ``(a!)`` or unannotated)
    OUTPUT = "output"  # the op returns the tensor (fresh storage, or a view/alias of an input)
    FREE = "free"  # the storage's memory was released after op ``op_index``
    RESIDENT = "resident"  # the storage was live when the iteration started (op_index = -1)
    # SCRATCH: op ``op_index``'s kernels needed ``storage_bytes`` of temporary memory beyond its
    # outputs (workspace, im2col, internal tensors) and released it before the op returned: while
    # the op runs, memory reaches live-before-the-op + its new outputs + scratch. No tensor; the
    # storage id is ``"~{op_index}"``. Measured from the allocator's events inside the op's
    # profiler range (tracer/timing.py). Not an access: ACCESS_ROLES excludes it.
    SCRATCH = "scratch"


ACCESS_ROLES = (Role.INPUT, Role.WRITE, Role.OUTPUT)


class Kind(str, enum.Enum):
    PARAMETER = "parameter"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    INPUT = "input"  # data the script fed in (exists before the iteration, not a parameter/state)
    ACTIVATION = "activation"  # produced by a forward/backward op inside the iteration
    OTHER = "other"


PERSISTENT_KINDS = (Kind.PARAMETER, Kind.GRADIENT, Kind.OPTIMIZER_STATE)


class Col:
    """Column names. Nobody spells a column string outside this class."""

    ITERATION = "iteration"  # int32: iteration number since the script started (warm-up included)
    EVENT = "event_index"  # int64: order of the row within its iteration
    OP = "op_index"  # int32: op index within the iteration; -1 for RESIDENT rows
    OP_NAME = "op_name"  # str: "aten.mm.default" (OpOverload name)
    PHASE = "phase"  # Phase
    ROLE = "role"  # Role
    ARG = "arg_index"  # int32: position among the op's flattened tensor inputs (INPUT/WRITE) or
    #                    outputs (OUTPUT); -1 for FREE/RESIDENT
    TENSOR = "tensor_id"  # str: see Note [Tensor and storage ids]
    STORAGE = "storage_id"  # str
    ALLOC = "alloc"  # bool: OUTPUT rows: this op allocated the storage
    ALIASES = "aliases_input"  # int32: OUTPUT rows: arg index of the input it aliases, else -1
    VIEW_OF = "view_of"  # str | null: storage of the base when the tensor is a view of another one
    BYTES = "bytes"  # int64: the tensor's own bytes (numel * itemsize)
    STORAGE_BYTES = "storage_bytes"  # int64: the storage's bytes: what memory accounting counts
    SHAPE = "shape"  # list<int64>
    DTYPE = "dtype"  # str: "float32"
    KIND = "kind"  # Kind
    START_NS = "start_ns"  # int64: op start on the device timeline, from the iteration start
    DURATION_NS = "duration_ns"  # int64: op busy time on the device (CUDA: sum of its kernels)
    SEEDED = "seeded"  # bool: the op draws random numbers (nondeterministic_seeded)
    OP_ARGS = "op_args"  # str: repr of the op's non-tensor arguments (identifies the call)


SCHEMA = pa.schema(
    [
        pa.field(Col.ITERATION, pa.int32(), nullable=False),
        pa.field(Col.EVENT, pa.int64(), nullable=False),
        pa.field(Col.OP, pa.int32(), nullable=False),
        pa.field(Col.OP_NAME, pa.string()),
        pa.field(Col.PHASE, pa.string()),
        pa.field(Col.ROLE, pa.string(), nullable=False),
        pa.field(Col.ARG, pa.int32()),
        pa.field(Col.TENSOR, pa.string()),
        pa.field(Col.STORAGE, pa.string(), nullable=False),
        pa.field(Col.ALLOC, pa.bool_()),
        pa.field(Col.ALIASES, pa.int32()),
        pa.field(Col.VIEW_OF, pa.string()),
        pa.field(Col.BYTES, pa.int64()),
        pa.field(Col.STORAGE_BYTES, pa.int64(), nullable=False),
        pa.field(Col.SHAPE, pa.list_(pa.int64())),
        pa.field(Col.DTYPE, pa.string()),
        pa.field(Col.KIND, pa.string()),
        pa.field(Col.START_NS, pa.int64()),
        pa.field(Col.DURATION_NS, pa.int64()),
        pa.field(Col.SEEDED, pa.bool_()),
        pa.field(Col.OP_ARGS, pa.string()),
    ]
)

COLUMNS = tuple(SCHEMA.names)


@dataclass
class TraceMeta:
    """Key-value metadata of a trace (stored as one JSON object under ``META_KEY``)."""

    schema_version: int = SCHEMA_VERSION
    capuchin_version: str = ""
    torch_version: str = ""
    device: str = "cpu"  # "cpu" | "cuda"
    device_name: str = ""
    bandwidth_d2h_bytes_per_s: float = 12e9  # device -> host copy bandwidth (swap-out)
    bandwidth_h2d_bytes_per_s: float = 12e9  # host -> device copy bandwidth (swap-in)
    iterations: list[int] = field(default_factory=list)  # recorded iteration numbers
    warmup: int = 0
    script: str = ""
    argv: list[str] = field(default_factory=list)
    date: str = ""  # ISO 8601
    regular: bool = True  # the recorded steady iterations have identical op sequences
    first_divergence: dict | None = None  # {"iteration", "op_index", "expected", "got"}
    steady_iteration: int | None = None  # the iteration a planner should use by default
    source: str = "capuchin"  # "capuchin" (recorded) | "dtr-log" (imported) | "synthetic"
    # traced under a memory cap (capuchin trace --budget): the cap, and the peak the allocator
    # measured while tracing (Note [Tracing under a budget] in tracer/record.py); None uncapped
    trace_budget_bytes: int | None = None
    measured_peak_bytes: int | None = None
    # the median iteration (optimizer step to step, ns) timed after the recorded ones without the
    # tracer's dispatch mode or the profiler (Note [Plain step] in tracer/record.py); None: not
    # timed (the reason in extra["plain_iteration_note"]), or a trace from before the field
    plain_iteration_ns: int | None = None
    # the compiled regions (their ``op_name``) that a replay regenerates exactly (Note [Region
    # replay] in tracer/compiled.py): no random numbers drawn inside, no input written in place,
    # traced on CPU. Every other region is never replayed; empty in a trace from before the field
    replayable_regions: list[str] = field(default_factory=list)
    # the saved activations a compiled forward region's backward could recompute cheaply (Note
    # [Region tags] in tracer/region_tags.py): region op name -> {"compile_id", "tagged" (the
    # nodes tagged while tracing), "candidates": [{"node", "output" (position among the region's
    # outputs), "bytes", "tags" (the joint-graph nodes to tag)}]}; empty in a trace from before
    # the field, or of a script without compiled regions
    region_candidates: dict = field(default_factory=dict)
    # the recompute tags the script was traced with (compile id -> node names), verified bitwise
    # against the untagged program; None: traced without tags
    region_tags: dict | None = None
    # the runtime's host costs measured in the script (ns: ``hot_op_ns``), right after the plain
    # step, on CPU (Note [Calibrated host costs] in planner/costs.py); None: not measured (CUDA,
    # no plain step, or a trace from before the field)
    host_costs: dict | None = None
    extra: dict = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> TraceMeta:
        data = json.loads(raw)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


# Ops that communicate with other ranks, by namespace (Note [Collectives] in planner/problem.py):
# never replayed, since a replay on one rank alone would hang or pair with another call.
COLLECTIVE_NAMESPACES = ("c10d.", "_c10d_functional.", "c10d_functional.", "_dtensor.")
# ... and FSDP's own ops, which read and write communication buffers without being collectives.
COMMUNICATION_NAMESPACES = (*COLLECTIVE_NAMESPACES, "fsdp.")


def is_collective(op_name: str) -> bool:
    """The op (its qualified name, ``namespace.op.overload``) communicates with other ranks."""
    return op_name.startswith(COLLECTIVE_NAMESPACES)


# A compiled region's op (Note [torch.compile] in tracer/compiled.py): ``inductor_compiled_code.<hash>``
REGION_PREFIX = "inductor_compiled_code."


def is_compiled_region(op_name: str) -> bool:
    """The op is a call of a ``torch.compile``d region."""
    return op_name.startswith(REGION_PREFIX)


def never_replayed(op_name: str, replayable_regions: Collection[str] = ()) -> bool:
    """The op ends every replay chain: a collective (Note [Collectives] in planner/problem.py)
    or a compiled region that is not in ``replayable_regions`` (the trace's, Note [Region
    replay] in tracer/compiled.py); what only a replay of it could regenerate is swapped
    instead."""
    if op_name.startswith(REGION_PREFIX):
        return op_name not in replayable_regions
    return op_name.startswith(COLLECTIVE_NAMESPACES)


def communicates(op_name: str) -> bool:
    """The op exchanges data with other ranks: a collective, or one of FSDP's own ops."""
    return op_name.startswith(COMMUNICATION_NAMESPACES)


def shape_signature(input_shapes) -> str:
    """The shape part of an op's signature: its tensor inputs' shapes in flattened-argument order.

    The planner computes it from a trace's INPUT/WRITE rows (sorted by ``arg_index``); the runtime
    from the live arguments. Plans store ``[op_name, shape_signature]`` per op index and the
    runtime compares them on every op (see planner/plan.py).
    """
    return ";".join("x".join(str(int(d)) for d in s) for s in input_shapes)

"""Import a DTR log (Kirisame et al., ICLR'21) as a capuchin trace. Imports no torch.

The DTR project's logs (``dtr_logs_path()``: ``shared/data/dtr-logs.zip`` beside the repository, or
``$CAPUCHIN_DTR_LOGS``; format in its README; reference reader
``uwsampl/dtr-prototype`` ``simrd/parse/parse.py``) are JSON lines, one instruction per line, for
one training iteration measured on a Titan V. They are the only real GPU op times we have.

# Note: [DTR log semantics]
# A log *name* (``x7691``) is a reference to a tensor; ``COPY`` adds a reference to the same tensor,
# ``COPY_FROM`` rebinds an existing name to another tensor (dropping one reference to its old
# tensor), ``RELEASE`` drops the name. A ``CALL`` result is a new tensor with one reference; with
# ``ALIAS k >= 0`` it is a view living in the storage of argument ``k`` (its MEMORY line is the
# view's own size, the storage's size is the base's), with ``ALIAS -1`` it allocates a fresh
# storage of MEMORY bytes. A storage's memory is free once no name refers to any tensor living in
# it (its own tensor or any view of it). ``MUTATE`` writes arguments in place: no new memory.
# ``CONSTANT`` tensors exist before the iteration (parameters, the batch), so they are RESIDENT
# from the iteration start, wherever the log first mentions them (the log mentions a parameter
# when an op first uses it). One that is released before the first op never coexists with any op
# and is left out.
#
# Mapping to the trace format (tracer/schema.py): each CALL or MUTATE is one op, in log order, with
# ``duration_ns`` = its TIME and ``start_ns`` the running sum (the log was recorded with synchronous
# execution, so ops do not overlap). CALL args are INPUT rows, results OUTPUT rows (``alloc`` for
# fresh storage, ``aliases_input``/``view_of`` for views); MUTATE args are WRITE rows when mutated,
# INPUT rows otherwise. A FREE row follows the last op before the storage's last reference is
# released. Phase is forward until the ``ANNOTATE BACKWARD`` marker, backward after it; there is
# no optimizer phase (the logs stop before it). Kinds: constants still referenced at the end are
# parameters, the others inputs; backward results still referenced at the end are gradients; all
# other results are activations. Shapes and dtypes are not in the logs: shape ``[]``, dtype
# ``"unknown"``; ``bytes`` is exact.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from .. import __version__
from ..errors import CapuchinError, TraceFormatError
from ..outputs import check_output
from .reader import write_trace
from .schema import FILE_SUFFIX, Col, Kind, Phase, Role, TraceMeta, input_id, resident_id

# Note: [Complete logs]
# A log cut on a line boundary parses, so completeness is judged by the end state: a complete
# training iteration has released its activations by its last line (the 8 DTR logs end with
# 0.02-2.6% of their peak bytes of op results still referenced; unroll_gan has no BACKWARD
# marker and is complete), while a log cut before its backward pass still holds what it saved
# (inceptionv4, lstm, resnet32 cut at the BACKWARD marker: 99.7-100% of the peak; cut a quarter
# of the way through backward: 75-95%; half way: 50-79%).
# More than ``CUT_LOG_FRACTION`` of the peak still referenced at the end is refused.
CUT_LOG_FRACTION = 0.5
PCIE3_X16_BYTES_PER_S = 12e9  # the paper's PCIe 3.0 x16 figure, each direction (capuchin.md §1.4)
DTR_DEVICE_NAME = "NVIDIA Titan V"  # where the DTR authors recorded the logs (data/README.md)
_SEEDED_NAME = re.compile(r"dropout|droupout|bernoulli|rand|multinomial", re.IGNORECASE)


class DtrLogError(TraceFormatError):
    """A DTR log cannot be read or does not follow the format (names the file and the line)."""


@dataclass
class _Tensor:
    storage: int  # index into _State.storages
    size_bytes: int  # the tensor's own bytes (the view's, for a view)
    name: str | None  # trace tensor id; None for a constant until its first access
    constant: bool
    backward: bool  # produced in the backward phase


@dataclass
class _Storage:
    size_bytes: int
    name: str | None  # trace storage id; None for a constant until its first access
    refs: int = 0  # live log names referring to any tensor living in this storage
    freed: bool = False
    resident: bool = False  # a constant: live at the iteration start


class _Converter:
    """One pass over the log lines; see Note [DTR log semantics]."""

    def __init__(self, source: str):
        self.source = source
        self.tensors: list[_Tensor] = []
        self.storages: list[_Storage] = []
        self.names: dict[str, int] = {}  # log name -> tensor index
        self.rows: list[tuple] = []  # (op, role, arg, tensor_idx, storage_idx, alloc, aliases)
        self.ops: list[tuple[str, Phase, int, bool]] = []  # (name, phase, duration_ns, seeded)
        self.backward = False
        self.saw_backward_marker = False
        self.live_result_bytes = 0  # bytes of op results (not constants) referenced now
        self.peak_result_bytes = 0

    # -- references ---------------------------------------------------------------------------
    def _bind(self, name: str, tensor: int, lineno: int) -> None:
        if name in self.names:
            raise DtrLogError(f"{self.source}:{lineno}: name {name} is bound twice")
        self.names[name] = tensor
        self.storages[self.tensors[tensor].storage].refs += 1

    def _unbind(self, name: str) -> None:
        tensor = self.names.pop(name)
        storage = self.tensors[tensor].storage
        st = self.storages[storage]
        st.refs -= 1
        if st.refs == 0:
            st.freed = True
            if not st.resident:
                self.live_result_bytes -= st.size_bytes
            # Released before the first op: a constant no op ever saw; see the Note.
            self.rows.append((len(self.ops) - 1, Role.FREE, -1, None, storage, None, None))

    def _lookup(self, name: str, lineno: int) -> int:
        try:
            return self.names[name]
        except KeyError:
            raise DtrLogError(
                f"{self.source}:{lineno}: name {name} is used but not defined (or already released)"
            ) from None

    def _new_tensor(self, storage: int, size_bytes: int, name: str | None, constant: bool) -> int:
        self.tensors.append(_Tensor(storage, size_bytes, name, constant, self.backward))
        return len(self.tensors) - 1

    def _new_storage(self, size_bytes: int, name: str | None, resident: bool = False) -> int:
        if not resident:
            self.live_result_bytes += size_bytes
            self.peak_result_bytes = max(self.peak_result_bytes, self.live_result_bytes)
        self.storages.append(_Storage(size_bytes, name, resident=resident))
        return len(self.storages) - 1

    # -- instructions -------------------------------------------------------------------------
    def run(self, lines: list[str]) -> None:
        i = 0
        n = len(lines)

        def take(lineno: int, kind: str, name: str) -> dict:
            if lineno >= n:
                raise DtrLogError(
                    f"{self.source}:{lineno}: log ends where a {kind} line for {name} is expected"
                )
            d = _parse(lines[lineno], self.source, lineno + 1)
            if d.get("INSTRUCTION") != kind or d.get("NAME") != name:
                raise DtrLogError(
                    f"{self.source}:{lineno + 1}: expected {kind} for {name}, got "
                    f"{lines[lineno].strip()[:120]}"
                )
            return d

        while i < n:
            lineno = i + 1
            d = _parse(lines[i], self.source, lineno)
            i += 1
            ins = d.get("INSTRUCTION")
            try:
                if ins == "ANNOTATE":
                    if d.get("ANNOTATION") == "BACKWARD":
                        self.backward = True
                        self.saw_backward_marker = True
                elif ins == "CONSTANT":
                    name = d["NAME"]
                    size = int(take(i, "MEMORY", name)["MEMORY"])
                    i += 1
                    storage = self._new_storage(size, None, resident=True)
                    self._bind(name, self._new_tensor(storage, size, None, True), lineno)
                elif ins == "COPY":
                    self._bind(d["DST"], self._lookup(d["SRC"], lineno), lineno)
                elif ins == "COPY_FROM":
                    src = self._lookup(d["SRC"], lineno)
                    self._lookup(d["DST"], lineno)
                    self._unbind(d["DST"])
                    self._bind(d["DST"], src, lineno)
                elif ins == "RELEASE":
                    if d["NAME"] in self.names:  # the reference reader ignores unknown releases
                        self._unbind(d["NAME"])
                elif ins == "CALL":
                    i = self._call(d, lines, i, lineno, take)
                elif ins == "MUTATE":
                    self._mutate(d, lineno)
                elif ins is None:
                    raise DtrLogError(
                        f"{self.source}:{lineno}: no INSTRUCTION field (a DTR log line is a JSON "
                        f"object with one): {lines[lineno - 1].strip()[:80]}"
                    )
                else:
                    raise DtrLogError(f"{self.source}:{lineno}: unknown instruction {ins!r}")
            except (KeyError, TypeError, ValueError) as exc:
                raise DtrLogError(
                    f"{self.source}:{lineno}: malformed {ins} line ({type(exc).__name__}: {exc})"
                ) from None

    def _start_op(self, d: dict) -> int:
        name = str(d["NAME"])
        self.ops.append(
            (
                name,
                Phase.BACKWARD if self.backward else Phase.FORWARD,
                int(d["TIME"]),
                bool(_SEEDED_NAME.search(name)),
            )
        )
        return len(self.ops) - 1

    def _access(self, op: int, role: Role, arg: int, tensor: int) -> None:
        t = self.tensors[tensor]
        if t.name is None:  # a constant's first access names it (Note [Tensor and storage ids])
            t.name = input_id(op, arg)
            st = self.storages[t.storage]
            if st.name is None:
                st.name = t.name
        self.rows.append((op, role, arg, tensor, t.storage, None, None))

    def _call(self, d: dict, lines: list[str], i: int, lineno: int, take) -> int:
        args = [self._lookup(a, lineno) for a in d["ARGS"]]
        op = self._start_op(d)
        for a, tensor in enumerate(args):
            self._access(op, Role.INPUT, a, tensor)
        for j, res in enumerate(d["RESULT"]):
            size = int(take(i, "MEMORY", res)["MEMORY"])
            alias = int(take(i + 1, "ALIAS", res)["ALIAS"])
            i += 2
            tid = f"{op}:{j}"
            if alias >= 0:
                if alias >= len(args):
                    raise DtrLogError(
                        f"{self.source}:{i}: {res} aliases argument {alias} of an "
                        f"op with {len(args)} arguments"
                    )
                storage = self.tensors[args[alias]].storage
            else:
                storage = self._new_storage(size, tid)
            tensor = self._new_tensor(storage, size, tid, False)
            self.rows.append((op, Role.OUTPUT, j, tensor, storage, alias < 0, alias))
            self._bind(res, tensor, lineno)
        return i

    def _mutate(self, d: dict, lineno: int) -> None:
        args = [self._lookup(a, lineno) for a in d["ARGS"]]
        written = {int(m) for m in d["MUTATE"]}
        op = self._start_op(d)
        for a, tensor in enumerate(args):
            self._access(op, Role.WRITE if a in written else Role.INPUT, a, tensor)

    # -- output -------------------------------------------------------------------------------
    def events(self) -> pd.DataFrame:
        """The event table (columns of tracer.schema.SCHEMA), one iteration numbered 0."""
        alive_at_end = [not s.freed for s in self.storages]
        # Storages released before the first op never coexist with an op: drop them.
        dropped = {r[4] for r in self.rows if r[0] < 0 and r[1] is Role.FREE}
        unnamed = 0
        for k, st in enumerate(self.storages):
            if st.name is None and k not in dropped:
                st.name = resident_id(unnamed)
                unnamed += 1

        def kind(t: _Tensor) -> Kind:
            if t.constant:
                return Kind.PARAMETER if alive_at_end[t.storage] else Kind.INPUT
            if t.backward and alive_at_end[t.storage]:
                return Kind.GRADIENT
            return Kind.ACTIVATION

        starts, clock = [], 0
        for _, _, dur, _ in self.ops:
            starts.append(clock)
            clock += dur

        cols: dict[str, list] = {
            c: []
            for c in (
                Col.OP,
                Col.ROLE,
                Col.ARG,
                Col.TENSOR,
                Col.STORAGE,
                Col.ALLOC,
                Col.ALIASES,
                Col.VIEW_OF,
                Col.BYTES,
                Col.STORAGE_BYTES,
                Col.KIND,
                Col.OP_NAME,
                Col.PHASE,
                Col.START_NS,
                Col.DURATION_NS,
                Col.SEEDED,
            )
        }

        def add(op, role, arg, tensor_name, storage, alloc, aliases, view_of, nbytes, knd):
            st = self.storages[storage]
            cols[Col.OP].append(op)
            cols[Col.ROLE].append(role.value)
            cols[Col.ARG].append(arg)
            cols[Col.TENSOR].append(tensor_name)
            cols[Col.STORAGE].append(st.name)
            cols[Col.ALLOC].append(alloc)
            cols[Col.ALIASES].append(aliases)
            cols[Col.VIEW_OF].append(view_of)
            cols[Col.BYTES].append(nbytes)
            cols[Col.STORAGE_BYTES].append(st.size_bytes)
            cols[Col.KIND].append(knd)
            if op >= 0 and role is not Role.FREE:
                name, phase, dur, seeded = self.ops[op]
                cols[Col.OP_NAME].append(name)
                cols[Col.PHASE].append(phase.value)
                cols[Col.START_NS].append(starts[op])
                cols[Col.DURATION_NS].append(dur)
                cols[Col.SEEDED].append(seeded)
            else:
                for c in (Col.OP_NAME, Col.PHASE, Col.START_NS, Col.DURATION_NS, Col.SEEDED):
                    cols[c].append(None)

        storage_kind: dict[int, str] = {}
        for t in self.tensors:
            storage_kind.setdefault(t.storage, kind(t).value)
        for k, st in enumerate(self.storages):
            if st.resident and k not in dropped:
                add(
                    -1,
                    Role.RESIDENT,
                    -1,
                    st.name,
                    k,
                    None,
                    None,
                    None,
                    st.size_bytes,
                    storage_kind[k],
                )
        for op, role, arg, tensor, storage, alloc, aliases in self.rows:
            if storage in dropped:
                continue
            if role is Role.FREE:
                add(
                    op,
                    role,
                    -1,
                    self.storages[storage].name,
                    storage,
                    None,
                    None,
                    None,
                    self.storages[storage].size_bytes,
                    storage_kind[storage],
                )
                continue
            t = self.tensors[tensor]
            view_of = None
            if role is Role.OUTPUT and not alloc:
                view_of = self.storages[storage].name
            add(
                op, role, arg, t.name, storage, alloc, aliases, view_of, t.size_bytes, kind(t).value
            )

        n = len(cols[Col.OP])
        cols[Col.ITERATION] = [0] * n
        cols[Col.EVENT] = list(range(n))
        cols[Col.SHAPE] = [[] for _ in range(n)]
        cols[Col.DTYPE] = ["unknown"] * n
        cols[Col.OP_ARGS] = [None] * n
        return pd.DataFrame(cols)


def _parse(line: str, source: str, lineno: int) -> dict:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DtrLogError(f"{source}:{lineno}: not a JSON line ({exc.msg})") from None
    if not isinstance(d, dict):
        raise DtrLogError(f"{source}:{lineno}: not a JSON object")
    return d


# ---- opening a log: a file, or a member of a zip -------------------------------------------
DTR_LOGS_VARIABLE = "CAPUCHIN_DTR_LOGS"


def dtr_logs_path() -> Path:
    """Where the DTR logs zip is: ``$CAPUCHIN_DTR_LOGS`` when set (it must then be a file), else
    ``shared/data/dtr-logs.zip`` beside the repository root (``../shared`` from the folder of
    this package, as the CI and the work trees lay it out). The default may not exist: callers
    check (tests skip, benchmarks refuse)."""
    env = os.environ.get(DTR_LOGS_VARIABLE)
    if env:
        path = Path(env)
        if not path.is_file():
            raise CapuchinError(f"{path}: ${DTR_LOGS_VARIABLE} names no file")
        return path
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "dtr-logs.zip"


def list_dtr_logs(zip_path: str | os.PathLike) -> list[str]:
    """The ``.log`` members of a DTR logs zip, sorted."""
    with zipfile.ZipFile(zip_path) as zf:
        return sorted(n for n in zf.namelist() if n.endswith(".log"))


def read_dtr_log_lines(log: str | os.PathLike) -> tuple[list[str], str]:
    """The non-empty lines of a DTR log and its display name.

    ``log`` is a file, or a path through a zip: ``dtr-logs.zip/logs/resnet32-56-...log``; the member
    may be abbreviated to a unique prefix of its base name (``dtr-logs.zip/resnet32``).
    """
    path = Path(log)
    if path.is_file() and not zipfile.is_zipfile(path):
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise DtrLogError(f"{path}: cannot read ({exc})") from None
        return [ln for ln in text.splitlines() if ln.strip()], path.name
    zip_path, member = _split_zip_path(path)
    with zipfile.ZipFile(zip_path) as zf:
        logs = sorted(n for n in zf.namelist() if n.endswith(".log"))
        if not member:
            raise DtrLogError(
                f"{zip_path}: a zip of logs; name one of them, e.g. "
                f"{zip_path}/{logs[0] if logs else 'logs/NAME.log'} (members: "
                f"{', '.join(Path(m).name for m in logs)})"
            )
        matches = [m for m in logs if m == member] or [
            m for m in logs if Path(m).name.startswith(Path(member).name)
        ]
        if len(matches) != 1:
            what = "no member" if not matches else "several members"
            raise DtrLogError(
                f"{zip_path}: {what} matching {member!r} (members: "
                f"{', '.join(Path(m).name for m in logs)})"
            )
        text = io.TextIOWrapper(zf.open(matches[0]), encoding="utf-8").read()
    return [ln for ln in text.splitlines() if ln.strip()], Path(matches[0]).name


def _split_zip_path(path: Path) -> tuple[Path, str]:
    if path.exists() and not path.is_file():
        what = "a folder" if path.is_dir() else "not a regular file (a device, a pipe?)"
        raise DtrLogError(f"{path}: {what}; give a DTR log file (or a path inside a zip of logs)")
    for parent in [path, *path.parents]:
        if parent.is_file():
            if not zipfile.is_zipfile(parent):
                break
            return parent, path.relative_to(parent).as_posix().strip(".").strip("/")
    raise DtrLogError(f"{path}: no such file (nor a path inside a zip file)")


# ---- the API -------------------------------------------------------------------------------
def dtr_log_events(
    lines: list[str], source: str = "<log>", *, require_complete: bool = False
) -> tuple[pd.DataFrame, bool]:
    """Convert DTR log lines into a trace event table (one iteration, numbered 0).

    Returns ``(events, saw_backward_marker)``. See Note [DTR log semantics]. With
    ``require_complete`` (what ``import_dtr_log`` asks) a log that ends still holding most of
    its peak memory is refused as cut short (Note [Complete logs]).
    """
    conv = _Converter(source)
    conv.run(lines)
    if not conv.ops:
        raise DtrLogError(f"{source}: the log has no CALL or MUTATE instruction")
    left, peak = conv.live_result_bytes, conv.peak_result_bytes
    if require_complete and peak > 0 and left > CUT_LOG_FRACTION * peak:
        where = "" if conv.saw_backward_marker else " before its ANNOTATE BACKWARD marker"
        raise DtrLogError(
            f"{source}: the log ends{where} with {left} bytes of op results still referenced, "
            f"{left / peak:.0%} of its peak; a complete iteration releases its activations, so "
            "the log was cut short (see Note [Complete logs])"
        )
    return conv.events(), conv.saw_backward_marker


def default_trace_name(log_name: str) -> str:
    """``resnet32-56-9000000000.0-...log`` -> ``dtr-resnet32-56.trace.parquet``."""
    parts = Path(log_name).name.split("-")
    return "dtr-" + "-".join(parts[:2]) + FILE_SUFFIX


def import_dtr_log(
    log: str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    bandwidth_bytes_per_s: float = PCIE3_X16_BYTES_PER_S,
    force: bool = False,
) -> Path:
    """Convert one DTR log into a trace file and return its path.

    ``log``: a log file or a path inside the zip (see ``read_dtr_log_lines``). ``out``: the trace
    path (default ``dtr-<model>-<batch>.trace.parquet`` in the current directory); an existing file
    is replaced only with ``force``. ``bandwidth_bytes_per_s``: host<->device copy bandwidth stored
    for both directions (default 12e9 B/s, the paper's PCIe 3.0 x16). Written atomically.
    """
    if not bandwidth_bytes_per_s > 0:
        raise CapuchinError(f"bandwidth must be positive, got {bandwidth_bytes_per_s}")
    lines, name = read_dtr_log_lines(log)  # a missing log is the first thing to say
    out_path = check_output(
        out if out is not None else default_trace_name(name), force=force, inputs=[log]
    )
    events, marker = dtr_log_events(lines, source=name, require_complete=True)
    fields = name.split("-")
    meta = TraceMeta(
        capuchin_version=__version__,
        device="cuda",
        device_name=DTR_DEVICE_NAME,
        bandwidth_d2h_bytes_per_s=float(bandwidth_bytes_per_s),
        bandwidth_h2d_bytes_per_s=float(bandwidth_bytes_per_s),
        iterations=[0],
        warmup=0,
        script=name,
        argv=[],
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        regular=True,
        steady_iteration=0,
        source="dtr-log",
        extra={
            "dtr_log": name,
            "dtr_model": fields[0],
            "dtr_batch": fields[1] if len(fields) > 1 else "",
            "dtr_budget_bytes": fields[2] if len(fields) > 2 else "",
            "backward_marker": marker,
            "shapes": "unknown (DTR logs record sizes only)",
        },
    )
    return write_trace(events, meta, out_path, force=force)

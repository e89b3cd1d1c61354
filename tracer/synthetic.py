"""Synthetic traces in the real trace format (tracer/schema.py), for tests, benchmarks and notebooks.

``trace_from_ops`` turns a small hand-written op list into an in-memory ``Trace`` whose event table
is exactly what the tracer would record, so hand-built problems go through the same
``Problem.from_trace`` path as recorded ones. ``transformer_ops`` generates a layered
transformer-like training iteration (forward, backward, optimizer) of any size.

# Note: [Synthetic storage ids]
# Hand-written traces name storages freely ("A", "W1"); tensor ids equal storage ids. The planner
# treats ids as opaque strings, so this is enough for everything but the runtime.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import pandas as pd

from .reader import Trace
from .schema import COLUMNS, Col, Kind, Phase, Role, TraceMeta


@dataclass(frozen=True)
class OpSpec:
    """One op of a hand-written trace. Storages in ``outputs`` not seen before are allocated by
    this op; storages read before any op produced them exist at iteration start."""

    name: str
    duration_ns: int
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()  # storages written in place (they are also read)
    phase: Phase = Phase.FORWARD
    seeded: bool = False


def _spec(op) -> OpSpec:
    if isinstance(op, OpSpec):
        return op
    name, dur, *rest = op
    inputs = tuple(rest[0]) if len(rest) > 0 else ()
    outputs = tuple(rest[1]) if len(rest) > 1 else ()
    writes = tuple(rest[2]) if len(rest) > 2 else ()
    phase = Phase(rest[3]) if len(rest) > 3 else Phase.FORWARD
    return OpSpec(name, int(dur), inputs, outputs, writes, phase)


def trace_from_ops(
    ops: Sequence[OpSpec | tuple],
    sizes: Mapping[str, int],
    *,
    persistent: Iterable[str] = (),
    live_at_end: Iterable[str] = (),
    kinds: Mapping[str, Kind] | None = None,
    bandwidth_bytes_per_s: float = 1e9,
    bandwidth_h2d_bytes_per_s: float | None = None,
    iterations: int = 1,
) -> Trace:
    """Build a ``Trace`` from ops given as ``OpSpec`` or tuples
    ``(name, duration_ns, inputs, outputs[, writes[, phase]])`` and storage sizes in bytes.

    Storages read before being produced exist at iteration start: ``persistent`` ones are
    parameters, the others inputs. A ``persistent`` storage no op accesses is a resident parameter
    (it counts in the resident memory). Storages produced inside the iteration are activations, freed
    right after their last access unless listed in ``live_at_end`` (or persistent: gradients).
    ``bandwidth_bytes_per_s`` is both copy directions unless ``bandwidth_h2d_bytes_per_s`` is
    given. ``iterations`` repeats the same iteration (all regular).
    """
    specs = [_spec(o) for o in ops]
    persistent = set(persistent)
    keep = set(live_at_end) | persistent
    kinds = dict(kinds or {})
    last: dict[str, int] = {}
    produced: dict[str, int] = {}
    for k, op in enumerate(specs):
        for s in (*op.inputs, *op.writes, *op.outputs):
            last[s] = k
        for s in op.outputs:
            produced.setdefault(s, k)
    pre = [s for s in last if s not in produced or _read_before(specs, s, produced[s])]
    for s in last:
        if s not in sizes:
            raise ValueError(f"storage {s!r} has no size")
        if s not in kinds:
            if s in pre:
                kinds[s] = Kind.PARAMETER if s in persistent else Kind.INPUT
            else:
                kinds[s] = Kind.GRADIENT if s in persistent else Kind.ACTIVATION
    # persistent storages no op touches (a frozen parameter) are resident memory all the same
    for s in persistent:
        if s not in sizes:
            raise ValueError(f"storage {s!r} has no size")
    idle = [s for s in sizes if s in persistent and s not in last]  # in a stable order
    for s in idle:
        kinds.setdefault(s, Kind.PARAMETER)

    rows: list[dict] = []
    t_ns = 0
    starts = []
    for op in specs:
        starts.append(t_ns)
        t_ns += op.duration_ns
    for it in range(iterations):
        ev = 0

        def row(role, k, s, arg=-1, alloc=None, op=None, start=None, *, _it=it):
            nonlocal ev
            rows.append(
                {
                    Col.ITERATION: _it,
                    Col.EVENT: ev,
                    Col.OP: k,
                    Col.OP_NAME: op.name if op else None,
                    Col.PHASE: op.phase.value if op else None,
                    Col.ROLE: role.value,
                    Col.ARG: arg,
                    Col.TENSOR: s if op else None,
                    Col.STORAGE: s,
                    Col.ALLOC: alloc,
                    Col.ALIASES: -1 if role == Role.OUTPUT else None,
                    Col.VIEW_OF: None,
                    Col.BYTES: int(sizes[s]),
                    Col.STORAGE_BYTES: int(sizes[s]),
                    Col.SHAPE: [max(int(sizes[s]) // 4, 0)],
                    Col.DTYPE: "float32",
                    Col.KIND: kinds[s].value,
                    Col.START_NS: start,
                    Col.DURATION_NS: op.duration_ns if op else None,
                    Col.SEEDED: op.seeded if op else None,
                    Col.OP_ARGS: "" if op else None,
                }
            )
            ev += 1

        for s in pre:
            row(Role.RESIDENT, -1, s)
        for s in idle:  # resident storages never accessed
            row(Role.RESIDENT, -1, s)
        seen = set(pre)
        for k, op in enumerate(specs):
            arg = 0
            for s in op.inputs:
                row(Role.INPUT, k, s, arg, op=op, start=starts[k])
                arg += 1
            for s in op.writes:
                row(Role.WRITE, k, s, arg, op=op, start=starts[k])
                arg += 1
            for j, s in enumerate(op.outputs):
                row(Role.OUTPUT, k, s, j, alloc=s not in seen, op=op, start=starts[k])
                seen.add(s)
            for s in dict.fromkeys((*op.inputs, *op.writes, *op.outputs)):
                if last[s] == k and s not in keep:
                    row(Role.FREE, k, s)
    meta = TraceMeta(
        device="cpu",
        bandwidth_d2h_bytes_per_s=float(bandwidth_bytes_per_s),
        bandwidth_h2d_bytes_per_s=float(bandwidth_h2d_bytes_per_s or bandwidth_bytes_per_s),
        iterations=list(range(iterations)),
        steady_iteration=iterations - 1,
        source="synthetic",
    )
    events = pd.DataFrame(rows, columns=list(COLUMNS))
    return Trace(path=None, events=events, meta=meta)


def _read_before(specs: Sequence[OpSpec], s: str, k: int) -> bool:
    op = specs[k]
    return s in op.inputs or s in op.writes


def transformer_ops(
    layers: int = 2,
    ops_per_layer: int = 24,
    *,
    hidden_bytes: int = 1 << 20,
    seed: int = 0,
    mm_factor: int = 50,
) -> tuple[list[OpSpec], dict[str, int], set[str]]:
    """A transformer-like training iteration: ``layers`` blocks of ``ops_per_layer`` forward ops
    (activation chains with residual adds, some 4x-wide and some seeded "dropout" ops, one
    in-place op per block), the mirrored backward that reads the saved activations, and an SGD
    update per weight. Returns ``(ops, sizes, persistent)`` for ``trace_from_ops``; about
    ``2 * layers * ops_per_layer`` ops. Durations in ns: elementwise ops take ~1 ns per KB (a
    GPU streaming memory), matmuls ``mm_factor`` times longer.
    """
    import random

    rng = random.Random(seed)
    ops: list[OpSpec] = []
    sizes: dict[str, int] = {}
    persistent: set[str] = set()
    sizes["x"] = hidden_bytes
    cur = "x"
    saved: list[tuple[str, str, str, str, int]] = []  # (out, in, weight, name, dur)
    for L in range(layers):
        w = f"w{L}"
        sizes[w] = hidden_bytes // 2
        persistent.add(w)
        block_in = cur
        for i in range(ops_per_layer):
            out = f"a{L}.{i}"
            wide = i % 6 == 2
            sizes[out] = hidden_bytes * (4 if wide else 1)
            # elementwise ops stream memory (~1 TB/s); matmuls are compute-bound and ~50x longer
            dur = int(rng.uniform(0.5, 2.0) * sizes[out] / 1e3) + 1000
            if i % 6 == 0:
                ops.append(OpSpec("aten.mm.default", dur * mm_factor, (cur, w), (out,)))
                saved.append((out, cur, w, "mm", dur * mm_factor))
            elif i % 6 == 4:
                ops.append(OpSpec("aten.native_dropout.default", dur, (cur,), (out,), seeded=True))
                saved.append((out, cur, "", "dropout", dur))
            elif i % 6 == 5:
                ops.append(OpSpec("aten.add.Tensor", dur, (cur, block_in), (out,)))
                saved.append((out, cur, block_in, "add", dur))
                block_in = out
            else:
                ops.append(OpSpec("aten.gelu.default", dur, (cur,), (out,)))
                saved.append((out, cur, "", "gelu", dur))
            if i == 1:  # one in-place op per block
                ops.append(OpSpec("aten.relu_.default", dur // 2 + 1, (), (out,), (out,)))
            cur = out
    sizes["loss"] = 4
    ops.append(OpSpec("aten.sum.default", 1000, (cur,), ("loss",)))
    sizes["g"] = sizes[cur]
    ops.append(OpSpec("aten.ones_like.default", 1000, ("loss",), ("g",), (), Phase.BACKWARD))
    g = "g"
    grads: dict[str, str] = {}
    for n, (out, inp, w, name, dur) in enumerate(reversed(saved)):
        gi = f"g{n}"
        sizes[gi] = sizes[inp]
        reads = (g, out, inp) if name in ("gelu", "mm") else (g, out)
        if w and w in persistent:
            reads += (w,)
            if w not in grads:  # the first gradient of a weight is produced, later ones accumulate
                grads[w] = f"grad_{w}"
                sizes[grads[w]] = sizes[w]
                persistent.add(grads[w])
                ops.append(
                    OpSpec(
                        f"aten.{name}_backward", dur * 2, reads, (gi, grads[w]), (), Phase.BACKWARD
                    )
                )
            else:
                ops.append(
                    OpSpec(
                        f"aten.{name}_backward", dur * 2, reads, (gi,), (grads[w],), Phase.BACKWARD
                    )
                )
        else:
            ops.append(OpSpec(f"aten.{name}_backward", dur * 2, reads, (gi,), (), Phase.BACKWARD))
        g = gi
    for w, gw in grads.items():
        ops.append(OpSpec("aten.add_.Tensor", 500, (gw,), (), (w,), Phase.OPTIMIZER))
    return ops, sizes, persistent


def random_ops(
    seed: int, n_forward: int = 8, *, max_bytes: int = 1000
) -> tuple[list[OpSpec], dict[str, int], set[str]]:
    """A random training-like iteration for property tests: a forward chain with skip reads,
    parameters, in-place ops and two-output ops, then a backward pass reading saved activations
    in reverse. Returns ``(ops, sizes, persistent)`` for ``trace_from_ops``."""
    import random

    rng = random.Random(seed)
    ops: list[OpSpec] = []
    sizes: dict[str, int] = {"x": rng.randint(1, max_bytes)}
    persistent: set[str] = set()
    acts = ["x"]
    for i in range(n_forward):
        out = f"a{i}"
        sizes[out] = rng.randint(1, max_bytes)
        reads = [acts[-1]]
        if len(acts) > 2 and rng.random() < 0.3:
            reads.append(rng.choice(acts[:-1]))
        if rng.random() < 0.4:
            w = f"w{i}"
            sizes[w] = rng.randint(1, max_bytes // 4 + 1)
            persistent.add(w)
            reads.append(w)
        outs = [out]
        if rng.random() < 0.2:
            sizes[f"s{i}"] = rng.randint(1, 16)
            outs.append(f"s{i}")
        ops.append(
            OpSpec(
                f"f{i}", rng.randint(10, 1000), tuple(reads), tuple(outs), seeded=rng.random() < 0.1
            )
        )
        if rng.random() < 0.2:
            ops.append(OpSpec(f"inplace{i}", rng.randint(5, 100), (), (), (out,)))
        acts.append(out)
    sizes["g"] = 4
    ops.append(OpSpec("loss", 10, (acts[-1],), ("g",)))
    g = "g"
    for i in reversed(range(n_forward)):
        gi = f"g{i}"
        sizes[gi] = rng.randint(1, max_bytes)
        saved = {acts[i + 1], acts[i]}
        if rng.random() < 0.3:
            saved.add(rng.choice(acts))
        ops.append(
            OpSpec(f"b{i}", rng.randint(10, 2000), (g, *sorted(saved)), (gi,), (), Phase.BACKWARD)
        )
        g = gi
    return ops, sizes, persistent

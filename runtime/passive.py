"""Passive mode (paper §4.2): when the run is not following a plan and resident bytes would exceed
the budget, evict on demand (swap, least recently used first) and continue.

It runs where no plan applies: a run without a plan (``Runtime(budget_bytes=...)``), the rest of an
iteration that diverged from its plan, and iterations the plan does not cover. It tracks the
storages that ops allocate while it is on (an LRU order of last access) and only ever evicts those
(Note [Storage-level eviction] in state.py).

# Note: [Passive budget on CPU]
# Memory: on CUDA the allocator's own count (``memory_allocated``) decides; on a real out-of-memory
# error (the runtime caps the process with ``set_per_process_memory_fraction``) the tracker evicts
# and retries the op. The CPU allocator keeps no count outside the profiler, so on CPU resident
# bytes are ``base_bytes`` (what was resident and untracked when tracking began: the storages
# reachable from the optimizers) plus the tracked storages. Measured against the profiler's
# allocator events this is exact at op boundaries (the examples: within 0.2 KiB); what it missed
# was *inside* an op: the op's outputs are allocated before the tracker sees them, so evicting
# after the op let the measured peak overshoot by the largest output (2 MiB of a 19.6 MiB budget
# on the transformer, an addmm; +10%). So room is made *before* each op for what it will allocate:
# the bytes of its evicted inputs that come back, plus its new outputs, predicted by running the
# op on meta tensors (shapes only, no data, no RNG) the first time a (op, argument shapes) pair
# is seen, and learned from the real outputs after each run (``new_bytes``). Scratch memory a
# kernel uses and frees before returning (a convolution's: about its output's size again) is
# invisible to both; the trace measured it (Role.SCRATCH rows), so when the plan's trace is at
# hand its scratch is budgeted too: exactly for an op name and input shapes seen in the trace,
# else at that op name's largest scratch-to-input ratio (``use_trace_scratch``). Without a trace
# (``Runtime(budget_bytes=...)``) on CPU, the few ops whose kernels were measured to need
# workspace get a default (``_CPU_SCRATCH``, from the bundled CNN's trace: a convolution about
# its output again, its backward about its inputs, batch norm's backward its output); without
# it the CNN in passive mode alone measured 1.09x its budget.
# The storages tracked while a plan is followed (``Executor.watching``) make the estimate complete
# when a diverged iteration switches to passive mode; at a first divergence in an unwatched
# iteration the tensors autograd saved so far are found through the graph and counted
# (``Executor._discover``, Note [Watched iterations] in tracker.py).
# What passive eviction cannot reach (parameters, gradients and optimizer state allocated in an
# earlier iteration, the op's own inputs and outputs) is counted: ``short_bytes`` is the most the
# estimate stayed over the budget with nothing left to evict, reported per iteration.
"""

from __future__ import annotations

import collections
import weakref

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..tracer.hooks import flatten_outputs
from ..tracer.schema import shape_signature
from .state import storage_key, storages

_CACHE_MAX = 65536  # (op, argument shapes) pairs remembered; cleared when full

# Scratch of CPU kernels measured by the tracer (Role.SCRATCH) on the bundled CNN, as a multiple
# of the op's new output bytes ("out") or of its input bytes ("in"); used only without a trace.
_CPU_SCRATCH = {"aten.convolution.default": "out",
                "aten.convolution_backward.default": "in",
                "aten.native_batch_norm_backward.default": "out"}


class PassiveTracker:
    dynamic = False  # runtime/dynamic.py's DynamicTracker: DTR's eviction instead of LRU swaps

    def __init__(self, budget_bytes: int | None, device: torch.device):
        self.budget_bytes = budget_bytes
        self.device_type = device.type
        self.lru: collections.OrderedDict[int, tuple[weakref.ref, int]] = collections.OrderedDict()
        self.in_iteration: set[int] = set()  # keys allocated in the current iteration
        self.tracked_bytes = 0  # tracked and resident
        self.base_bytes = 0
        self.active = False
        self.new_bytes: dict[tuple, int] = {}  # (op, argument shapes) -> bytes its outputs allocate
        self.scratch_exact: dict[tuple[str, str], int] = {}  # (op name, shape signature) -> bytes
        self.scratch_ratio: dict[str, float] = {}  # op name -> largest scratch / input bytes
        self.has_trace = False

    def use_trace_scratch(self, problem, min_bytes: int = 4096) -> None:
        """Budget the scratch memory the trace measured (``planner.problem.Problem``)."""
        self.has_trace = True
        for o in problem.ops:
            if o.scratch_bytes < min_bytes:
                continue
            key = (o.name, o.signature)
            self.scratch_exact[key] = max(self.scratch_exact.get(key, 0), o.scratch_bytes)
            ins = sum(problem.storages[s].size_bytes for s in set(o.inputs)
                      if s in problem.storages)
            if ins > 0:
                self.scratch_ratio[o.name] = max(self.scratch_ratio.get(o.name, 0.0),
                                                 o.scratch_bytes / ins)

    def scratch(self, name: str, flat: list, out_bytes: int) -> int:
        """Scratch bytes op ``name`` on inputs ``flat`` (allocating ``out_bytes`` of new
        outputs) is expected to use (0 if unknown)."""
        ratio = self.scratch_ratio.get(name)
        if ratio is None:
            if self.has_trace or self.device_type != "cpu":
                return 0
            how = _CPU_SCRATCH.get(name)
            if how is None:
                return 0
            if how == "out":
                return out_bytes
            ratio = 1.0
        else:
            n = self.scratch_exact.get((name, shape_signature(t.shape for t in flat)))
            if n is not None:
                return n
        return int(ratio * sum(st.nbytes() for _, st in storages(flat)))

    def start(self, base_bytes: int) -> None:
        self.active = True
        self.base_bytes = base_bytes

    def new_iteration(self) -> None:
        self.in_iteration.clear()

    def estimate_bytes(self) -> int:
        return self.base_bytes + self.tracked_bytes

    # ---- what an op will allocate (Note [Passive budget on CPU]) ---------------------------------
    def predict(self, func, args: tuple, kwargs: dict) -> tuple[tuple | None, int]:
        """``(key, bytes)``: the bytes op ``func`` will allocate for new outputs on this device,
        learned from an earlier run of the same op on the same argument shapes, else computed on
        meta tensors (0 if the op has no meta kernel; learned after it runs)."""
        try:
            key = (func, _sig(args), _sig(kwargs) if kwargs else ())
            hash(key)
        except (TypeError, RuntimeError):  # an unhashable argument; a tensor without strides
            return None, 0
        n = self.new_bytes.get(key)
        if n is None:
            n = _meta_new_bytes(func, args, kwargs)
            if n is None:
                return key, 0
            self._remember(key, n)
        return key, n

    def track_outputs(self, outs: list, input_keys: set[int], key: tuple | None = None) -> int:
        """Track the storages ``outs`` allocated (not inputs, not tracked yet). Returns their bytes
        and remembers them for ``key`` (from ``predict``)."""
        new = 0
        for t in outs:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if st.device.type != self.device_type:
                continue
            k = storage_key(st)
            if k in input_keys:
                continue
            if k in self.lru:
                self.lru.move_to_end(k)
                continue
            self.in_iteration.add(k)
            new += self._track(k, st)
        if key is not None:
            self._remember(key, new)
        return new

    def _remember(self, key: tuple, n: int) -> None:
        """What op ``key`` allocates (bounded cache: cleared when full)."""
        if len(self.new_bytes) >= _CACHE_MAX:
            self.new_bytes.clear()
        self.new_bytes[key] = n

    def count(self, st) -> None:
        """Count a resident storage passive mode did not see allocated (never evicted by it)."""
        k = storage_key(st)
        if k not in self.lru:
            self._track(k, st)

    def _track(self, k: int, st) -> int:
        """Start counting storage ``st`` (key ``k``) until it dies; returns its bytes."""
        n = st.nbytes()
        self.lru[k] = (weakref.ref(st, self._died(k)), n)
        self.tracked_bytes += n
        return n

    def touch(self, keys) -> None:
        lru = self.lru
        for key in keys:
            if key in lru:
                lru.move_to_end(key)

    def _died(self, key: int):
        def cb(_ref, self=self, key=key):
            item = self.lru.pop(key, None)
            self.in_iteration.discard(key)
            if item is not None:
                self.tracked_bytes -= item[1]
        return cb

    def evicted(self, key: int) -> None:
        item = self.lru.get(key)
        if item is not None:
            self.tracked_bytes -= item[1]
            self.lru[key] = (item[0], 0)

    def restored(self, key: int, nbytes: int) -> None:
        item = self.lru.get(key)
        if item is not None:
            self.tracked_bytes += nbytes - item[1]
            self.lru[key] = (item[0], nbytes)
            self.lru.move_to_end(key)

    def victims(self, need_bytes: int, protect: set[int]):
        """Least recently used resident storages allocated in this iteration, until ``need_bytes``
        are covered. Yields (key, storage, nbytes)."""
        got = 0
        for key, (ref, n) in list(self.lru.items()):
            if got >= need_bytes:
                return
            if n == 0 or key in protect or key not in self.in_iteration:
                continue
            st = ref()
            if st is None or st.nbytes() == 0 or not st.resizable():
                continue
            got += n
            yield key, st, n


def _sig(x):
    """A hashable summary of op arguments: tensors by shape, strides and dtype (enough to know
    what the op allocates), everything else as itself."""
    if isinstance(x, torch.Tensor):
        return (x.shape, x.stride(), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_sig(a) for a in x)
    if isinstance(x, dict):
        return tuple((k, _sig(v)) for k, v in x.items())
    return x


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(a) for a in x)
    return x


def _meta_new_bytes(func, args: tuple, kwargs: dict) -> int | None:
    """Bytes of the new output storages of ``func`` computed on meta tensors (no data is read or
    written and no generator advances), or None when that is not possible. An op without tensor
    arguments runs on meta only through its ``device`` argument; without one it is not run (it
    would run for real)."""
    try:
        rets = func._schema.returns
        if rets and all(r.alias_info is not None for r in rets):
            return 0  # views and in-place/out= ops return their inputs' storages
        margs = [_to_meta(a) for a in args]
        mkw = {k: _to_meta(v) for k, v in kwargs.items()}
        has_tensor = any(isinstance(a, torch.Tensor) for a in _leaves(margs, mkw))
        dev = [i for i, a in enumerate(func._schema.arguments) if a.name == "device"]
        if dev:
            if dev[0] < len(margs):
                margs[dev[0]] = torch.device("meta")
            else:
                mkw["device"] = torch.device("meta")
        elif not has_tensor:
            return None
        if any(isinstance(a, torch.Tensor) and a.device.type != "meta"
               for a in _leaves(margs, mkw)):
            return None
        ins = {storage_key(a.untyped_storage()) for a in _leaves(margs, mkw)
               if isinstance(a, torch.Tensor)}
        with _disable_current_modes(), torch.no_grad():
            out = func(*margs, **mkw)
        seen = set()
        total = 0
        for o in flatten_outputs(out):
            st = o.untyped_storage()
            k = storage_key(st)
            if k in ins or k in seen:
                continue
            seen.add(k)
            total += st.nbytes()
        return total
    except Exception:  # no meta kernel, data-dependent output, ...: learned after the run
        return None


def _leaves(margs, mkw):
    for a in (*margs, *mkw.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a

"""Device memory accounting for the budget guard: what an op will allocate (outputs and kernel
scratch), how many bytes are resident, and what was resident before the guard started counting.
The device-specific part of passive mode; the guards themselves (guards/) are device-neutral.

``memory_for(device, plan)`` gives ``CPUMemory`` or ``CUDAMemory``. Both predict an op's new output
bytes on meta tensors and reserve the scratch the plan's trace measured (``Plan.op_scratch_bytes``:
written by the planner, so the runtime needs no trace). They differ in what the device counts:

- CUDA: the caching allocator counts every byte (``resident_bytes`` is ``memory_allocated``) and a
  real out-of-memory error is raised under ``set_per_process_memory_fraction``; nothing needs
  discovering.
- CPU: the allocator keeps no count outside the profiler, so resident bytes are the guard's own
  estimate (Note [Passive budget on CPU] in guards/lru.py); kernels whose scratch was measured on the
  bundled CNN get a default when there is no plan (``_CPU_SCRATCH``); and at a first divergence
  the tensors an iteration left resident are found through the autograd graph (``discover``).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..peak import op_window
from ..tracer.hooks import flatten_outputs
from ..tracer.schema import shape_signature
from .state import storage_key

_CACHE_MAX = 65536  # (op, argument shapes) pairs remembered; cleared when full
_SCRATCH_MIN_BYTES = 4096  # smaller measured scratch is noise of the allocator accounting
_WATCHES = 2  # Note [Scratch learned on CUDA]: times each (op name, shapes) is watched

# Scratch of CPU kernels measured by the tracer (Role.SCRATCH) on the bundled CNN, as a multiple
# of the op's new output bytes ("out") or of its input bytes ("in"); used only without a plan.
_CPU_SCRATCH = {
    "aten.convolution.default": "out",
    "aten.convolution_backward.default": "in",
    "aten.native_batch_norm_backward.default": "out",
}

_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}  # autograd node class -> its "_saved_*" names


class DeviceMemory:
    """Accounting common to every device: output prediction (meta tensors, learned after each
    run) and the plan's per-op scratch."""

    device_type = "cpu"

    def __init__(self, plan=None):
        self.new_bytes: dict[tuple, int] = {}  # (op, argument shapes) -> bytes its outputs allocate
        self.scratch_exact: dict[tuple[str, str], int] = {}  # (op name, shape signature) -> bytes
        self.scratch_ratio: dict[str, float] = {}  # op name -> largest scratch per input element
        self.has_plan_scratch = False
        if plan is not None:
            self.use_plan_scratch(plan)

    # ---- scratch ---------------------------------------------------------------------------------
    def use_plan_scratch(self, plan) -> None:
        """Reserve the scratch the plan's trace measured (``Plan.op_scratch_bytes``): exactly for an
        op name and input shapes seen there, else at that op name's largest scratch per input
        element (the shapes of the signature)."""
        scratch = list(getattr(plan, "op_scratch_bytes", None) or ())
        if not scratch:
            return
        self.has_plan_scratch = True
        for (name, *rest), n in zip(plan.ops, scratch, strict=False):
            self.note_scratch(name, rest[0] if rest else "", n)

    def note_scratch(self, name: str, sig: str, n: int) -> None:
        """Op ``name`` on input shapes ``sig`` took ``n`` bytes of scratch: reserved exactly for
        those shapes, and per input element for the name (the largest seen); below
        ``_SCRATCH_MIN_BYTES`` it is noise."""
        if n < _SCRATCH_MIN_BYTES:
            return
        key = (name, sig)
        self.scratch_exact[key] = max(self.scratch_exact.get(key, 0), int(n))
        elems = _signature_elements(sig)
        if elems > 0:
            self.scratch_ratio[name] = max(self.scratch_ratio.get(name, 0.0), n / elems)

    def scratch(self, name: str, flat: list, out_bytes: int, evicted_bytes: int = 0) -> int:
        """Scratch bytes op ``name`` on inputs ``flat`` (allocating ``out_bytes`` of new outputs)
        is expected to use (0 if unknown). ``evicted_bytes``: the bytes of the input storages that
        are evicted now and come back before the op runs (an evicted storage reads 0 bytes;
        Note [Scratch of evicted inputs])."""
        ratio = self.scratch_ratio.get(name)
        if ratio is None:
            return self._default_scratch(name, flat, out_bytes, evicted_bytes)
        n = self.scratch_exact.get((name, shape_signature(t.shape for t in flat)))
        if n is not None:
            return n
        return int(ratio * sum(t.numel() for t in flat))

    def _default_scratch(self, name: str, flat: list, out_bytes: int, evicted_bytes: int) -> int:
        return 0

    # ---- outputs ---------------------------------------------------------------------------------
    def predict(self, func, args: tuple, kwargs: dict) -> tuple[tuple | None, int]:
        """``(key, bytes)``: the bytes op ``func`` will allocate for new outputs, learned from an
        earlier run of the same op on the same argument shapes (``learn``), else computed on meta
        tensors (0 if the op has no meta kernel; learned after it runs)."""
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
            self.learn(key, n)
        return key, n

    def learn(self, key: tuple | None, n: int) -> None:
        """What op ``key`` (from ``predict``) allocated (bounded cache: cleared when full)."""
        if key is None:
            return
        if len(self.new_bytes) >= _CACHE_MAX:
            self.new_bytes.clear()
        self.new_bytes[key] = n

    # ---- the device's own count ------------------------------------------------------------------
    def allocated_bytes(self) -> int | None:
        """The allocator's count of device bytes, or None where the guard must estimate."""
        return None

    def learns_scratch(self) -> bool:
        """Does this device watch each guarded op for its scratch (Note [Scratch learned on
        CUDA])?"""
        return False

    def discover(self, flat: list) -> list:
        """Tensors resident on this device that the guard never saw allocated (see ``CPUMemory``);
        none where the allocator counts everything."""
        return []


class CPUMemory(DeviceMemory):
    device_type = "cpu"

    def _default_scratch(self, name: str, flat: list, out_bytes: int, evicted_bytes: int) -> int:
        # Note: [Scratch of evicted inputs]
        # "in" is the input storages' bytes *as they will be when the op runs*. An evicted input
        # is resized to 0 bytes until its on-demand restore, which the LRU guard makes after it
        # has made room (guards/lru.py ``before_op``): counted at 0, a convolution backward whose
        # grad_output was swapped out reserved 2 MiB too little, and the CNN at 35% of its peak
        # measured 1.147x its budget in LRU mode with no shortfall reported. So the caller
        # passes the evicted inputs' bytes (``evicted_bytes``) and they count here.
        if self.has_plan_scratch:
            return 0  # the plan's trace measured this op name's scratch: none worth reserving
        how = _CPU_SCRATCH.get(name)
        if how is None:
            return 0
        if how == "out":
            return out_bytes
        from .state import storages

        return sum(st.nbytes() for _, st in storages(flat)) + evicted_bytes

    def discover(self, flat: list) -> list:
        """What the ops before a first divergence in an unwatched iteration left resident (Note
        [Watched iterations] in tracker.py): the op's inputs, the live tensors that are part of an
        autograd graph (one scan of the garbage collector's objects, ~50-100 ms: the script's
        activations; detached data is not this iteration's) and the tensors autograd saved behind
        them and behind the backward node running now. Python frames are not read: ``f_locals``
        would keep a snapshot of the script's locals alive."""
        import gc

        with _disable_current_modes(), torch.no_grad():
            found = list(flat)
            tensor = torch.Tensor  # activations are plain tensors; an exact type test is cheap
            live = [o for o in gc.get_objects() if type(o) is tensor]
            found.extend(o for o in live if o.grad_fn is not None)
            del live
            stack = [_grad_fn(t) for t in found]
            node = torch._C._current_autograd_node()
            if node is not None:
                stack.append(node)
            seen = set()
            while stack:
                node = stack.pop()
                if node is None or node in seen:
                    continue
                seen.add(node)
                names = _SAVED_ATTRS.get(type(node))
                if names is None:
                    names = _SAVED_ATTRS[type(node)] = tuple(
                        a for a in dir(node) if a.startswith("_saved_")
                    )
                for attr in names:
                    try:
                        v = getattr(node, attr)
                    except Exception:  # freed by a backward already, or not a tensor
                        continue
                    if isinstance(v, torch.Tensor):
                        found.append(v)
                    elif isinstance(v, (list, tuple)):
                        found.extend(x for x in v if isinstance(x, torch.Tensor))
                stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
        return found


class CUDAMemory(DeviceMemory):
    device_type = "cuda"

    def __init__(self, device: torch.device, plan=None):
        super().__init__(plan)
        self.device = device
        # memory the budget does not count (Note [Budget and the allocator] in device.py):
        # subtracted from the allocator's count; the plan's trace measured it, and a run sets
        # the figure it uses everywhere (Runtime._count_non_tensor)
        prov = getattr(plan, "provenance", None)
        self.non_tensor_bytes = int(getattr(prov, "device_non_tensor_bytes", 0) or 0)
        self._watches: dict[tuple[str, str], int] = {}  # (op name, shapes) -> times watched
        self._watched: tuple[str, str] | None = None

    def allocated_bytes(self) -> int | None:
        from .device import allocated_bytes  # Note [Cheap memory counter]

        return max(0, allocated_bytes(self.device) - self.non_tensor_bytes)

    # Note: [Scratch learned on CUDA]
    # CUDA kernels take scratch from the caching allocator inside an op: on the H200 a
    # ``sum.dim_IntList`` over a 4 MiB gradient took 4 MiB, a convolution 4-5 MiB of cuDNN
    # workspace. A plan carries what its trace measured (``use_plan_scratch``); without one
    # (dynamic mode, passive mode on a plan-less run) nothing was reserved for it, and dynamic
    # mode measured 1.03-1.11x its budget with no shortfall reported. So where no plan's scratch
    # is known, each op on the guarded path is watched: the allocator's peak is read and
    # restarted right before the op runs and again right after (``op_window``, Note [One peak
    # counter] in peak.py), and the op's peak above what stays allocated after it is its
    # scratch, kept per op name and input shapes (and per input element for the name) as a
    # plan's would be: the same op on the same shapes gets it reserved from its next call on.
    # Each (name, shapes) is watched ``_WATCHES`` times: a watch costs two counter reads (about
    # 10 us each on the H200), and an op whose scratch depends on what the cap leaves (cuDNN's
    # choice of algorithm) gets a second look.
    def learns_scratch(self) -> bool:
        return not self.has_plan_scratch

    def op_starts(self, name: str, flat: list) -> None:
        key = (name, shape_signature(t.shape for t in flat))
        n = self._watches.get(key, 0)
        if n >= _WATCHES:  # learned: no more counter reads for this op on these shapes
            return
        self._watches[key] = n + 1
        op_window(self.device)
        self._watched = key

    def op_ends(self) -> None:
        key, self._watched = self._watched, None
        if key is not None:
            peak, cur = op_window(self.device)
            self.note_scratch(*key, peak - cur)


def memory_for(device: torch.device, plan=None) -> DeviceMemory:
    device = torch.device(device)
    if device.type == "cuda":
        return CUDAMemory(device, plan)
    return CPUMemory(plan)


def _signature_elements(sig: str) -> int:
    """Input elements named by a shape signature (``tracer.schema.shape_signature``)."""
    total = 0
    for part in sig.split(";") if sig else ():
        n = 1
        for d in part.split("x") if part else ():
            try:
                n *= int(d)
            except ValueError:
                n = 0
        total += n
    return total


def _grad_fn(t):
    try:
        return t.grad_fn
    except Exception:  # a tensor subclass without autograd metadata
        return None


def _sig(x):
    """A hashable summary of op arguments: tensors by shape, strides and dtype (enough to know
    what the op allocates), everything else as itself."""
    if isinstance(x, torch.Tensor):
        return (x.shape, x.stride(), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple([_sig(a) for a in x])  # a list first: cheaper than a generator (every op)
    if isinstance(x, dict):
        return tuple([(k, _sig(v)) for k, v in x.items()])
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
        if any(
            isinstance(a, torch.Tensor) and a.device.type != "meta" for a in _leaves(margs, mkw)
        ):
            return None
        ins = {
            storage_key(a.untyped_storage())
            for a in _leaves(margs, mkw)
            if isinstance(a, torch.Tensor)
        }
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

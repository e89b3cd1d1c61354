"""Per-storage runtime state: what is evicted, how it comes back, and the storage-level primitives.

# Note: [Storage-level eviction]
# Eviction frees the storage itself: ``untyped_storage().resize_(0)``. Every view, every user
# reference and every tensor autograd saved shares the StorageImpl, so all of them lose the memory
# at once (FSDP1 frees parameters the same way). Restoring resizes it back and fills it with
# storage-level copies only (``UntypedStorage.copy_`` / ``_swap_data_ptr_``): a tensor-level write
# (``t.copy_``) would bump the version counter that the tensor shares with autograd's saved copy,
# and backward would then refuse it ("modified by an inplace operation"; prototype rule R0).
# A kernel that reads a 0-byte storage without going through the dispatcher crashes the process
# (segfault in the prototype), so only storages that an op allocated in the current iteration are
# ever evicted, every op restores its inputs first, and every storage is restored when an
# iteration ends.

# Note: [Runtime-internal ops]
# Ops the runtime issues itself (copies, resizes, replays) run with the dispatch modes disabled
# (``_disable_current_modes()``): otherwise the tracker would index them as the script's ops and,
# as in the prototype, could evict its own freshly restored output. Ops on plain storages and
# their byte views (swap copies, resizes) exclude Python dispatch instead
# (``torch._C._DisableTorchDispatch``: no mode runs, 10x cheaper); replays, whose arguments may
# be tensor subclasses, keep ``_disable_current_modes()``.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import _disable_current_modes, is_traceable_wrapper_subclass

from ..planner.plan import Decision


class Residency(enum.Enum):
    RESIDENT = "resident"
    SWAPPING_OUT = "swapping_out"  # device->host copy in flight; memory still held
    OUT = "out"  # on the host (swap) or dropped (recompute): 0 device bytes
    SWAPPING_IN = "swapping_in"  # host->device copy in flight; memory held again


class Reason(enum.Enum):
    """Why a storage was evicted."""

    PLANNED = "planned"
    PASSIVE = "passive"  # on demand, over budget (paper §4.2), least recently used swapped
    DYNAMIC = "dynamic"  # on demand, over budget, DTR's choice, dropped or swapped (guards/dtr.py)


@dataclass(eq=False)
class Entry:
    """One evicted (or being evicted) storage. Runtime-internal and mutable by design."""

    sid: str  # plan storage id, or "passive:<serial>"
    ref: weakref.ref  # the UntypedStorage
    nbytes: int
    swap: bool  # comes back by copy (True) or by replay (False)
    reason: Reason
    decision: Decision | None = None
    state: Residency = Residency.RESIDENT
    buf: torch.Tensor | None = None  # host copy (swap)
    out_copy: object = None  # backend Copy of the swap-out
    in_copy: object = None  # backend Copy of the swap-in
    in_start_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def storage(self) -> torch.UntypedStorage | None:
        return self.ref()


def storage_key(st: torch.UntypedStorage) -> int:
    """Identity of a live storage: its StorageImpl address (stable while it lives; see Note
    [Storage identity] in tracer/hooks.py). Never used across iterations."""
    return st._cdata


def storages(tensors) -> Iterator[tuple[int, torch.UntypedStorage]]:
    """``(storage_key, storage)`` of each distinct storage behind ``tensors``, in order; tensors
    without a storage (some subclasses, sparse tensors) are skipped, and so are wrapper
    subclasses (DTensor, FSDP2's sharded parameters): their own storage holds no data (copying
    from it crashes the process), and their inner tensors reach the runtime's mode as ops'
    arguments, where they are managed."""
    seen = set()
    for t in tensors:
        if is_traceable_wrapper_subclass(t):
            continue
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        k = storage_key(st)
        if k not in seen:
            seen.add(k)
            yield k, st


def resize(st: torch.UntypedStorage, nbytes: int) -> None:
    with torch._C._DisableTorchDispatch():  # a plain storage: no mode, no subclass
        st.resize_(nbytes)


# ``UntypedStorage._swap_data_ptr_`` is missing from older torch releases (2.11 lacks it): there a
# refill copies (``fill_from``).
SWAP_DATA_PTR = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def fill_from(st: torch.UntypedStorage, src: torch.UntypedStorage, nbytes: int) -> None:
    """Give ``st`` (evicted: 0 bytes) the first ``nbytes`` bytes of ``src``. When ``src`` has
    exactly that size and torch can swap storages' data pointers (``SWAP_DATA_PTR``), the
    pointers are swapped instead of copied, so no second buffer is ever alive (``src`` is left
    empty). Otherwise ``st`` is allocated and filled by a copy: ``nbytes`` more are alive until
    the caller drops ``src``."""
    with _disable_current_modes(), torch.no_grad():
        if SWAP_DATA_PTR and st.nbytes() == 0 and src.nbytes() == nbytes:
            st._swap_data_ptr_(src)
            return
        st.resize_(nbytes)
        byte = torch.empty(0, dtype=torch.uint8, device=st.device)
        byte.set_(st, 0, (nbytes,), (1,)).copy_(
            torch.empty(0, dtype=torch.uint8, device=src.device).set_(src, 0, (nbytes,), (1,))
        )


# Own write counters (rule R2): bumped by the tracker for storages it watches, when an op writes
# them per its schema (``(a!)``) or the unannotated-writes table. Autograd's ``_version`` is not
# used: it is per tensor family and misses writes through ``.data``.
_WRITES_ATTR = "_capuchin_writes"


def writes(st: torch.UntypedStorage) -> int:
    return getattr(st, _WRITES_ATTR, 0)


def bump_writes(st: torch.UntypedStorage) -> None:
    setattr(st, _WRITES_ATTR, getattr(st, _WRITES_ATTR, 0) + 1)


# Note [Raw reads] in rawreads.py: a storage whose address the script was given is never evicted.
_EXPOSED_ATTR = "_capuchin_exposed"


def expose(st: torch.UntypedStorage) -> None:
    setattr(st, _EXPOSED_ATTR, True)


def evictable(st: torch.UntypedStorage) -> bool:
    """Whether freeing ``st``'s bytes is safe: resizable (``numpy()`` makes a storage not) and
    not exposed by a raw read (Note [Raw reads] in rawreads.py)."""
    return st.resizable() and not getattr(st, _EXPOSED_ATTR, False)

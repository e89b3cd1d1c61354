"""The plan-less guards: where no plan applies (a run with only a budget, iteration 0, the rest of
a diverged iteration), a guard keeps resident bytes under the budget by evicting on demand.

lru.py  ``BudgetGuard`` (paper §4.2 passive mode): swap the least recently used storage
        synchronously; also the accounting every guard shares (``PassiveTracker``, persistent
        state, ``enforce``).
dtr.py  ``DynamicGuard`` (dynamic mode): DTR's choice of victim (Note [DTR's score] in
        dtr_score.py), dropped storages replayed, the others swapped.

The plan executor (tracker.py) owns the evicted storages and calls a guard through ``Guard``
alone; ``make_guard`` builds the one ``Runtime(eviction=...)`` names.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..state import Entry
from .dtr import REMAT, DynamicGuard
from .lru import BudgetGuard

EVICTIONS = ("dtr", "lru")  # Runtime(eviction=...): the first is the default

__all__ = ["EVICTIONS", "REMAT", "BudgetGuard", "DynamicGuard", "Guard", "make_guard"]


class Guard(Protocol):
    """What the plan executor calls. Lifecycle: ``new_iteration()``; ``start()`` where no plan
    applies (also at a divergence), ``stop()`` when a plan applies again, ``active``. Per op:
    ``before_op`` makes room for what the op allocates and returns a token for ``after_op``
    (count its new storages, evict if over); ``watch`` counts an op's new storages while a plan
    is followed. The rest are named by what happened."""

    memory: object  # the device's accounting (runtime/memory.py): ``predict`` for on_oom

    @property
    def active(self) -> bool: ...

    def new_iteration(self) -> None: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def before_op(self, func, args, kwargs, name: str, flat: list, keys: list): ...

    def after_op(self, outs: list, in_keys: set, token) -> None: ...

    def watch(self, outs: list, in_keys: set, token) -> None: ...

    def evicted(self, key: int) -> None:
        """A storage left (the plan's eviction of a tracked storage)."""

    def restored(self, key: int, nbytes: int) -> None:
        """A storage came back."""

    def on_oom(self, keys: set, need: int = 1) -> bool:
        """A real out-of-memory error (CUDA): free ``need`` bytes outside ``keys``; True if
        anything was freed."""

    def check_all_resident(self) -> None:
        """Everything was restored at once (iteration or step end)."""

    def discover(self, flat: list) -> None:
        """Count what an unwatched iteration left resident before a divergence."""

    def adopt_persistent(self) -> None:
        """Track the optimizers' storages (Note [Persistent state under the guard] in lru.py)."""

    def swap_out_persistent(self) -> None:
        """Swap out the optimizers' resident storages (end of iteration 0 under wrap-around)."""

    def keeps_out(self, e: Entry) -> bool:
        """Whether the step and iteration ends leave evicted ``e`` out (persistent state)."""

    def stays_out(self, e: Entry) -> bool:
        """Whether evicted ``e`` may stay out at the step end (a dropped storage only replays
        read)."""

    def replay(self, e: Entry) -> None:
        """Regenerate a storage this guard dropped (only guards that drop make such entries)."""


def make_guard(
    eviction: str,
    budget_bytes: int | None,
    device: torch.device,
    memory,
    swap,
    executor,
    *,
    bandwidth_bytes_per_s: float,
    remat: str,
) -> Guard:
    """The guard ``eviction`` names (one of ``EVICTIONS``), for ``executor``."""
    if eviction == "lru":
        return BudgetGuard(budget_bytes, device, memory, swap, executor)
    if eviction == "dtr":
        return DynamicGuard(
            budget_bytes, device, memory, swap, executor, bandwidth_bytes_per_s, remat
        )
    raise ValueError(f"eviction must be one of {', '.join(EVICTIONS)}, not {eviction!r}")

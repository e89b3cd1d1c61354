"""The access gap: the one unit every policy decides about (keep the storage, or evict it after
one access and bring it back before the next). No torch.

Capuchin's access pairs (policies/capuchin.py), Algorithm 2's recomputation candidates
(msps.py) and the ILP's candidates (policies/_ilp_model.py) are all access gaps; each adds what
its own method needs (free time, MSPS bookkeeping, copy times and replay chain).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .plan import Decision, Method


@dataclass(frozen=True)
class AccessGap:
    """Storage ``storage_id`` (``size_bytes``) between two consecutive accesses: it may leave
    after op ``evict_op`` (the evicted-access) and must be back before op ``back_op`` (the
    back-access). ``wraps``: the gap runs across the iteration boundary, ``back_op`` being in
    the next iteration (problem.py Note [Wrap-around gaps])."""

    storage_id: str
    size_bytes: int
    evict_op: int
    back_op: int
    wraps: bool = field(default=False, kw_only=True)

    @property
    def key(self) -> tuple[str, int]:
        """(storage_id, evict_op): the gap's identity within one iteration."""
        return (self.storage_id, self.evict_op)

    def decision(self, method: Method, **fields: Any) -> Decision:
        """The decision to evict over this gap by ``method`` (``fields``: the method's own)."""
        return Decision(
            self.storage_id,
            method,
            self.size_bytes,
            self.evict_op,
            self.back_op,
            wraps=self.wraps,
            **fields,
        )

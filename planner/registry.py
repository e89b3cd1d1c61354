"""The policy registry: one table of named policies sharing one signature. No torch.

A policy is a function ``policy(problem, budget_bytes, **params) -> PolicyResult`` registered
with ``@register("name")`` in its own module under ``planner/policies/``. It only *decides*: which
storages to evict after which access, and how each comes back. ``planner.build.build_plan`` turns
its decisions into a complete ``Plan`` (recompute lineage filled in, simulated, action table,
provenance), so no policy builds a plan by hand.

# Note: [Policy contract]
# - Input: a ``Problem`` (read-only) and a budget in bytes (an int > 0). ``params`` are the
#   policy's keyword options (strings from the CLI are not parsed here: give typed values).
# - Output: a ``PolicyResult``: decisions on evictable storages (``StorageInfo.evictable``; persistent ones that
#   are ``swappable`` by swap only, over a gap of ``Problem.swap_gaps``, a wrap-around one with
#   ``wraps``: problem.py Note [Wrap-around gaps]), at most one per evictable storage and,
#   on a persistent one, at most one per gap (their windows are disjoint: plan.py Note
#   [Several windows per storage]), ``evict_op``/``back_op``
#   consecutive accesses of the storage, ``size_bytes`` the storage's size. Swap:
#   ``trigger_op`` in (evict_op, back_op] or None (on demand). Recompute: ``replay_ops``,
#   ``sources`` and ``keep`` may be left empty; the builder fills them
#   (lineage.resolve_recompute).
# - The policy should aim for a simulated peak <= budget; when it cannot, it returns its best
#   effort and the builder marks the plan infeasible. It must not raise for a budget it cannot
#   meet. No decisions is a valid answer (nothing to evict).
# - An exact policy also says what it proved (``status``, ``bound_ns``); any policy may add
#   ``notes`` (they join the plan's) and ``figures`` about its own run (recorded in the plan's
#   ``provenance.parameters``, over the options it was called with).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import CapuchinError
from .plan import Decision
from .problem import Problem


class UnknownPolicyError(CapuchinError):
    """A policy name that no module registered."""


@dataclass(frozen=True)
class PolicyResult:
    """What a policy returns (Note [Policy contract]).

    ``decisions``: the plan's decisions (a tuple: policies cache and share their plans).
    ``status``: an exact policy's verdict, "OPTIMAL" (no plan of its decision space is better),
    "FEASIBLE" (a plan, not proven optimal), "INFEASIBLE" (no plan fits the budget) or "UNKNOWN"
    (none found in time); None for a heuristic. ``bound_ns``: a proven lower bound on the extra
    time of every plan in the policy's decision space (ns); None when none was proven.
    ``notes``: lines for the plan's notes. ``figures``: what the policy reports about its own run
    (JSON values), recorded in the plan's ``provenance.parameters``."""

    decisions: tuple[Decision, ...] = ()
    status: str | None = None
    bound_ns: int | None = None
    notes: tuple[str, ...] = ()
    figures: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "decisions", tuple(self.decisions))
        object.__setattr__(self, "notes", tuple(self.notes))

    @classmethod
    def of(cls, decisions: Iterable[Decision]) -> PolicyResult:
        """Decisions alone (a heuristic's result)."""
        return cls(tuple(decisions))


class Policy(Protocol):
    """See Note [Policy contract]."""

    def __call__(self, problem: Problem, budget_bytes: int, **params: Any) -> PolicyResult: ...


_POLICIES: dict[str, Policy] = {}
_BROKEN: dict[str, str] = {}  # policy module -> why it failed to import
_loaded = False


def register(name: str) -> Callable[[Policy], Policy]:
    """Class/function decorator: ``@register("capuchin")`` adds a policy under ``name``."""

    def deco(fn: Policy) -> Policy:
        if name in _POLICIES and _POLICIES[name] is not fn:
            raise ValueError(f"policy {name!r} registered twice")
        _POLICIES[name] = fn
        return fn

    return deco


def _load_all() -> None:
    """Import every module of planner/policies so that their ``@register`` lines run."""
    global _loaded
    if _loaded:
        return
    from . import policies

    for m in pkgutil.iter_modules(policies.__path__):
        if not m.name.startswith("_"):
            # one broken policy module must not take the others down; its error is reported
            # when its policy is asked for (get_policy)
            try:
                importlib.import_module(f"{policies.__name__}.{m.name}")
            except Exception as exc:  # noqa: BLE001
                _BROKEN[m.name] = f"{type(exc).__name__}: {exc}"
    _loaded = True


def get_policy(name: str) -> Policy:
    """The policy registered as ``name``; ``UnknownPolicyError`` lists the valid names."""
    _load_all()
    try:
        return _POLICIES[name]
    except KeyError:
        broken = "".join(
            f"; module policies/{m}.py failed to import ({e})" for m, e in _BROKEN.items()
        )
        raise UnknownPolicyError(
            f"unknown policy {name!r}; valid policies: {', '.join(available())}{broken}"
        ) from None


def checked(name: str, result: Any) -> PolicyResult:
    """``result``, the return value of policy ``name``; a ``TypeError`` naming the policy when it
    is not a ``PolicyResult`` (Note [Policy contract])."""
    if not isinstance(result, PolicyResult):
        raise TypeError(
            f"policy {name!r} returned a {type(result).__name__}, not a PolicyResult "
            f"(planner/registry.py Note [Policy contract])"
        )
    return result


def available() -> list[str]:
    """Names of all registered policies, sorted."""
    _load_all()
    return sorted(_POLICIES)

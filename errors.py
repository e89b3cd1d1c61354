"""The one exception hierarchy of capuchin. Only cli.py turns these into exit codes."""

from __future__ import annotations


class CapuchinError(Exception):
    """Base class. ``str(err)`` is a complete one-line message for the user; name the file."""

    exit_code = 1


class TraceFormatError(CapuchinError):
    """A file is not a readable capuchin trace (corrupt, foreign, wrong schema version)."""


class PlanFormatError(CapuchinError):
    """A file is not a readable capuchin plan, or it was made for another trace/script."""


class ScriptError(CapuchinError):
    """The user's training script could not be run or raised."""


class InfeasibleBudgetError(CapuchinError):
    """No plan reaches the budget. ``smallest_feasible_bytes`` says what can be reached."""

    exit_code = 2

    def __init__(self, message: str, smallest_feasible_bytes: int | None = None):
        super().__init__(message)
        self.smallest_feasible_bytes = smallest_feasible_bytes


class PlanError(CapuchinError):
    """A plan breaks an invariant the simulator or the runtime checks."""


class RecomputeError(CapuchinError):
    """A recomputation cannot be done correctly (e.g. a source was mutated since it was read)."""

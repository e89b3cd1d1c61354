"""The one exception hierarchy of capuchin and the exit codes of the command. Only cli.py turns
these into exit codes."""

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


class RegionTagsRefused(CapuchinError):
    """Recompute tags inside compiled regions that capuchin cannot apply exactly (Note [Region
    tags] in tracer/region_tags.py)."""


class OutputExistsError(CapuchinError):
    """An output file exists and ``--force`` (``force=True``) was not given."""


class Terminated(BaseException):
    """SIGTERM, raised in the main thread by ``outputs.raise_on_sigterm`` so that cleanup runs.
    A BaseException, like KeyboardInterrupt, so that a script's ``except Exception`` lets it by."""


# Exit codes of the `capuchin` command (docs/errors.md)
EXIT_OK = 0
EXIT_ERROR = 1  # CapuchinError: bad input, a failing script, an unwritable output ...
EXIT_INFEASIBLE = 2  # InfeasibleBudgetError: the budget cannot be met
EXIT_USAGE = 64  # bad command line (unknown option, missing argument): sysexits.h EX_USAGE
EXIT_INTERRUPTED = 130  # SIGINT (Ctrl-C): 128 + 2, as shells report it
EXIT_TERMINATED = 143  # SIGTERM: 128 + 15

"""Sizes, budgets and rates as text, shared by the tracer, the planner and the runtime (no torch):
``8G``/``8GiB`` (2^30), ``8GB`` (10^9), ``512M``, ``1e9``, ``60%``.

# Note: [Size units]
# A bare letter or ``iB`` means a power of two (``8G`` = ``8GiB`` = 8 * 2**30 bytes), as memory
# sizes are usually read; ``B`` after the letter means a power of ten (``8GB`` = 8 * 10**9), as
# disk and bandwidth figures are written. Plain numbers are bytes. Case-insensitive.
"""

from __future__ import annotations

import math
import re

from .errors import CapuchinError


class BudgetError(CapuchinError):
    """A budget or rate string that cannot be read."""


_LETTERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgtp]?)(ib|b)?\s*$", re.I)


def parse_size(text: str | int | float, *, what: str = "size", percent: bool = False) -> int:
    """Bytes from ``text`` (see Note [Size units]); numbers are bytes. The one reader of sizes:
    finite, not negative, rounded to whole bytes. Raises ``BudgetError`` naming ``what``;
    ``percent``: the caller also takes a percentage, which the message then offers."""
    if isinstance(text, bool):
        raise BudgetError(f"{what} {text!r}: not a size")
    if isinstance(text, int):
        num = float(text) if abs(text) < 2**63 else math.inf
        base = 1
    elif isinstance(text, float):
        num, base = text, 1
    else:
        m = _SIZE.match(str(text))
        if not m and _SIZE.match(str(text).strip().removeprefix("-")):
            raise BudgetError(f"{what} {text!r}: must not be negative")
        if not m:
            raise BudgetError(
                f"{what} {text!r}: expected bytes or a size like 8G, 8GiB, 8GB, "
                f"512M, 1e9" + (" (or a percentage like 60%)" if percent else "")
            )
        letter, suffix = m.group(2).lower(), (m.group(3) or "").lower()
        num = float(m.group(1))
        base = (1000 if suffix == "b" else 1024) ** _LETTERS[letter]
    value = num * base
    if math.isnan(value):
        raise BudgetError(f"{what} {text!r}: not a number of bytes")
    if not math.isfinite(value) or value >= 2**63:
        raise BudgetError(f"{what} {text!r}: too large (not a finite number of bytes)")
    if value < 0:
        raise BudgetError(f"{what} {text!r}: must not be negative")
    return int(text) if isinstance(text, int) else int(round(value))


def _at_least_one_byte(value: int, text, what: str) -> int:
    if value < 1:
        raise BudgetError(f"{what} {text!r}: must be at least 1 byte")
    return value


def parse_budget(text: str | int | float, peak_bytes: int | None = None) -> int:
    """A budget in bytes, at least 1. ``"60%"`` is a share of ``peak_bytes`` (the trace's
    baseline peak); other forms as ``parse_size``. Raises ``BudgetError`` for unreadable,
    infinite or sub-byte budgets.
    """
    s = str(text).strip()
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise BudgetError(f"budget {text!r}: not a percentage") from None
        if not math.isfinite(pct) or pct <= 0:
            raise BudgetError(f"budget {text!r}: must be a positive, finite percentage")
        if peak_bytes is None:
            raise BudgetError(f"budget {text!r}: a percentage needs the trace's peak")
        if pct > 1e6:
            raise BudgetError(f"budget {text!r}: too large")
        return _at_least_one_byte(int(peak_bytes * pct / 100), text, "budget")
    return _at_least_one_byte(
        parse_size(text, what="budget", percent=peak_bytes is not None), text, "budget"
    )


def parse_rate(text: str | int | float) -> float:
    """Bytes per second (at least 1) from ``12GB/s``, ``12e9``, ``8GiB/s`` (a trailing ``/s`` is
    optional)."""
    s = str(text).strip() if not isinstance(text, int | float) else text
    if isinstance(s, str) and s.lower().endswith("/s"):
        s = s[:-2]
    r = _at_least_one_byte(parse_size(s, what="bandwidth"), text, "bandwidth")
    return float(r) if not isinstance(text, float) else float(text)


def format_bytes(n: int | float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (powers of two, as budgets are read)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"

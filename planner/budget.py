"""Budgets and rates as text: ``8G``/``8GiB`` (2^30), ``8GB`` (10^9), ``512M``, ``1e9``, ``60%``.

# Note: [Size units]
# A bare letter or ``iB`` means a power of two (``8G`` = ``8GiB`` = 8 * 2**30 bytes), as memory
# sizes are usually read; ``B`` after the letter means a power of ten (``8GB`` = 8 * 10**9), as
# disk and bandwidth figures are written. Plain numbers are bytes. Case-insensitive.
"""

from __future__ import annotations

import re

from ..errors import CapuchinError


class BudgetError(CapuchinError):
    """A budget or rate string that cannot be read."""


_LETTERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgtp]?)(ib|b)?\s*$", re.I)


def parse_size(text: str | int | float, *, what: str = "size") -> int:
    """Bytes from ``text`` (see Note [Size units]); ints pass through. Raises ``BudgetError``."""
    if isinstance(text, bool):
        raise BudgetError(f"{what} {text!r}: not a size")
    if isinstance(text, int | float):
        if text < 0:
            raise BudgetError(f"{what} {text!r}: must not be negative")
        return int(text)
    m = _SIZE.match(str(text))
    if not m:
        raise BudgetError(f"{what} {text!r}: expected bytes or a size like 8G, 8GiB, 8GB, 512M, "
                          f"1e9 (or a percentage like 60%)")
    num, letter, suffix = float(m.group(1)), m.group(2).lower(), (m.group(3) or "").lower()
    base = 1000 if suffix == "b" else 1024
    return int(round(num * base ** _LETTERS[letter]))


def parse_budget(text: str | int | float, peak_bytes: int | None = None) -> int:
    """A budget in bytes. ``"60%"`` is a share of ``peak_bytes`` (the trace's baseline peak);
    other forms as ``parse_size``. Raises ``BudgetError`` for unreadable or non-positive budgets.
    """
    s = str(text).strip()
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise BudgetError(f"budget {text!r}: not a percentage") from None
        if peak_bytes is None:
            raise BudgetError(f"budget {text!r}: a percentage needs the trace's peak")
        if pct <= 0:
            raise BudgetError(f"budget {text!r}: must be positive")
        return int(peak_bytes * pct / 100)
    b = parse_size(text, what="budget")
    if b <= 0:
        raise BudgetError(f"budget {text!r}: must be positive")
    return b


def parse_rate(text: str | int | float) -> float:
    """Bytes per second from ``12GB/s``, ``12e9``, ``8GiB/s`` (a trailing ``/s`` is optional)."""
    s = str(text).strip()
    if s.lower().endswith("/s"):
        s = s[:-2]
    r = parse_size(s, what="bandwidth")
    if r <= 0:
        raise BudgetError(f"bandwidth {text!r}: must be positive")
    return float(r)


def format_bytes(n: int | float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (powers of two, as budgets are read)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"

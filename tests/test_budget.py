"""Budget and rate parsing (planner/budget.py Note [Size units])."""

from __future__ import annotations

import pytest
from capuchin.planner.budget import BudgetError, format_bytes, parse_budget, parse_rate


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8G", 8 * 2**30),
        ("8GiB", 8 * 2**30),
        ("8g", 8 * 2**30),
        ("8GB", 8 * 10**9),
        ("512M", 512 * 2**20),
        ("512MiB", 512 * 2**20),
        ("1.5K", 1536),
        ("100", 100),
        ("1e9", 10**9),
        (" 2 G ", 2 * 2**30),
        ("100B", 100),
        (4096, 4096),
    ],
)
def test_sizes(text, expected):
    assert parse_budget(text) == expected


def test_percent_of_peak():
    assert parse_budget("60%", peak_bytes=1000) == 600
    assert parse_budget("50%", peak_bytes=1001) == 500
    with pytest.raises(BudgetError, match="peak"):
        parse_budget("60%")


@pytest.mark.parametrize("bad", ["", "G", "8X", "-1", "0", "abc%", "0%", "8 GiBs", True])
def test_bad_budgets(bad):
    with pytest.raises(BudgetError):
        parse_budget(bad, peak_bytes=100)


def test_rates():
    assert parse_rate("12GB/s") == 12e9
    assert parse_rate("1GiB/s") == 2**30
    assert parse_rate("5e8") == 5e8
    with pytest.raises(BudgetError):
        parse_rate("0")


def test_format():
    assert format_bytes(1536) == "1.50 KiB" and format_bytes(10) == "10 B"

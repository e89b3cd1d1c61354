"""The planner's names for the shared units module (``capuchin.units``): budgets and sizes."""

from ..units import BudgetError, format_bytes, parse_budget, parse_rate, parse_size

__all__ = ["BudgetError", "format_bytes", "parse_budget", "parse_rate", "parse_size"]

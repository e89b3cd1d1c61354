"""The plan-less guards (runtime/guards/) and the protocol the plan executor calls them through."""

import ast
from pathlib import Path

import pytest
import torch
from capuchin.runtime.guards import EVICTIONS, BudgetGuard, DynamicGuard, Guard, make_guard

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"


def _members(cls) -> set[str]:
    return {n for n in vars(cls) if not n.startswith("_")} | set(cls.__annotations__)


def test_the_executor_calls_a_guard_through_the_protocol_alone():
    """Every ``guard.X`` / ``self.guard.X`` the runtime's plan path uses is a member of
    ``Guard``: a hook added to one guard only would fail here."""
    used = set()
    for path in RUNTIME.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                owner = node.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if name == "guard":
                    used.add(node.attr)
    assert used, "the executor names no guard hook: the walk found nothing"
    assert used <= _members(Guard), used - _members(Guard)


@pytest.mark.parametrize("cls", [BudgetGuard, DynamicGuard])
def test_each_guard_implements_the_whole_protocol(cls):
    methods = _members(Guard) - set(Guard.__annotations__)
    missing = {n for n in methods if not hasattr(cls, n)}
    guard = cls(None, torch.device("cpu"), None, None, None)  # attributes: set by __init__
    missing |= {n for n in Guard.__annotations__ if not hasattr(guard, n)}
    assert not missing


def test_make_guard_builds_the_named_guard_and_refuses_others():
    kw = dict(bandwidth_bytes_per_s=1e9, remat="auto")
    dev = torch.device("cpu")
    assert type(make_guard("lru", None, dev, None, None, None, **kw)) is BudgetGuard
    assert type(make_guard("dtr", None, dev, None, None, None, **kw)) is DynamicGuard
    assert EVICTIONS[0] == "dtr"
    with pytest.raises(ValueError, match="eviction must be one of"):
        make_guard("fifo", None, dev, None, None, None, **kw)

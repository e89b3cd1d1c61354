"""Packaging: the import name, the console script, and the planner's torch-freedom."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import capuchin
from capuchin.cli import main
from click.testing import CliRunner


def fresh_python(code: str) -> str:
    """What ``code`` prints in a new interpreter (nothing imported yet), outside the repository."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True
    ).stdout.strip()


def test_version_and_help_list_commands():
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and capuchin.__version__ in r.output
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0
    for cmd in ("trace", "show", "plan", "run"):
        assert f"  {cmd} " in r.output, cmd


def test_no_generic_top_level_modules_installed():
    # Note: [Layout] in pyproject.toml: only `capuchin` is a top-level name.
    code = "import importlib.util as u; print([n for n in ('planner','runtime','tracer','cli') if u.find_spec(n)])"
    out = fresh_python(code)
    assert out == "[]"


def test_planner_imports_no_torch():
    code = (
        "import sys, capuchin.planner, capuchin.planner.plan, capuchin.tracer.reader; "
        "import pkgutil, importlib, capuchin.planner as p\n"
        "for m in pkgutil.walk_packages(p.__path__, 'capuchin.planner.'):\n"
        "    importlib.import_module(m.name)\n"
        "print('torch' in sys.modules)"
    )
    out = fresh_python(code)
    assert out == "False"


def test_the_runtime_loads_neither_pandas_nor_the_planners_problem():
    """The runtime reads the plan format alone (STYLE D.30): importing it loads no pandas, no
    trace reader and no planning problem."""
    code = (
        "import sys, capuchin.runtime.engine, capuchin.runtime.guards.dtr\n"
        "print(sorted(m for m in ('pandas', 'capuchin.planner.problem', 'capuchin.tracer.reader')"
        " if m in sys.modules))"
    )
    out = fresh_python(code)
    assert out == "[]"


def _imports(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (lazy imports in functions too),
    relative imports resolved against ``package``."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def _product_modules():
    root = Path(capuchin.__file__).parent
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("tests", "benchmarks", "testing", "scripts", "notebooks", "out"):
            continue
        package = ".".join(["capuchin", *rel.parts[:-1]])
        yield rel, package, _imports(path, package)


def test_layers_do_not_leak():
    """The tracer never imports the runtime (tracing under a budget is composed one level up, in
    capuchin/tracing.py), and product code never imports the test helpers (lazy imports count)."""
    leaks = []
    for rel, _, mods in _product_modules():
        if rel.parts[0] == "tracer":
            leaks += [f"{rel}: {m}" for m in mods if m.startswith("capuchin.runtime")]
        leaks += [f"{rel}: {m}" for m in mods if m.startswith("capuchin.testing")]
    assert leaks == []

"""The import direction is a checked contract: import-linter's contracts in pyproject.toml, and what they cannot see.

import-linter follows every import statement, including those inside functions, and its layers contract
(worker -> service -> client, migrations beside the worker) has no ignore lines. The AST check below says the
same of the client without import-linter's help, and that no module imports another module's private name;
the entry-point check holds the one door (remat.client.local_planner) to its implementation; a fresh
interpreter then shows what each side really loads.
"""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

from remat.client.local_planner import ENTRY_POINT_GROUP, LocalPlanner, local_planner

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"remat.client": "client", "remat.worker": "worker", "remat.service": "service",
                "remat.migrations": "migrations"}


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """Every import statement of a file, module level or not: (line, module, imported names)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
    return out


def test_import_linter_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_the_contracts_have_no_ignore_lines() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert all("ignore_imports" not in contract for contract in config["contracts"])


def test_client_never_imports_worker_or_service_anywhere() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{line} {module}"
                 for path in sorted((ROOT / "client").rglob("*.py"))
                 for line, module, _ in _imports(path) if module.startswith(("remat.worker", "remat.service"))]
    assert offenders == []


def test_no_module_imports_a_private_name_of_another() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{line} {module}.{name}"
                 for folder in PACKAGE_DIRS.values() for path in sorted((ROOT / folder).rglob("*.py"))
                 for line, module, names in _imports(path) if module.startswith("remat")
                 for name in names if name.startswith("_")]
    assert offenders == []


def test_the_local_planner_entry_point_implements_the_port() -> None:
    (entry,) = entry_points(group=ENTRY_POINT_GROUP)
    assert entry.value == "remat.worker.local"
    planner = local_planner()
    port = {name for name, member in inspect.getmembers(LocalPlanner, inspect.isfunction) if not name.startswith("_")}
    assert port, "the port declares no methods"
    for name in sorted(port):
        implementation = getattr(planner, name, None)
        assert callable(implementation), f"remat.worker.local has no {name}"
        declared = list(inspect.signature(getattr(LocalPlanner, name)).parameters)[1:]  # less self
        assert list(inspect.signature(implementation).parameters) == declared, name


def test_pyproject_lists_every_package_folder() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {package + "." + ".".join(init.parent.relative_to(ROOT / folder).parts) if init.parent != ROOT / folder
             else package
             for package, folder in PACKAGE_DIRS.items() for init in (ROOT / folder).rglob("__init__.py")}
    assert listed == found


def _loaded_after(statement: str) -> dict[str, bool]:
    code = (f"import sys, json\n{statement}\n"
            "print(json.dumps({m: m in sys.modules for m in "
            "('torch', 'sqlalchemy', 'celery', 'fastapi', 'remat.worker.pipeline', 'remat.service.db')}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_what_each_side_loads_in_a_fresh_interpreter() -> None:
    client = _loaded_after("import remat.client, remat.client.plan_key, remat.client.request, "
                           "remat.client.measurement, remat.client.service_client, remat.client.cli, "
                           "remat.client.local_planner, remat.client.planning.plans")
    assert not any(client.values()), client
    service = _loaded_after("import remat.service.api.app")
    assert service["fastapi"] and service["sqlalchemy"]
    assert not service["torch"] and not service["remat.worker.pipeline"], service
    local = _loaded_after("import remat.worker.local")  # the store answers a repeated plan without torch
    assert not local["torch"] and not local["sqlalchemy"], local

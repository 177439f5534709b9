"""The import direction is a checked contract: import-linter's contracts in pyproject.toml, and what they cannot see.

import-linter follows every import statement, including those inside functions, so the CLI's composition
points (cli, embedded, fetch) are listed as ignored there; what makes them acceptable is that they import the
worker and service inside functions only, which the AST check below holds. A fresh interpreter then shows
what each side really loads.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_client_never_imports_worker_or_service_at_module_level() -> None:
    offenders = []
    for path in sorted((ROOT / "client").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:  # module level only: statements inside functions are not in tree.body
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            offenders += [f"{path.name}:{node.lineno} {name}" for name in names
                          if name.startswith(("remat.worker", "remat.service"))]
    assert offenders == []


def _loaded_after(statement: str) -> dict[str, bool]:
    code = (f"import sys, json\n{statement}\n"
            "print(json.dumps({m: m in sys.modules for m in "
            "('torch', 'sqlalchemy', 'celery', 'fastapi', 'remat.worker.pipeline', 'remat.service.db')}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_what_each_side_loads_in_a_fresh_interpreter() -> None:
    client = _loaded_after("import remat.client, remat.client.plan_key, remat.client.request, "
                           "remat.client.measurement, remat.client.service_client, remat.client.cli")
    assert not any(client.values()), client
    service = _loaded_after("import remat.service.api.app")
    assert service["fastapi"] and service["sqlalchemy"]
    assert not service["torch"] and not service["remat.worker.pipeline"], service

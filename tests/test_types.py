"""The typed boundary: engine/ and server/ pass `mypy --strict` (settings in pyproject.toml), so the
contract between the server and the engines (`engine/interface.py`) is checked, not only
written; and the server does not probe engines, requests or models with `getattr`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# getattr calls the server may make, none on an engine, a request or a model: an exception's
# optional headers, a logging level by name, a route's path where it has one.
ALLOWED_GETATTR = {
    ("server/errors.py", "exc"),
    ("server/cli.py", "logging"),
    ("server/cli.py", "args"),
    ("server/request_context.py", "route"),
}


def test_engine_and_server_pass_mypy_strict():
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "Success" in run.stdout


def test_the_server_probes_nothing_with_getattr():
    found = set()
    for path in sorted((REPO / "server").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr":
                target = ast.unparse(node.args[0])
                found.add((str(path.relative_to(REPO)), target))
    assert found <= ALLOWED_GETATTR, found - ALLOWED_GETATTR

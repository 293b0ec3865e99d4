"""The typed boundary: engine/, server/ and models/ pass `mypy --strict` (settings in
pyproject.toml), so the contract between the server and the engines
(`engine/decoding/interface.py`) is checked, not only written; and the server does not probe
engines, requests or models with `getattr` (or `hasattr`, or `operator.attrgetter`)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# getattr calls the server may make, none on an engine, a request or a model: an exception's
# optional headers, a logging level by name, a route's path where it has one.
ALLOWED_GETATTR = {
    ("cdlm_serve/server/errors.py", "exc"),
    ("cdlm_serve/server/cli.py", "logging"),
    ("cdlm_serve/server/cli.py", "args"),
    ("cdlm_serve/server/request_context.py", "route"),
}


def test_engine_server_and_models_pass_mypy_strict():
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "Success" in run.stdout


# What probes an object for an attribute by name: the builtins, and operator's getter (which
# `getattr` does under another name).
PROBES = {"getattr", "hasattr", "attrgetter"}


def _probes(source: str) -> list[tuple[str, str]]:
    """(probe, what it probes) for each attribute probe in `source`: every call of getattr,
    hasattr or attrgetter, bare or as a module's (builtins.hasattr, operator.attrgetter), with
    its first argument (attrgetter's is the attribute's name: it takes no object); and every
    import of one (`from operator import attrgetter as pick`: its calls are then `pick(...)`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module in ("builtins", "operator"):
            found += [
                (a.name, f"import as {a.asname or a.name}") for a in node.names if a.name in PROBES
            ]
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name in PROBES:
            target = node.args[0] if node.args else node
            found.append((name, ast.unparse(target)))
    return found


def test_the_server_probes_nothing_by_attribute_name():
    """No getattr in server/ on an engine, a request or a model, nor hasattr or
    operator.attrgetter (the same probe under other names): what it reads of them is typed."""
    found = set()
    for path in sorted((REPO / "cdlm_serve" / "server").glob("*.py")):
        for probe, target in _probes(path.read_text()):
            found.add((str(path.relative_to(REPO)), f"{probe}({target})"))
    allowed = {(path, f"getattr({target})") for path, target in ALLOWED_GETATTR}
    assert found <= allowed, found - allowed


def test_every_way_of_probing_an_attribute_is_found():
    source = """
import builtins
import operator
from operator import attrgetter as pick
getattr(engine, "x")
hasattr(request, "y")
builtins.hasattr(model, "z")
operator.attrgetter("w")(engine)
pick("v")(engine)
engine.config.layers
"""
    assert sorted(_probes(source)) == [
        ("attrgetter", "'w'"),
        ("attrgetter", "import as pick"),
        ("getattr", "engine"),
        ("hasattr", "model"),
        ("hasattr", "request"),
    ]

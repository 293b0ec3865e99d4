"""The house's layers, read from the source with `ast`: which of our modules import which,
counting imports made only for type checking (`if TYPE_CHECKING:`) and inside functions, since
each is a dependency a reader must follow and a refactor must keep in mind.

Two rules: no import circle outside KNOWN_CIRCLES, and nothing under `engine/` or `models/`
imports `server/` outside KNOWN_UPWARD (`models/` imports none of our other packages at all).
Both lists are empty since issue 37 (a `DecodeContext` for the decoding modes, `server/state.py`
and `server/compaction_thread.py`, a `Telemetry` protocol the engine defines); an entry may only
come back with a reason, and the test fails when a listed one is gone, so the lists never hide
a new circle behind an old name.

A third: the subsystems (engine/decoding, engine/compaction, engine/sessions, server/routes)
are used through their packages only, outside the benches (`SUBSYSTEMS`).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("server", "engine", "models", "train", "bench")

# Each circle as the sorted modules of one strongly connected component of the import graph.
KNOWN_CIRCLES: set[tuple[str, ...]] = set()  # issue 37 removed the last two
KNOWN_UPWARD: set[tuple[str, str]] = set()


ROOT = REPO / "cdlm_serve"  # the one package; modules are named below it (engine.x, server.y)


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Our modules that `name` imports anywhere in its file (the longest known prefix of each
    imported name: `from engine.x import y` is engine.x, or engine.x.y if that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        target = target.removeprefix("cdlm_serve.")
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                add(f"{base}.{alias.name}")
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: set[tuple[str, ...]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.add(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_is_read_whole():
    """The walk sees the imports it must: a module-level one, a type-only one, a relative one."""
    graph = _graph()
    assert "models.transformer" in graph["engine.decoding.ar_engine"]
    assert "engine.sessions" in graph["engine.decoding.ar_engine"]  # under TYPE_CHECKING
    assert len(graph) > 60


def test_no_import_circles_but_the_known_ones():
    assert _circles(_graph()) == KNOWN_CIRCLES


def test_lower_layers_do_not_import_the_server():
    graph = _graph()
    upward = {
        (module, target)
        for module, targets in graph.items()
        if module.startswith(("engine", "models"))
        for target in targets
        if target.startswith("server")
    }
    assert upward == KNOWN_UPWARD
    models_out = {
        (module, target)
        for module, targets in graph.items()
        if module.startswith("models")
        for target in targets
        if not target.startswith("models")
    }
    assert not models_out, models_out


# The subsystems: what each offers the others is what its package (`__init__`) exports.
SUBSYSTEMS = ("engine.decoding", "engine.compaction", "engine.sessions", "server.routes")
# The benches measure the parts themselves (a fit, a query source): they may reach inside.
HARNESSES = ("bench",)


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _reaching_inside(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {
        (module, target)
        for module, targets in graph.items()
        if not module.startswith(HARNESSES)
        for target in targets
        for package in SUBSYSTEMS
        if _inside(target, package) and target != package and not _inside(module, package)
    }


def test_each_subsystem_is_used_through_its_package_only():
    """Outside engine/decoding, engine/compaction, engine/sessions and server/routes, our modules
    import the package (`from cdlm_serve.engine.compaction import compact_row`), never one of
    its modules: a module inside may move or split without its users knowing."""
    assert _reaching_inside(_graph()) == set()


def test_the_subsystem_rule_sees_a_module_reached_inside():
    graph = _graph()
    graph["server.chat"] = graph["server.chat"] | {"engine.compaction.row"}
    graph["bench.compaction"] = graph["bench.compaction"] | {"engine.compaction.row"}
    assert _reaching_inside(graph) == {("server.chat", "engine.compaction.row")}


def test_a_server_start_imports_no_compiler_and_no_solver(smollm2_dir):
    """Every server start (and every test that starts one) pays for what the server imports.
    Loading the default model, as a start does, imports neither torch's compiler (dynamo,
    inductor: ~4 s, for nothing the server calls) nor SciPy's solvers (~1.5 s, for a
    compaction's rare fallback). They came in through llguidance's torch helpers (which compile
    a kernel when imported), through drawing random initial weights on the meta device (its
    fills run through torch._refs, which load dynamo), through AutoTokenizer reading the
    model's config (its configuration module imports torch.distributed and dynamo), and
    through the NNLS module's import of SciPy."""
    import subprocess
    import sys

    code = (
        "import sys, torch, cdlm_serve.server.app, cdlm_serve.engine.decoding.grammar\n"
        "from cdlm_serve.engine.served_model import load_served_model\n"
        f"load_served_model('m', {str(smollm2_dir)!r}, torch.device('cpu'), torch.bfloat16)\n"
        "heavy = ('torch._dynamo', 'torch._inductor', 'scipy.optimize')\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-500:]

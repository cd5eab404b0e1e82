"""The package's layers point one way (data -> models -> client side -> methods -> engine and stages -> CLI) and no
module imports itself back through others. Every import counts, also one inside a function: a deferred import hides
a cycle from Python, not from the design."""

import ast
import shutil
from pathlib import Path

from tests.conftest import REPO

SRC = REPO / "src"

# lower number = lower layer; a module may import its own layer or lower ones
LAYERS = {
    "fedsilo.utils": 0,
    "fedsilo.config": 0,
    "fedsilo.layout": 0,
    "fedsilo.codehash": 0,
    "fedsilo.data": 1,
    "fedsilo.models": 1,
    "fedsilo.client": 2,
    "fedsilo.methods": 3,
    "fedsilo.tracking": 4,
    "fedsilo.report": 4,
    "fedsilo.fl": 4,
    "fedsilo.bench": 4,
    "fedsilo.grid": 4,
    "fedsilo.grid_ray": 4,
    "fedsilo.grid_bench": 4,
    "fedsilo.scaffold": 4,
    "fedsilo.cli": 5,
}


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(src: Path) -> dict[str, set[str]]:
    """module -> the fedsilo modules it imports (anywhere in its body)."""
    files = {module_name(p, src): p for p in (src / "fedsilo").rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t.startswith("fedsilo") and t != mod and t != "fedsilo":
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a list of modules (first == last), or [] when there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def layer(mod: str) -> int:
    for prefix, rank in sorted(LAYERS.items(), key=lambda kv: -len(kv[0])):
        if mod == prefix or mod.startswith(prefix + "."):
            return rank
    raise AssertionError(f"{mod}: not placed in a layer (add it to LAYERS)")


def test_no_import_cycle():
    cycle = find_cycle(import_graph(SRC))
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_imports_point_down_the_layers():
    graph = import_graph(SRC)
    upward = [(m, t) for m, ts in graph.items() for t in ts if layer(t) > layer(m)]
    assert not upward, "imports that point up a layer: " + ", ".join(f"{m} -> {t}" for m, t in upward)


def test_client_side_imports_neither_methods_nor_engine():
    graph = import_graph(SRC)
    client = {m: ts for m, ts in graph.items() if m.startswith("fedsilo.client")}
    assert client, "the client-side package is missing"
    assert not [t for ts in client.values() for t in ts if t.startswith(("fedsilo.methods", "fedsilo.fl"))]


def test_a_deliberately_added_cycle_is_found(tmp_path):
    """The checker is not vacuous: one deferred import from config back to the methods is a cycle it reports."""
    shutil.copytree(SRC / "fedsilo", tmp_path / "fedsilo")
    assert not find_cycle(import_graph(tmp_path))
    cfg = tmp_path / "fedsilo" / "config" / "pipeline.py"
    cfg.write_text(cfg.read_text() + "\n\ndef _late():\n    from fedsilo.methods import method_class  # noqa\n")
    cycle = find_cycle(import_graph(tmp_path))
    assert cycle and any(m.startswith("fedsilo.config") for m in cycle) and any(m.startswith("fedsilo.methods") for m in cycle)


def test_a_sites_credential_checks_and_service_commands_need_no_pytorch():
    """A hospital's IT checks its certificates and writes its units without the training stack's import."""
    import subprocess
    import sys

    code = ("import sys, fedsilo.fl.credentials, fedsilo.fl.services; "
            "print(sorted(m for m in ('torch', 'mlflow', 'flwr') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out


def test_the_data_stages_start_without_pytorch():
    """fetch / harmonize / split run as separate processes once per stage: they must not pay PyTorch's import."""
    import subprocess
    import sys

    code = ("import sys, fedsilo.cli, fedsilo.data.fetch, fedsilo.data.harmonize, fedsilo.data.splits, fedsilo.report; "
            "print(sorted(m for m in ('torch', 'mlflow', 'dvc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out

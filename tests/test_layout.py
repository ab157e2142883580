"""The layout docs/design.md describes, read from the source: the direction of imports, no import
circles (imports inside functions included), the CPU backend behind its one interface, small modules."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specdec_runtime", "train", "recipes")
MAX_LINES = 600
# The runtime's front-ends: they build drafters from their specs, so they import drafters/ freely.
FRONT_ENDS = {"__init__", "cli", "bench", "sweeps", "tune", "report", "measure", "reference", "export_check", "hub"}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules `name` imports, anywhere in the file (functions too): for `from a import
    b`, a.b where that is a module, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_there_is_no_import_circle(graph):
    """Depth-first search for a back edge; the circle it finds is printed whole."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                pytest.fail("import circle: " + " -> ".join(path[path.index(n) :] + [n]))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_imports_go_one_way(graph):
    """recipes -> train -> specdec_runtime; the runtime never imports training, Hydra or accelerate."""
    for m, targets in graph.items():
        for n in targets:
            if m.startswith("specdec_runtime"):
                assert n.startswith("specdec_runtime"), f"{m} imports {n}"
            if m.startswith("train"):
                assert not n.startswith("recipes"), f"{m} imports {n}"
    for path in (ROOT / "specdec_runtime").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for n in names:
                assert n.split(".")[0] not in ("hydra", "omegaconf", "accelerate"), f"{path} imports {n}"


def test_the_core_sees_drafters_through_their_protocol_and_the_cpu_backend_through_its_interface(graph):
    """Inside the runtime: drafters -> core, the core importing only drafters.protocol (the loop's
    contract), except the front-ends that build drafters; only cpu/ imports the kernel's binding
    and build (everything else calls specdec_runtime.cpu and its host_rules)."""
    private = {"specdec_runtime.cpu.kernel", "specdec_runtime.cpu.build"}
    for m, targets in graph.items():
        core = m.startswith("specdec_runtime") and not m.startswith(("specdec_runtime.drafters", "specdec_runtime.cpu"))
        if core and m.removeprefix("specdec_runtime").lstrip(".") not in FRONT_ENDS | {""}:
            wrong = {
                n
                for n in targets
                if n.startswith("specdec_runtime.drafters") and n != "specdec_runtime.drafters.protocol"
            }
            assert not wrong, f"{m} (core) imports {sorted(wrong)}"
        if not m.startswith("specdec_runtime.cpu"):
            assert not targets & private, f"{m} imports {sorted(targets & private)}: use specdec_runtime.cpu"


def test_modules_are_small():
    long = {
        str(p.relative_to(ROOT)): n for p in modules().values() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"

"""The package layout's promises, checked from the source: who may import whom.

The controller runs on the Slurm controller host at every job end and must not pay for (or even
have) torch; the job side must run without the admin side installed in its head. These rules are
what docs/architecture.md draws, so a test holds them, not a reviewer's memory.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "slurm_guard"

# Subpackages that run on the admin side (controller host, an admin's shell) or only drive the job.
ADMIN_SIDE = ("slurm_guard.controller", "slurm_guard.cli")
# Modules that are not the job side: the admin side, the drill (which drives jobs and the
# controller), Slurm launching (job submission) and the diagnose/report tools.
NOT_JOB_SIDE = (*ADMIN_SIDE, "slurm_guard.drill", "slurm_guard.slurm", "slurm_guard.report")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imported_by(node: ast.AST, name: str, is_package: bool) -> Iterator[str]:
    """Modules one import statement of module `name` loads (`from a import b` may load a.b)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        yield module
        for alias in node.names:
            yield f"{module}.{alias.name}"


def _imports(path: Path, name: str) -> set[str]:
    """Every module the file imports, function-local and TYPE_CHECKING-only imports included."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    return {module for node in ast.walk(tree) for module in _imported_by(node, name, is_package)}


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_job_side_never_imports_the_admin_side() -> None:
    offenders = []
    for name, path in _modules().items():
        if _within(name, NOT_JOB_SIDE) or name == "slurm_guard":
            continue
        for imported in sorted(_imports(path, name)):
            if _within(imported, ADMIN_SIDE):
                offenders.append(f"{name} imports {imported}")
    assert offenders == []


def test_the_controller_never_imports_torch_in_its_source() -> None:
    offenders = []
    for name, path in _modules().items():
        if not _within(name, ("slurm_guard.controller",)):
            continue
        for imported in sorted(_imports(path, name)):
            if imported == "torch" or imported.startswith("torch."):
                offenders.append(f"{name} imports {imported}")
    assert offenders == []


def test_importing_the_controller_loads_no_torch() -> None:
    code = (
        "import sys, slurm_guard.controller, slurm_guard.protocol, slurm_guard.slurm.client\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(len(loaded)); print(loaded[:5])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[0] == "0", out.stdout


def test_no_import_circle_between_modules() -> None:
    """No cycle, counting function-local and TYPE_CHECKING imports: both are how a cycle hides
    (a type-only cycle still means neither module can be read or tested without the other)."""
    modules = _modules()
    graph = {
        name: {m for m in _imports(path, name) if m in modules} - {name}
        for name, path in modules.items()
    }
    # A package's __init__ re-exporting its own children is not a cycle worth naming.
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}

    cycles = _find_cycle(graph)
    assert cycles is None, " -> ".join(cycles or [])


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The walk above must be able to fail: a known cycle is reported."""
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("name", ["EXIT_SDC", "COMMENT_KEY", "REASON_PREFIX", "DEFAULT_STATE_DIR"])
def test_shared_constants_are_defined_once(name: str) -> None:
    defining = [
        _module_name(p)
        for p in PACKAGE.rglob("*.py")
        if any(
            isinstance(node, ast.Assign | ast.AnnAssign)
            and any(
                isinstance(t, ast.Name) and t.id == name
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            )
            for node in ast.parse(p.read_text()).body
        )
    ]
    assert defining == ["slurm_guard.protocol"]

"""The package layout's promises, checked from the source: who may import whom.

The controller runs on the Slurm controller host at every job end and must not pay for (or even
have) torch; the job side must run without the admin side installed in its head. These rules are
what docs/architecture.md draws, so a test holds them, not a reviewer's memory.
"""

from __future__ import annotations

import ast
import importlib
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


# What the package root may hold besides subpackages (docs/architecture.md, "Subpackages").
ROOT_MODULES = {"__init__", "guard", "config", "errors", "protocol"}
# The job side's subpackages; each one's __init__ names its public API in __all__.
JOB_SIDE_PACKAGES = (
    "slurm_guard.abft",
    "slurm_guard.checks",
    "slurm_guard.comm",
    "slurm_guard.core",
    "slurm_guard.data",
    "slurm_guard.faults",
    "slurm_guard.fingerprint",
    "slurm_guard.integrations",
    "slurm_guard.kernels",
    "slurm_guard.local",
    "slurm_guard.rundir",
    "slurm_guard.sharded",
)
JOB_SIDE_MAX_LINES = 420  # the "~400": one screen of screens


def test_the_package_root_holds_only_the_entry_modules_and_subpackages() -> None:
    loose = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ROOT_MODULES)
    assert loose == [], "move these into the subpackage of their part (docs/architecture.md)"


def test_no_job_side_module_is_longer_than_a_screenful_of_screens() -> None:
    long = {
        name: n
        for name, path in _modules().items()
        if _within(name, JOB_SIDE_PACKAGES) or name.rsplit(".", 1)[-1] in ROOT_MODULES
        if (n := len(path.read_text().splitlines())) > JOB_SIDE_MAX_LINES
    }
    assert long == {}, "split these along the seam the design has (docs/architecture.md)"


@pytest.mark.parametrize("package", sorted({n for n in _modules() if n.count(".") == 1}))
def test_every_subpackage_names_its_public_api(package: str) -> None:
    init = PACKAGE.parent / package.replace(".", "/") / "__init__.py"
    if not init.exists():
        pytest.skip(f"{package} is a module")
    values = [
        node.value
        for node in ast.parse(init.read_text()).body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    ]
    assert values, f"{package}/__init__.py defines no __all__"
    exported = ast.literal_eval(values[0])
    module = importlib.import_module(package)
    # a name is an attribute, or a submodule (packages whose API is their modules)
    missing = [
        name
        for name in exported
        if not hasattr(module, name)
        and not (PACKAGE.parent / package.replace(".", "/") / f"{name}.py").exists()
    ]
    assert missing == [], f"{package}.__all__ names what it does not export"


def test_the_admin_side_never_imports_the_job_side_s_torch_modules() -> None:
    """The controller and the CLI reach the job side only through torch-free modules."""
    torch_free = (
        "slurm_guard.protocol",
        "slurm_guard.errors",
        "slurm_guard.config",
        "slurm_guard.rundir",
        "slurm_guard.rundir.layout",
        "slurm_guard.rundir.records",
        "slurm_guard.rundir.trust",
        "slurm_guard.rundir.fault_effects",
        "slurm_guard.diagnose",
        "slurm_guard.diagnose.evidence",
        "slurm_guard.diagnose.history",
    )
    offenders = []
    for name, path in _modules().items():
        if not _within(name, ("slurm_guard.controller",)):
            continue
        for imported in sorted(_imports(path, name)):
            job_side = _within(imported, JOB_SIDE_PACKAGES) or imported == "slurm_guard.guard"
            if job_side and not any(
                imported == m or imported.startswith(m + ".") for m in torch_free
            ):
                offenders.append(f"{name} imports {imported}")
    assert offenders == []


@pytest.mark.parametrize("old", sorted(__import__("slurm_guard").MOVED_MODULES))
def test_a_moved_module_still_imports_under_its_old_path_and_warns(old: str) -> None:
    code = (
        "import importlib, warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        f"try:\n    importlib.import_module({old!r})\n"
        "except DeprecationWarning as w:\n    print('warned:', w)\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        f"old = importlib.import_module({old!r})\n"
        "import slurm_guard\n"
        f"new = importlib.import_module(slurm_guard.MOVED_MODULES[{old!r}])\n"
        "print('same:', old is new)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    new = __import__("slurm_guard").MOVED_MODULES[old]
    assert f"warned: {old} moved to {new}" in out.stdout, out.stdout + out.stderr
    assert "same: True" in out.stdout


def test_an_old_path_keeps_its_names() -> None:
    """What user scripts imported before the re-layout still resolves to the same objects."""
    code = (
        "import warnings; warnings.simplefilter('ignore', DeprecationWarning)\n"
        "from slurm_guard.launch import init_distributed_from_slurm as a\n"
        "from slurm_guard.records import Alarm as b\n"
        "from slurm_guard.local_launch import run_local as c\n"
        "import slurm_guard as sg\n"
        "from slurm_guard.rundir.records import Alarm\n"
        "from slurm_guard.local import run_local\n"
        "print(a is sg.init_distributed_from_slurm, b is Alarm, c is run_local)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "True"], out.stdout + out.stderr


def test_the_job_side_loads_no_framework_at_import() -> None:
    """Importing the package, the core or the integrations package pulls in no framework: the
    base install has none, and the frameworks' own imports cost seconds on every rank."""
    code = (
        "import sys, slurm_guard, slurm_guard.core, slurm_guard.guard, slurm_guard.integrations\n"
        "names = ('transformers', 'accelerate', 'lightning', 'pytorch_lightning')\n"
        "print(sorted(n for n in names if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


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

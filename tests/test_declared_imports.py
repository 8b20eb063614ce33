"""Every package's pyproject.toml declares exactly what its code imports.

Read from the sources (every ``import``, lazy ones and ``TYPE_CHECKING`` ones included): each
third-party module a package imports is one of its dependencies (or, for an optional import, of
its extras), and each dependency is imported, but for the few needed otherwise (``NOT_IMPORTED``).
In particular no platform package imports another one or kvik_models: kvik-rocm needs nothing
from kvik-cuda, and kvik-cpu reaches models through kvik.models.decoder_stack.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

PACKAGES = Path(__file__).resolve().parents[1] / "packages"
FOLDERS = ["core", "platform-cpu", "platform-cuda", "platform-rocm", "models", "server"]

#: Distributions whose import name is not their normalised name.
IMPORT_NAMES = {"nvidia-ml-py": "pynvml", "pyzmq": "zmq"}
#: Dependencies a package needs without importing them, and why.
NOT_IMPORTED = {
    "kvik-cpu": {"ninja": "torch.utils.cpp_extension builds the C++ ops with it"},
}
#: Imports a package's dependencies do not cover, and who provides them.
PROVIDED_ELSEWHERE = {
    "kvik": {
        "triton": "kvik.triton_kernels is imported only by kvik-cuda and kvik-rocm, which depend on it"
    },
}


def distribution_name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower().replace("_", "-")


def import_name(distribution: str) -> str:
    return IMPORT_NAMES.get(distribution, distribution.replace("-", "_"))


def imported_modules(source_dir: Path) -> set[str]:
    """The top-level names of every absolute import in ``source_dir``'s Python files."""
    names: set[str] = set()
    for path in source_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("folder", FOLDERS)
def test_package_declares_what_it_imports(folder: str) -> None:
    project = tomllib.loads((PACKAGES / folder / "pyproject.toml").read_text())["project"]
    name = project["name"]
    dependencies = {distribution_name(r) for r in project.get("dependencies", [])}
    extras = {
        distribution_name(r)
        for extra, requirements in project.get("optional-dependencies", {}).items()
        if extra != "test"
        for r in requirements
    }
    own = {import_name(name)}
    third_party = {
        module
        for module in imported_modules(PACKAGES / folder / "src")
        if module not in sys.stdlib_module_names and module != "__future__"
    } - own

    declared = {import_name(d) for d in dependencies | extras}
    elsewhere = set(PROVIDED_ELSEWHERE.get(name, {}))
    assert third_party - declared - elsewhere == set(), f"{name} imports undeclared modules"

    needed_otherwise = set(NOT_IMPORTED.get(name, {}))
    unused = {d for d in dependencies if import_name(d) not in third_party} - needed_otherwise
    assert unused == set(), f"{name} declares dependencies it never imports"

"""Imports point downward: nothing in the package imports ``apps``, ``apps`` uses the public API,
and no module loads code from the source checkout (an installed wheel has none)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "speedswap"
MODULES = sorted(PACKAGE.rglob("*.py"))


def imported_modules(path):
    """Absolute names of the modules ``path`` imports (relative imports resolved)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                names.append(".".join(base + ([node.module] if node.module else [])))
            else:
                names.append(node.module)
    return names


@pytest.mark.parametrize("path", [p for p in MODULES if "apps" not in p.parts and p.name != "__main__.py"],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_library_does_not_import_apps(path):
    assert not [name for name in imported_modules(path) if name.startswith("speedswap.apps")]


@pytest.mark.parametrize("path", [p for p in MODULES if "apps" in p.parts], ids=lambda p: str(p.relative_to(PACKAGE)))
def test_apps_use_the_public_api(path):
    inner = [name for name in imported_modules(path)
             if name.startswith("speedswap.") and not name.startswith("speedswap.apps")]
    assert inner == [], f"{path.name} reaches past speedswap's public API: {inner}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_loads_files_from_the_checkout(path):
    source = path.read_text()
    assert "spec_from_file_location" not in source and '"benchmarks"' not in source

"""The package's layers: every module imports only from its own layer or below.

apps -> compat -> train | data -> table -> files | backends -> convert -> errors.
``train`` and ``data`` sit side by side and do not import each other; ``info``
reports on tables, backends and the device caches ``train`` registers in ``live``.
``apps`` builds on the public API only (the root package; ``atomic``, the one way
to write a file; and ``convert``'s option checks), nothing but the command line
imports ``apps``, and no module loads code from the source checkout.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "speedswap"

#: layer of each top-level name under speedswap/ (a module or a subpackage).
RANKS = {
    "version": 0,
    "errors": 0,
    "mappings": 0,   # this process's file mappings (/proc/self/maps): no imports
    "convert": 1,
    "atomic": 1,     # atomic saves: errors only
    "live": 1,       # the registry of device caches that train fills and info reads: no imports
    "malloc": 1,     # the process's malloc settings, for training on a CPU: no imports
    "backends": 2,
    "files": 2,
    "table": 3,
    "train": 4,
    "data": 4,
    "info": 4,
    "compat": 5,
    "apps": 6,
    "__init__": 7,   # the public API
    "__main__": 8,   # the command line
}


def _unit(module_path):
    """The top-level name (module or subpackage) a file of the package belongs to."""
    return module_path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _public_names():
    """``speedswap.__all__``, read from the source as the walk below reads imports (nothing imported)."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    return next(set(ast.literal_eval(node.value)) for node in tree.body
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets))


PUBLIC_NAMES = _public_names()


def _package_name(name):
    """The unit ``from speedswap import name`` reaches: a module of the package, or the public API."""
    return name if name in RANKS and name not in PUBLIC_NAMES else "__init__"


def _imported_units(module_path):
    """Top-level speedswap names a module imports (relative or absolute)."""
    tree = ast.parse(module_path.read_text(encoding="utf-8"), filename=str(module_path))
    depth = len(module_path.relative_to(PACKAGE).parts) - 1  # folders below speedswap/
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: climb to the package root
                climb = node.level - 1
                if climb < depth:  # stays inside this module's own folder
                    continue
                parts = (node.module or "").split(".") if node.module else []
                names = [parts[0]] if parts and parts[0] else [alias.name for alias in node.names]
            elif node.module and node.module.split(".")[0] == "speedswap":
                parts = node.module.split(".")
                # `from speedswap import convert` imports a module, `from speedswap import HostTable` the API.
                names = [parts[1]] if len(parts) > 1 else [_package_name(alias.name) for alias in node.names]
            else:
                continue
            found.update(names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "speedswap":
                    found.add(parts[1] if len(parts) > 1 else "__init__")
    return found


#: What ``apps`` may import: the public API, the atomic saves every file speedswap writes goes through,
#: and the checks of options and values (``convert``) that give its commands the library's errors.
APPS_MAY_IMPORT = {"__init__", "atomic", "convert"}

MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("module_path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_downward(module_path):
    unit = _unit(module_path)
    assert unit in RANKS, f"{unit} has no layer in this test: place it"
    for name in _imported_units(module_path):
        if name == unit:
            continue
        assert name in RANKS, f"{module_path.name} imports speedswap.{name}, which has no layer"
        if unit == "apps":
            assert name in APPS_MAY_IMPORT, (f"speedswap/{module_path.relative_to(PACKAGE)} reaches "
                                             f"past the public API into speedswap.{name}")
            continue
        assert RANKS[name] < RANKS[unit], (
            f"speedswap/{module_path.relative_to(PACKAGE)} (layer {unit}) imports "
            f"speedswap.{name}, which is not below it")


def test_the_walk_finds_relative_and_absolute_imports():
    """The walk above sees what a module imports, so the test above can fail."""
    assert _imported_units(PACKAGE / "backends" / "resolve.py") >= {"errors"}
    assert "backends" not in _imported_units(PACKAGE / "backends" / "resolve.py")  # its own folder
    assert {"table", "convert", "files"} <= _imported_units(PACKAGE / "train" / "embedding.py")
    assert "data" in _imported_units(PACKAGE / "compat" / "speedtorch.py")
    assert "convert" in _imported_units(PACKAGE / "apps" / "corpus.py")  # from speedswap import convert
    assert "__init__" in _imported_units(PACKAGE / "apps" / "demo.py")  # import speedswap as ss


@pytest.mark.parametrize("module_path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_loads_files_from_the_checkout(module_path):
    """An installed wheel has no checkout: nothing may import code by path from one."""
    source = module_path.read_text(encoding="utf-8")
    assert "spec_from_file_location" not in source and '"benchmarks"' not in source


#: layer of each module of speedswap/files/: the two formats share ``base``, HDF5 seals its files with
#: ``h5seal``, whole tables use both formats.
FILES_RANKS = {"base": 0, "h5seal": 0, "npy": 1, "h5": 1, "tables": 2, "__init__": 3}


@pytest.mark.parametrize("module_path", sorted((PACKAGE / "files").glob("*.py")), ids=lambda p: p.name)
def test_file_modules_import_only_those_below_them(module_path):
    unit = module_path.stem
    assert unit in FILES_RANKS, f"files/{module_path.name} has no layer in this test: place it"
    tree = ast.parse(module_path.read_text(encoding="utf-8"), filename=str(module_path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:  # a sibling in files/
            names = [node.module.split(".")[0]] if node.module else [alias.name for alias in node.names]
            for name in names:
                assert FILES_RANKS[name] < FILES_RANKS[unit], (
                    f"speedswap/files/{module_path.name} imports files.{name}, which is not below it")

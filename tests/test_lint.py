"""ruff, configured in pyproject.toml, passes on the package, tests and examples; the packages keep their layers."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def test_ruff():
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is not installed (it comes with the test extra)")
    result = subprocess.run(
        [str(ruff), "check", "keras_pipe", "tests", "examples", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_contracts():
    """setup.cfg's [importlinter] contracts: the layers, no MPI below the engine, no import cycle."""
    lint_imports = Path(sys.executable).parent / "lint-imports"
    if not lint_imports.exists():
        pytest.skip("import-linter is not installed (it comes with the test extra)")
    result = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout, result.stdout


def test_what_runs_before_mpi_starts_imports_nothing_of_mpi():
    """keras_pipe.mpi's __init__, mpi/runtime.py and mpi/start.py run before MPI has started (under its deadline).

    At module level they, and the keras_pipe modules they import, import
    neither mpi4py nor a module that does (an import inside a function runs
    later, once MPI has started): else ``import keras_pipe`` would start MPI
    without the deadline of :mod:`keras_pipe.mpi.start`.
    """
    import ast

    def module_level_imports(module):
        path = ROOT.joinpath(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        for node in ast.parse(path.read_text()).body:  # (the top level only: not in functions)
            if isinstance(node, ast.Import):
                yield from (alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                yield node.module
                for alias in node.names:
                    if ROOT.joinpath(*node.module.split("."), f"{alias.name}.py").exists():
                        yield f"{node.module}.{alias.name}"

    seen, todo = set(), ["keras_pipe.mpi", "keras_pipe.mpi.runtime", "keras_pipe.mpi.start"]
    while todo:
        module = todo.pop()
        for imported in module_level_imports(module):
            assert not imported.startswith("mpi4py"), f"{module} imports {imported} at module level"
            if imported.startswith("keras_pipe.") and imported not in seen:
                seen.add(imported)
                todo.append(imported)
    assert {"keras_pipe.mpi.devices", "keras_pipe.mpi.layout", "keras_pipe.mpi.start"} <= seen, seen


def test_no_import_cycle_between_any_two_modules():
    """No module reaches, through imports, a module that imports it (grimp's graph, imports in functions too)."""
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (the test extra)")
    graph = grimp.build_graph("keras_pipe")
    cycles = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                cycles.append(f"{importer} -> {' -> '.join(back)}")
    assert not cycles, "\n".join(cycles)


def test_every_package_says_what_it_may_import():
    """Each sub-package's __init__ is a docstring (what the layer is for, what it may import), and at most exports.

    A package that exports names (``keras_pipe.schedules``: the schedule
    vocabulary) imports them from its own modules only and lists them in
    ``__all__``; the others import nothing.
    """
    import ast
    import importlib

    for init in sorted((ROOT / "keras_pipe").glob("*/__init__.py")):
        package = f"keras_pipe.{init.parent.name}"
        tree = ast.parse(init.read_text())
        docstring = ast.get_docstring(tree)
        assert docstring and "import" in docstring, init
        imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
        if not imports:
            continue
        assert all(isinstance(node, ast.ImportFrom) and node.module.startswith(f"{package}.") for node in imports), init
        exported = importlib.import_module(package).__all__
        imported = {alias.asname or alias.name for node in imports for alias in node.names}
        assert sorted(exported) == sorted(imported), (init, set(exported) ^ imported)


def test_keras_private_attributes_are_read_in_compat_only():
    """Outside ``keras_pipe/compat``, a ``._name`` attribute (or ``getattr(obj, "_name")``) is one keras_pipe defines.

    An underscored attribute that no keras_pipe module defines (by ``def``,
    by assigning it, or by ``setattr``/``object.__setattr__`` with its name)
    is another library's private one, Keras' mostly: it belongs in ``compat/``,
    whose :func:`keras_pipe.compat.check` fails loudly when an upgrade removes
    it. ``sys._getframe`` and ``os._exit`` are Python's own.
    """
    import ast

    package = ROOT / "keras_pipe"
    trees = {path: ast.parse(path.read_text()) for path in package.rglob("*.py")}
    ours = {"_getframe", "_exit"}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                ours.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                ours.add(node.id)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "setattr",
                "__setattr__",
            ):
                ours.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
            elif isinstance(node, ast.arg):
                ours.add(node.arg)
    foreign = []
    for path, tree in trees.items():
        if "compat" in path.relative_to(package).parts:
            continue
        for node in ast.walk(tree):
            name = node.attr if isinstance(node, ast.Attribute) else None
            if (  # getattr(obj, "_name", ...) and hasattr(obj, "_name") read one too
                isinstance(node, ast.Call)
                and getattr(node.func, "id", "") in ("getattr", "hasattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                name = node.args[1].value
            if name and name.startswith("_") and not name.startswith("__") and name not in ours:
                foreign.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{name}")
    assert not foreign, "private attributes of other libraries outside compat/:\n" + "\n".join(foreign)

"""The public surface: what keras_pipe, keras_pipe.schedules and keras_pipe.mpi export, and nothing in between."""

import ast
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PUBLIC = ("keras_pipe", "keras_pipe.schedules", "keras_pipe.mpi")


@pytest.mark.parametrize("package", PUBLIC)
def test_every_exported_name_exists_and_says_what_it_is(package):
    module = importlib.import_module(package)
    assert module.__all__ and len(set(module.__all__)) == len(module.__all__), package
    for name in module.__all__:
        value = getattr(module, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert inspect.getdoc(value), f"{package}.{name} has no docstring"


def test_no_name_is_exported_twice_under_two_paths():
    owners = {}
    for package in PUBLIC:
        module = importlib.import_module(package)
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isclass(value) or inspect.isfunction(value):
                assert id(value) not in owners, f"{package}.{name} is also {owners.get(id(value))}"
                owners[id(value)] = f"{package}.{name}"


def test_the_package_init_is_start_up_imports_and_all():
    """keras_pipe/__init__.py: the docstring, one call that starts the process, imports, the old paths, __all__."""
    tree = ast.parse(ROOT.joinpath("keras_pipe", "__init__.py").read_text())
    calls = []
    for node in tree.body[1:]:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            calls.append(node.value.func.id)
        elif isinstance(node, ast.Assign):
            assert [t.id for t in node.targets] in (["__version__"], ["__all__"]), ast.dump(node)
        else:
            assert isinstance(node, (ast.Import, ast.ImportFrom)), ast.dump(node)
    assert calls == ["_start_process", "_install_moved_paths"]
    assert isinstance(tree.body[2], ast.Expr) and tree.body[2].value.func.id == "_start_process"  # (first)

"""The import invariant: nothing in omnishm imports vllm at module scope."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "omnishm"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_scope_vllm_imports(tree: ast.AST) -> list[int]:
    """Line numbers of vllm imports that run at import time (outside functions and TYPE_CHECKING)."""
    hits: list[int] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]))
                continue
            if isinstance(child, ast.Import) and any(a.name == "vllm" or a.name.startswith("vllm.")
                                                     for a in child.names):
                hits.append(child.lineno)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module and (
                    child.module == "vllm" or child.module.startswith("vllm.")):
                hits.append(child.lineno)
            elif isinstance(child, ast.Call) and isinstance(child.func, (ast.Name, ast.Attribute)) and (
                    getattr(child.func, "id", getattr(child.func, "attr", "")) in ("import_module", "__import__")
                    and child.args and isinstance(child.args[0], ast.Constant)
                    and str(child.args[0].value).split(".")[0] == "vllm"):
                hits.append(child.lineno)
            visit(child)

    visit(tree)
    return hits


def test_scanner_sees_module_scope_imports():
    src = textwrap.dedent("""
        import os
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            import vllm
        def f():
            import vllm.config
        class C:
            from vllm import envs
        try:
            import vllm.platforms
        except ImportError:
            pass
        x = importlib.import_module("vllm.utils")
    """)
    assert module_scope_vllm_imports(ast.parse(src)) == [9, 11, 14]


def test_no_module_scope_vllm_import_in_package():
    files = sorted(PACKAGE.rglob("*.py"))
    assert files
    bad = {str(p.relative_to(PACKAGE.parent)): lines for p in files
           if (lines := module_scope_vllm_imports(ast.parse(p.read_text(), str(p))))}
    assert bad == {}, f"module-scope vllm imports (move them into functions or TYPE_CHECKING): {bad}"


def test_package_imports_without_vllm():
    code = textwrap.dedent("""
        import importlib, importlib.abc, pkgutil, sys

        class NoVllm(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "vllm" or name.startswith("vllm."):
                    raise ImportError(f"vllm import blocked by the import-invariant test: {name}")
                return None

        sys.meta_path.insert(0, NoVllm())
        import omnishm, omnishm.client, omnishm.committer
        names = [m.name for m in pkgutil.walk_packages(omnishm.__path__, "omnishm.")]
        for name in names:
            if not name.endswith("__main__"):
                importlib.import_module(name)
        assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
        print(len(names))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.strip()) >= 6

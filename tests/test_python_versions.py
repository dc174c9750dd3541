"""Python 3.10 invariants (``requires-python = ">=3.10"``) that the 3.11 test run cannot see by behaviour.

On 3.10, ``concurrent.futures.TimeoutError`` (what ``Future.result(timeout=...)`` raises) is not the
builtin ``TimeoutError``; from 3.11 on it is the same class. A bare ``except TimeoutError`` around
``result(timeout=...)`` therefore passes every test here and misses the timeout on 3.10: the hello
loop would stop retrying an autostarting committer after its first 2 s attempt, and a timed-out
request would leave its pending entry behind. So it is checked in the source.
"""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "omnishm"


def bare_timeout_handlers(tree: ast.AST) -> list[int]:
    """Lines of handlers that catch the builtin ``TimeoutError`` around a ``.result(timeout=...)`` call."""
    hits: list[int] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        waits = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "result"
                    and any(k.arg == "timeout" for k in n.keywords)
                    for stmt in node.body for n in ast.walk(stmt))
        if not waits:
            continue
        for handler in node.handlers:
            caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            names = {c.id for c in caught if isinstance(c, ast.Name)}
            if "TimeoutError" in names and "FutureTimeout" not in names:
                hits.append(handler.lineno)
    return hits


def test_the_scanner_finds_a_bare_timeout_handler():
    src = textwrap.dedent("""
        try:
            fut.result(timeout=1)
        except TimeoutError:
            pass
        try:
            fut.result(timeout=1)
        except FutureTimeout:
            pass
        try:
            fut.result(timeout=1)
        except (TimeoutError, FutureTimeout):
            pass
        try:
            wait(timeout=1)
        except TimeoutError:
            pass
    """)
    assert bare_timeout_handlers(ast.parse(src)) == [4]


def test_future_timeouts_are_caught_as_concurrent_futures_timeout():
    found = {str(p.relative_to(ROOT)): lines for p in sorted(PACKAGE.rglob("*.py"))
             if (lines := bare_timeout_handlers(ast.parse(p.read_text(), str(p))))}
    assert not found, (f"`except TimeoutError` around Future.result(timeout=...) misses the timeout on Python "
                       f"3.10; catch concurrent.futures.TimeoutError (FutureTimeout): {found}")


def test_reading_a_config_file_on_python_3_10_has_its_parser_declared():
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - the CI runs 3.11
        import tomli as tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("tomli") and "python_version<'3.11'" in d.replace(" ", "").replace('"', "'")
               for d in deps), deps

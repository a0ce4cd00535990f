"""Every wait_for_function predicate in the tests is a function, never a bare expression.

Playwright evaluates a bare expression with eval() on every poll. The page's Content-Security-Policy
(script-src 'self') lets only the first evaluation through (it runs inside DevTools' evaluate), so a
bare expression passes when it is true at once and fails with an EvalError when it has to wait: a
CI run failed that way. A function is evaluated once and then called.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def bare_predicates(source: str) -> list[int]:
    """Line numbers of wait_for_function calls whose first argument is a string with no function in it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "wait_for_function" and node.args):
            continue
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            text = first.value
        elif isinstance(first, ast.JoinedStr):
            text = "".join(part.value for part in first.values if isinstance(part, ast.Constant))
        else:
            continue  # a name: its string is checked where it is written, by review
        if "=>" not in text and not text.lstrip().startswith("function"):
            found.append(node.lineno)
    return found


def test_the_check_finds_a_bare_expression_and_passes_a_function():
    assert bare_predicates('page.wait_for_function("document.title === \'x\'")') == [1]
    assert bare_predicates('page.wait_for_function(f"document.title === {n}")') == [1]
    assert bare_predicates('page.wait_for_function("() => document.title === \'x\'")') == []
    assert bare_predicates('page.wait_for_function(f"(n) => n === {n}", arg=1)') == []


def test_no_test_waits_on_a_bare_expression():
    offenders = {
        str(path.relative_to(TESTS)): lines
        for path in sorted(TESTS.rglob("*.py"))
        if (lines := bare_predicates(path.read_text()))
    }
    assert offenders == {}, f"write these predicates as functions, '() => ...': {offenders}"

"""Every tolerance lives in tests/tolerances.py: a scan of the test sources that fails naming file and line.

The scan parses each Python file under tests/ (tolerances.py and this file excepted) and reports three patterns:
1. a tolerance keyword (atol, rtol, rel_tol, abs_tol) given a non-zero numeric literal or an expression of
   literals only (`rtol=2 ** -7`); `atol=0` is an exact comparison and passes, a name (`atol=atol`) passes;
2. a closeness call (allclose, isclose, assert_close) that leaves a tolerance to the library default (a hidden
   tolerance: torch.allclose's rtol=1e-5, math.isclose's rel_tol=1e-9);
3. an upper bound with a non-integer literal in an assert: `assert err < 1e-4`, `... <= 1e-5 * ref.max()`,
   `< 4 * 2 ** -24` (a literal-only subexpression of non-integer value on the larger side of <, <=, >, >=;
   exponents such as `n ** 0.5` are not bounds and are left out).
It does not see a tolerance stored in a variable first (`eps = 1e-5` then `err < eps`), an integer bound
(`ulps <= 4`), or a bound outside an assert statement. Thresholds that are not tolerances pass: integer counts and
limits, and lower bounds (`assert gap > 1e-3`: the literal is on the smaller side).
"""
import ast
from pathlib import Path

import pytest

from tests.tolerances import TOLERANCES

TESTS = Path(__file__).parent
SKIP = {"tolerances.py", Path(__file__).name}
TOLERANCE_KEYWORDS = {"atol", "rtol", "rel_tol", "abs_tol"}
# the keywords a closeness call must name so that no library default applies
REQUIRED = {"allclose": {"atol", "rtol"}, "assert_close": {"atol", "rtol"}, "isclose": {"rel_tol"}}


def _literal_value(node: ast.AST) -> float | None:
    """The value of an expression made of numeric literals and arithmetic only, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _literal_value(node.operand)
        return None if v is None else (-v if isinstance(node.op, ast.USub) else v)
    if isinstance(node, ast.BinOp):
        a, b = _literal_value(node.left), _literal_value(node.right)
        if a is None or b is None:
            return None
        ops = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b,
               ast.Div: lambda: a / b if b else None, ast.Pow: lambda: a ** b}
        f = ops.get(type(node.op))
        return None if f is None else f()
    return None


def _literals(node: ast.AST):
    """Values of the largest literal-only subexpressions of node, exponents of a power (`n ** 0.5`) left out."""
    v = _literal_value(node)
    if v is not None:
        yield v
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        yield from _literals(node.left)
    else:
        for child in ast.iter_child_nodes(node):
            yield from _literals(child)


def _has_fractional_literal(node: ast.AST) -> bool:
    return any(isinstance(v, (int, float)) and v != int(v) for v in _literals(node))


def _call_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _bound_sides(cmp: ast.Compare):
    """The larger side of each comparison in a chain (a < b: b; a > b: a)."""
    left = cmp.left
    for op, right in zip(cmp.ops, cmp.comparators):
        if isinstance(op, (ast.Lt, ast.LtE)):
            yield right
        elif isinstance(op, (ast.Gt, ast.GtE)):
            yield left
        left = right


def inline_tolerances(source: str) -> list[tuple[int, str]]:
    """(line, what) for each inline tolerance in a Python source (the three patterns of the module docstring)."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            given = {k.arg for k in node.keywords}
            for k in node.keywords:
                if k.arg in TOLERANCE_KEYWORDS and _literal_value(k.value) not in (None, 0):
                    found.append((k.value.lineno, f"{k.arg}={ast.unparse(k.value)}"))
            missing = REQUIRED.get(_call_name(node), set()) - given
            if missing and not any(k.arg is None for k in node.keywords):  # **kwargs may carry them
                found.append((node.lineno, f"{_call_name(node)} without {', '.join(sorted(missing))}"))
        elif isinstance(node, ast.Assert):
            for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                for side in _bound_sides(cmp):
                    if _has_fractional_literal(side):
                        found.append((cmp.lineno, f"bound {ast.unparse(side)}"))
    return sorted(set(found))


@pytest.mark.parametrize("source,expect", [
    ("torch.testing.assert_close(a, b, atol=1e-5, rtol=0)", ["atol=1e-05"]),
    ("torch.testing.assert_close(a, b, atol=0, rtol=2 ** -7)", ["rtol=2 ** (-7)"]),
    ("assert torch.allclose(a, b)", ["allclose without atol, rtol"]),
    ("assert math.isclose(a, b, abs_tol=0)", ["isclose without rel_tol"]),
    ("assert abs(a - b) < 1e-12", ["bound 1e-12"]),
    ("assert err.max() <= 1e-5 * ref.abs().max()", ["bound 1e-05 * ref.abs().max()"]),
    ("assert 0.25 > rel", ["bound 0.25"]),
    ("assert rel < 4 * 2 ** -24", ["bound 4 * 2 ** (-24)"]),
    ("assert dev <= k * step / (2 * n ** 0.5)", []),
    ("torch.testing.assert_close(a, b, atol=0, rtol=0)", []),
    ("torch.testing.assert_close(a, b, atol=atol, rtol=rtol)", []),
    ("assert torch.allclose(a, b, **TOL)", []),
    ("assert math.isclose(a, b, rel_tol=TOLERANCES['x'][1])", []),
    ("assert gap > 1e-3 and n <= 4 and u < 2**24", []),
])
def test_the_scan_finds_inline_tolerances(source, expect):
    assert [what for _line, what in inline_tolerances(source)] == expect


def test_the_scan_names_the_line():
    assert inline_tolerances("x = 1\n\nassert err < 0.5\n") == [(3, "bound 0.5")]


def test_no_inline_tolerance_in_the_tests():
    files = sorted(p for p in TESTS.rglob("*.py") if p.name not in SKIP)
    assert len(files) > 30  # the scan sees the suite
    hits = [f"{p.relative_to(TESTS.parent)}:{line}: {what}"
            for p in files for line, what in inline_tolerances(p.read_text())]
    assert not hits, "tolerances belong in tests/tolerances.py (with their justification):\n" + "\n".join(hits)


def test_every_table_entry_is_a_pair_of_non_negative_numbers():
    for name, value in TOLERANCES.items():
        atol, rtol = value
        assert atol >= 0 and rtol >= 0 and (atol > 0 or rtol > 0), name

"""Rules the test suite keeps, read from its source: a parity count is never thrown away, and a C kernel that
does not build fails a test instead of skipping it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
TEST_FILES = sorted([*TESTS.glob("test_*.py"), *TESTS.glob("kernels/test_*.py")])


def _calls(path: Path):
    return [n for n in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(n, ast.Call)]


def test_no_parity_result_is_thrown_away() -> None:
    """assert_greedy_parity says whether a sequence matched the reference in full: a test counts it against a
    floor (tests/reference.py's assert_parity_floor, or a sum it asserts on), never calls it for nothing."""
    dropped = []
    for path in TEST_FILES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                f = node.value.func
                if isinstance(f, ast.Name) and f.id == "assert_greedy_parity":
                    dropped.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    assert not dropped, dropped


def test_no_test_skips_on_a_kernel_that_did_not_build() -> None:
    """A skip conditioned on a compiler or a kernel's `available()` would turn a failed build into a green run;
    tests/c_kernels.py's needs_c_kernels fails instead."""
    skips = []
    for path in TEST_FILES:
        for call in _calls(path):
            f = call.func
            if isinstance(f, ast.Attribute) and f.attr == "skipif" and call.args:
                cond = ast.unparse(call.args[0])
                # a kernel binding's available() (torch's is_available(): hardware, not a build)
                if re.search(r"(?<!is_)available\(\)", cond) or "find_compiler" in cond or "HAS_CC" in cond:
                    skips.append(f"{path.relative_to(TESTS)}:{call.lineno}: {cond}")
    assert not skips, skips

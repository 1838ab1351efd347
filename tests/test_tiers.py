"""The suite's two tiers (tests/tiers.py), run on a small suite of their own by a real pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SUITE = '''
    import time
    import pytest

    def test_quick():
        pass

    @pytest.mark.slow("sleeps on purpose")
    def test_slow_one():
        pass

    @pytest.fixture
    def slow_setup():
        time.sleep(0.6)

    def test_slow_but_not_marked(slow_setup):
        time.sleep(0.6)
'''


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:randomly", *args], cwd=folder, capture_output=True, text=True,
                          check=False, timeout=120)


def _suite(tmp_path: Path, body: str = SUITE) -> Path:
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
        "from tiers import (pytest_addoption, pytest_collection_modifyitems,  # noqa: F401\n"
        "                   pytest_runtest_makereport, pytest_terminal_summary)\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow(why): slow\n")
    (tmp_path / "test_suite.py").write_text(textwrap.dedent(body))
    return tmp_path


def test_the_fast_tier_leaves_the_slow_tests_out_and_says_how_to_run_them(tmp_path):
    out = _pytest(_suite(tmp_path), "--fast-limit", "0")
    assert out.returncode == 0, out.stdout
    assert "2 passed, 1 deselected" in out.stdout
    assert "1 slow tests not run: `python -m pytest -q --full` runs every test" in out.stdout
    full = _pytest(tmp_path, "--full", "--fast-limit", "0")
    assert full.returncode == 0 and "3 passed" in full.stdout
    only = _pytest(tmp_path, "-m", "slow")
    assert only.returncode == 0 and "1 passed, 2 deselected" in only.stdout


def test_a_test_outside_slow_over_the_limit_fails_named_with_its_setup_counted(tmp_path):
    out = _pytest(_suite(tmp_path), "--fast-limit", "1")
    assert out.returncode == 1
    assert "test_suite.py::test_slow_but_not_marked took" in out.stdout
    assert "over the fast tier's 1 s" in out.stdout and "set-up 0.6 s" in out.stdout
    assert "1 failed, 1 passed, 1 deselected" in out.stdout


def test_a_slow_marker_must_say_why(tmp_path):
    out = _pytest(_suite(tmp_path, "import pytest\n\n@pytest.mark.slow\ndef test_x():\n    pass\n"))
    assert out.returncode != 0
    assert "test_suite.py::test_x: a slow test says why it is slow" in out.stdout + out.stderr

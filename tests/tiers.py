"""Two tiers, one suite: `python -m pytest -q` runs the fast tier, `--full` every test.

A test is in the fast tier unless it is marked `@pytest.mark.slow("why it is slow")`; a slow
marker without its reason stops the collection. A passing test outside the slow tier whose
set-up and call took longer than `--fast-limit` seconds (default 10) fails, named, so that the
fast tier stays fast. `-m slow` runs the slow tier alone; `-k`, `-x` and `-m` work as always.
Hooks only (tests/conftest.py imports them), standard pytest API, Python 3.8.
"""

from __future__ import annotations

import pytest

#: a test outside `slow` may take this long, set-up included (--fast-limit changes it)
FAST_LIMIT_S = 10.0


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run every test: the slow tier (tests marked slow) too")
    parser.addoption("--fast-limit", type=float, default=FAST_LIMIT_S, metavar="SECONDS",
                     help="fail a test outside the slow tier whose set-up and call take longer "
                          f"(default {FAST_LIMIT_S:g}; 0: no limit)")


def _slow_reason(item):
    """The reason its `slow` marker gives, "" where it has none, None where it is not slow."""
    mark = item.get_closest_marker("slow")
    if mark is None:
        return None
    why = mark.kwargs.get("reason", mark.args[0] if mark.args else "")
    return why.strip() if isinstance(why, str) else ""


def pytest_collection_modifyitems(config, items):
    unexplained = [i.nodeid for i in items if _slow_reason(i) == ""]
    if unexplained:
        raise pytest.UsageError(
            f"{unexplained[0]}: a slow test says why it is slow, e.g. "
            "@pytest.mark.slow(\"three daemons on Mosquitto, 40 s\")"
            + (f" (+{len(unexplained) - 1} more)" if len(unexplained) > 1 else ""))
    if config.getoption("--full") or "slow" in (config.getoption("markexpr") or ""):
        return
    keep = [i for i in items if _slow_reason(i) is None]
    if len(keep) < len(items):
        dropped = [i for i in items if _slow_reason(i) is not None]
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
        config._fedseq_slow_left = len(dropped)


def pytest_terminal_summary(terminalreporter, config):
    left = getattr(config, "_fedseq_slow_left", 0)
    if left:
        terminalreporter.write_line(f"{left} slow tests not run: `python -m pytest -q --full` runs "
                                    "every test")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The fast tier stays fast: a passing test outside `slow` whose set-up and call took longer
    than --fast-limit fails, named, with its time."""
    outcome = yield
    report = outcome.get_result()
    if call.when == "setup":
        item._fedseq_setup_s = call.duration
        return
    limit = item.config.getoption("--fast-limit")
    if call.when != "call" or not limit or _slow_reason(item) is not None or not report.passed:
        return
    setup = getattr(item, "_fedseq_setup_s", 0.0)
    if setup + call.duration > limit:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {setup + call.duration:.1f} s (set-up {setup:.1f} s, call "
            f"{call.duration:.1f} s), over the fast tier's {limit:g} s: make it faster, or mark it "
            "@pytest.mark.slow(\"why\") so that it runs with --full")

"""A pytest plugin for runs that may be stopped at a time limit (benchmarks/gpu_session.sh): each
failure's report is appended to $LIVE_FAILURES as it happens, so a killed run still says why its
tests failed (pytest, and pytest-xdist's controller, print them only at the end). With
$ONLY_TESTS naming a file of test ids (one per line), only those run: a rerun of what a stopped
run failed or did not reach.

    LIVE_FAILURES=failures.log python -m pytest -p benchmarks.live_failures ...
"""

from __future__ import annotations

import os


def pytest_collection_modifyitems(config, items) -> None:
    path = os.environ.get("ONLY_TESTS")
    if not path:
        return
    wanted = {line.strip() for line in open(path) if line.strip()}
    keep = [item for item in items if item.nodeid in wanted]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in wanted])
    items[:] = keep


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("LIVE_FAILURES")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")

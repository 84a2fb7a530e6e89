"""The fixtures every test may use, and the skip rules of the suite.

The tests mirror the package's rooms (tests/engine, tests/capacity, tests/shared, …);
what they share lives in two packages beside them, importable from any test because
``tests/`` is on the path (pyproject's ``pythonpath``): `fakes` (fake upstreams, fake
CLI programs and the scripts that run them) and `helpers` (an assembled relay from config
text — `helpers.assembled` —, a real redis-server, the netns stage, the WebDriver client).
Fixtures that only one room uses live in that room's ``conftest.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from fakes.upstream import FakeUpstream, serve_fake_upstream

# Quart's routes are imported once for the whole session, not by a relay's first Quart
# route (which imports them in a worker thread, and virtual time runs on while a thread
# works: a test on `autojump_clock` would see seconds pass). tests/front/test_paths.py checks
# the import-at-first-route path in a clean interpreter.


@pytest.fixture(autouse=True)
def _state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Default record locations resolve under the test's own folder, never ~/.local/state.
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
async def upstream(nursery: trio.Nursery) -> FakeUpstream:
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    return up


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(30.0)) as c:
        yield c


# --- skips: their reasons shown, and failures in CI ---------------------------------------

def _trio_skip(call: Any) -> BaseException | None:
    """The skip a trio test raised, when pytest-trio re-raised it without its reason.

    pytest-trio 0.8 runs the test inside ``trio.run``, finds the `Skipped` in the
    exception group trio wraps it in, and calls ``pytest.skip()`` with no message, so the
    summary read ``SKIPPED [20] …/_pytest/python.py:187: Skipped``. The original is that
    bare skip's ``__context__`` (the group): its one leaf carries the reason and the line.
    """
    excinfo = call.excinfo
    if excinfo is None or not isinstance(excinfo.value, pytest.skip.Exception):
        return None
    group = excinfo.value.__context__
    leaves: list[BaseException] = []
    todo = [group] if isinstance(group, BaseExceptionGroup) else []
    while todo:
        exc = todo.pop()
        if isinstance(exc, BaseExceptionGroup):
            todo += exc.exceptions
        else:
            leaves.append(exc)
    if len(leaves) == 1 and isinstance(leaves[0], pytest.skip.Exception):
        return leaves[0]
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    """Every skip shows its own reason and line in the summary (`_trio_skip`); with
    RELAY_STRICT_SKIPS=1 (set by .ci/run) a skipped test fails: CI installs every outside
    tool a test needs, so a skip there means something is missing."""
    import os

    outcome = yield
    report = outcome.get_result()
    original = _trio_skip(call) if report.skipped else None
    if original is not None and isinstance(report.longrepr, tuple):
        path, line, _ = report.longrepr
        # Where the test (or its fixture) called pytest.skip: the innermost frame that
        # pytest would show, i.e. not one that hides itself from tracebacks.
        info = pytest.ExceptionInfo.from_exception(original)
        frames = [entry for entry in info.traceback
                  if not entry.frame.f_locals.get("__tracebackhide__")
                  and not entry.frame.f_globals.get("__tracebackhide__")]
        if frames:
            path, line = str(frames[-1].path), frames[-1].lineno + 1
        report.longrepr = (path, line, f"Skipped: {original.msg}")
    if report.skipped and os.environ.get("RELAY_STRICT_SKIPS") == "1" and not hasattr(
            report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped, and skips are failures in CI: {report.longrepr}"

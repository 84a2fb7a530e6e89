"""Skip reasons reach pytest's summary (issue 15): the README promises that a test that
needs an outside tool skips "with a message", and `RELAY_STRICT_SKIPS=1` fails with it.

pytest-trio re-raises a trio test's skip without its reason (the summary read
``SKIPPED [20] …/_pytest/python.py:187: Skipped``); tests/helpers/assembled.py's report hook
restores it. Checked the way a user meets it: pytest run as a subprocess on a small test
file, with this suite's conftest loaded as a plugin (``-p conftest``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = textwrap.dedent('''
    import pytest
    import trio

    async def test_async():
        await trio.sleep(0)
        pytest.skip("needs the async thing")

    def test_sync():
        pytest.skip("needs the sync thing")

    @pytest.fixture
    async def needs_tool():
        await trio.sleep(0)
        pytest.skip("needs the tool a fixture looks for")
        yield

    async def test_with_fixture(needs_tool):
        pass
''')


def run_pytest(tmp_path: Path, *extra: str, strict: bool = False) -> str:
    (tmp_path / "test_skipping.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntrio_mode = true\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    env.pop("RELAY_STRICT_SKIPS", None)
    if strict:
        env["RELAY_STRICT_SKIPS"] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p",
                           "no:cacheprovider", "-ra", *extra, "test_skipping.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    return done.stdout + done.stderr


def test_each_skip_shows_its_own_reason_and_line(tmp_path: Path) -> None:
    out = run_pytest(tmp_path)
    assert "3 skipped" in out, out
    assert "SKIPPED [1] test_skipping.py:7: needs the async thing" in out, out
    assert "SKIPPED [1] test_skipping.py:10: needs the sync thing" in out, out
    assert "SKIPPED [1] test_skipping.py:15: needs the tool a fixture looks for" in out, out
    assert "python.py" not in out and ": Skipped" not in out, out


def test_strict_skips_fail_with_the_reason(tmp_path: Path) -> None:
    out = run_pytest(tmp_path, strict=True)
    assert "3 failed" in out, out
    assert "skips are failures in CI" in out and "needs the async thing" in out, out

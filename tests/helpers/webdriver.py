"""A tiny WebDriver client (W3C protocol over httpx) driving a headless Chromium.

Just what the status page test needs: open a session on Debian's ``chromedriver``, load a
URL, run scripts, click, type, take a screenshot. `open_browser` skips the test, with the
reason, when Chromium or chromedriver is not installed (.ci/install-ops.sh installs them).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C element reference key
STARTED = re.compile(r"started successfully on port (\d+)")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1280,1000",
    # Names of the tests' own, resolved to loopback (a DNS rebinding attack looks so);
    # everything else resolves nowhere: the browser never leaves the machine.
    "--host-resolver-rules=MAP rebound.test 127.0.0.1, MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]


class WebDriverError(Exception):
    pass


class Browser:
    """One WebDriver session."""

    def __init__(self, http: httpx.AsyncClient, session: str) -> None:
        self.http = http
        self.session = session

    async def command(self, method: str, path: str, body: Any = None) -> Any:
        r = await self.http.request(method, f"/session/{self.session}{path}",
                                    json=body if body is not None else None)
        value = r.json().get("value")
        if r.status_code != 200:
            raise WebDriverError(f"{method} {path}: {r.status_code} {value}")
        return value

    async def get(self, url: str) -> None:
        await self.command("POST", "/url", {"url": url})

    async def execute(self, script: str, *args: Any) -> Any:
        return await self.command("POST", "/execute/sync", {"script": script, "args": args})

    async def execute_async(self, script: str, *args: Any) -> Any:
        """``script`` calls ``arguments[arguments.length - 1](result)`` when done."""
        return await self.command("POST", "/execute/async", {"script": script, "args": args})

    async def find(self, css: str) -> str:
        found = await self.command("POST", "/element", {"using": "css selector",
                                                        "value": css})
        return str(found[ELEMENT])

    async def click(self, css: str) -> None:
        await self.command("POST", f"/element/{await self.find(css)}/click", {})

    async def type(self, css: str, text: str) -> None:
        await self.command("POST", f"/element/{await self.find(css)}/value", {"text": text})

    async def screenshot(self) -> bytes:
        return base64.b64decode(await self.command("GET", "/screenshot"))

    async def wait_for(self, script: str, *args: Any, limit_s: float = 10.0) -> Any:
        """Run ``script`` (which returns a value) until it is truthy; return it."""
        with trio.fail_after(limit_s):
            while True:
                value = await self.execute(script, *args)
                if value:
                    return value
                await trio.sleep(0.05)


def _binaries() -> tuple[str, str]:
    chromium = next((found for name in ("chromium", "chromium-browser", "google-chrome")
                     if (found := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("headless Chromium is not installed (need the Debian packages chromium "
                    "and chromium-driver: apt-get install -y chromium chromium-driver; "
                    "CI runs .ci/install-ops.sh)")
    return chromium, driver


@asynccontextmanager
async def open_browser(tmp_path: Path) -> AsyncIterator[Browser]:
    chromium, driver = _binaries()
    log = tmp_path / "chromedriver.log"
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the child's stdout
    try:
        proc = await trio.lowlevel.open_process([driver, "--port=0"], stdin=subprocess.DEVNULL,
                                                stdout=fd, stderr=subprocess.STDOUT)
    finally:
        os.close(fd)
    try:
        with trio.fail_after(15):
            while not (m := STARTED.search(log.read_text(errors="replace"))):
                if proc.returncode is not None:
                    raise WebDriverError(f"chromedriver exited: {log.read_text()}")
                await trio.sleep(0.02)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{m.group(1)}",
                                     trust_env=False, timeout=30.0) as http:
            caps = {"capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {"binary": chromium, "args": [
                    *CHROMIUM_FLAGS, f"--user-data-dir={profile}"]},
            }}}
            r = await http.post("/session", json=caps)
            value = r.json()["value"]
            if r.status_code != 200:
                raise WebDriverError(f"no session: {value}")
            browser = Browser(http, value["sessionId"])
            try:
                yield browser
            finally:
                with trio.move_on_after(10, shield=True):
                    await http.delete(f"/session/{browser.session}")
    finally:
        if proc.returncode is None:
            proc.terminate()
        with trio.move_on_after(5, shield=True):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()

"""The status page at ``/``, in a real headless Chromium against a live relay (issue 8).

The relay runs in the test's nursery on loopback; a queue is built on purpose (a provider
with one lane and slow fake requests); the page must show it, escape what providers name,
run a check through its button, and — being a page in a browser — reach only its own
relay: a page of another origin is refused by the guard.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers.assembled import chat, config_from, records, start_relay, wait_for
from helpers.page_scripts import card, card_is
from helpers.webdriver import Browser, open_browser

import relay

XSS = '<img src=x onerror="window.__xss=1">'
CONFIG = f"""
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo", '{XSS}']
[providers.slow]
adapter = "fake"
models = ["echo"]
[providers.slow.profile]
lanes = 1
queue_max = 8
queue_timeout_s = 120
run_timeout_s = 120
"""
SLOW = "slow/echo?delay_s=60"  # runs until the test ends it






async def hold(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
    await client.post(url, json=body)  # cancelled by the test: the client leaves


async def test_status_page_shows_a_queue_escapes_names_and_checks(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        served = await start_relay(nursery, CONFIG, tmp_path)
        url = served.url
        async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
            # Finished requests for the table: an answer, an HTML-ish model, an unknown one.
            r = await client.post(f"{url}/v1/chat/completions", json=chat("fake/echo", "hi"))
            assert r.status_code == 200, r.text
            r = await client.post(f"{url}/v1/chat/completions", json=chat(f"fake/{XSS}"))
            assert r.status_code == 200, r.text
            r = await client.post(f"{url}/v1/chat/completions", json=chat("nope/x"))
            assert r.status_code == 404
            async with trio.open_nursery() as holders:
                # The queue, on purpose: one running, three waiting.
                lane = served.relay.providers["slow"].lane
                for n in range(4):
                    holders.start_soon(hold, client, f"{url}/v1/chat/completions",
                                       chat(SLOW, f"slow {n}"))
                    await wait_for(lambda n=n: lane.statistics().running
                                   + lane.statistics().queued == n + 1)
                async with open_browser(tmp_path) as browser:
                    await browser.get(url + "/")
                    assert await browser.wait_for(card("slow", "running")) == "1/1"
                    await browser.wait_for(card_is("slow", "queued"), "3")
                    assert await browser.execute(card("fake", "running")) == "0/4"
                    assert await browser.execute(card("slow", "state")) == "unverified"
                    await check_escaping(browser)
                    await check_recent_requests(browser, tmp_path)
                    await check_button(browser)
                    await save_screenshot(browser, tmp_path)
                    await check_foreign_origin_refused(browser, served, nursery, tmp_path)
                holders.cancel_scope.cancel()
            # The clients left: their records are written and the lane is idle again.
            await wait_for(lambda: len(records(tmp_path)) == 3 + 1 + 2 + 4)
            await wait_for(lambda: lane.statistics().running + lane.statistics().queued == 0)
        nursery.cancel_scope.cancel()


async def check_escaping(browser: Browser) -> None:
    chips = await browser.execute(
        "return [...document.querySelectorAll('[data-provider=\"fake\"] .chip')]"
        ".map(e => e.textContent);")
    assert chips == ["echo", XSS]  # shown as text, exactly
    assert await browser.execute("return document.querySelectorAll('img').length;") == 0
    assert await browser.execute("return window.__xss === undefined;") is True


async def check_recent_requests(browser: Browser, tmp_path: Path) -> None:
    written = records(tmp_path)
    assert len(written) == 3
    rows = await browser.wait_for(
        "const rows = [...document.querySelectorAll('#requests tbody tr')];"
        "return rows.length === arguments[0] && rows.map(r => [...r.cells]"
        ".map(c => c.textContent));", len(written))
    by_id = {row[1]: row for row in rows}
    for rec in written:
        _, _, model, status, reason, queue, _ = by_id[rec["id"]]
        assert status == str(rec["status"])
        assert reason == (rec["reason"] or "ok")
        if rec["provider"]:
            assert model == f"{rec['provider']}/{rec['model']}"
        assert queue.endswith("ms") if rec["queue_ms"] is not None else queue == "—"
    assert by_id[written[1]["id"]][2] == f"fake/{XSS}"
    assert by_id[written[2]["id"]][4] == "unknown_model"


async def check_button(browser: Browser) -> None:
    await browser.click('[data-provider="fake"] button[data-action="check"]')
    result = await browser.wait_for(
        "const e = document.querySelector('[data-provider=\"fake\"] "
        "[data-field=\"check-result\"]');"
        "return e && !e.hidden && e.className.includes('result-ok') && e.textContent;")
    assert "answered in" in result, result
    # The page refreshes itself: the new state and check time appear.
    await browser.wait_for(card_is("fake", "state"), "connected")
    checked = await browser.execute(card("fake", "checked"))
    assert checked.startswith("last check"), checked


async def save_screenshot(browser: Browser, tmp_path: Path) -> None:
    png = await browser.screenshot()
    assert png.startswith(b"\x89PNG")
    # RELAY_SCREENSHOT=FILE keeps a copy to look at (never committed).
    for target in (tmp_path / "status.png", os.environ.get("RELAY_SCREENSHOT")):
        if target:
            await trio.Path(target).write_bytes(png)


async def serve_foreign_page(task_status: trio.TaskStatus[int]) -> None:
    """Another web page on loopback (another origin, and no CSP of relay's)."""
    page = b"<!doctype html><title>elsewhere</title><p>a page of another origin"

    async def answer(stream: trio.SocketStream) -> None:
        with trio.move_on_after(10):
            data = b""
            while b"\r\n\r\n" not in data and (chunk := await stream.receive_some()):
                data += chunk
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\n"
                                  b"connection: close\r\ncontent-length: "
                                  + str(len(page)).encode() + b"\r\n\r\n" + page)
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(answer, listeners)


async def check_foreign_origin_refused(browser: Browser, served: relay.Served,
                                       nursery: trio.Nursery, tmp_path: Path) -> None:
    """A page of another origin cannot use relay, and a rebound name cannot load it."""
    fake: Any = served.relay.providers["fake"].adapter
    started, before = fake.started, len(records(tmp_path))
    port = await nursery.start(serve_foreign_page)
    await browser.get(f"http://127.0.0.1:{port}/")
    outcome = await browser.execute_async(
        "const done = arguments[arguments.length - 1];"
        "fetch(arguments[0] + '/v1/chat/completions', {method: 'POST', "
        "headers: {'Content-Type': 'application/json'}, body: JSON.stringify("
        "{model: 'fake/echo', messages: [{role: 'user', content: 'x'}]})})"
        ".then(r => done('answered ' + r.status), e => done('refused ' + e.name));",
        served.url)
    assert outcome == "refused TypeError", outcome   # its preflight was refused
    # A "simple" request needs no preflight; the browser sends it, relay refuses it.
    outcome = await browser.execute_async(
        "const done = arguments[arguments.length - 1];"
        "fetch(arguments[0] + '/v1/chat/completions', {method: 'POST', mode: 'no-cors', "
        "headers: {'Content-Type': 'text/plain'}, body: '{\"model\": \"fake/echo\"}'})"
        ".then(r => done('opaque ' + r.type), e => done('refused ' + e.name));",
        served.url)
    assert outcome == "opaque opaque", outcome  # the page can read nothing of it
    await wait_for(lambda: len(records(tmp_path)) == before + 2)
    assert [r["reason"] for r in records(tmp_path)[before:]] == ["forbidden_origin"] * 2
    assert fake.started == started  # nothing reached the provider
    # DNS rebinding: a name of the attacker's, resolved to loopback, is refused by Host.
    rebound = served.url.replace("127.0.0.1", "rebound.test")
    await browser.get(rebound + "/")
    text = await browser.execute("return document.body.textContent;")
    assert "bad_host" in text, text


async def test_same_origin_is_accepted_and_foreign_origins_refused(tmp_path: Path) -> None:
    """The guard's rule without a browser: an Origin equal to http:// + the Host is the
    relay's own page; anything else not in cors_origins is refused."""
    async with trio.open_nursery() as nursery:
        served = await start_relay(nursery, CONFIG, tmp_path)
        port = served.url.rsplit(":", 1)[1]
        check = f"{served.url}/relay/v1/providers/fake/check"
        async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
            own = await client.post(check, headers={"Origin": f"http://127.0.0.1:{port}"})
            assert own.status_code == 200, own.text
            assert "access-control-allow-origin" not in own.headers  # no CORS needed
            as_localhost = await client.post(check, headers={
                "Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"})
            assert as_localhost.status_code == 200, as_localhost.text
            for origin in (f"http://localhost:{port}",        # another name: another origin
                           f"http://127.0.0.1:{int(port) + 1}",
                           f"https://127.0.0.1:{port}", "http://127.0.0.1", "null",
                           f"http://evil.example:{port}"):
                r = await client.post(check, headers={"Origin": origin})
                assert r.status_code == 403, (origin, r.text)
                assert r.json()["error"]["code"] == "forbidden_origin"
            page = await client.get(served.url + "/")
            assert page.status_code == 200
            assert page.headers["content-type"].startswith("text/html")
            csp = page.headers["content-security-policy"]
            assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
            assert "http://" not in page.text and "https://" not in page.text  # no assets
        nursery.cancel_scope.cancel()


async def test_with_a_token_the_page_loads_and_asks_for_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_PAGE_TOKEN", "s3cret-token")
    config = config_from(CONFIG.replace("[server]", '[server]\ntoken_env = "RELAY_PAGE_TOKEN"'),
                         tmp_path)
    async with trio.open_nursery() as nursery:
        served = await nursery.start(lambda task_status: relay.serve(
            config, port=0, task_status=task_status))
        async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
            page = await client.get(served.url + "/")
            assert page.status_code == 200  # the page holds no data
            status = await client.get(served.url + "/relay/v1/status")
            assert status.status_code == 401  # the data needs the token
            metrics = await client.get(served.url + "/metrics")
            assert metrics.status_code == 401
        async with open_browser(tmp_path) as browser:
            await browser.get(served.url + "/")
            await browser.wait_for("return !document.getElementById('token-form').hidden;")
            assert await browser.execute(card("fake", "running")) is None
            await browser.type("#token", "s3cret-token")
            await browser.click("#token-form button")
            assert await browser.wait_for(card("fake", "running")) == "0/4"
            await browser.wait_for("return document.getElementById('token-form').hidden;")
        nursery.cancel_scope.cancel()

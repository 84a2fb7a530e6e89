"""The status page tells the truth (issue 15, item 9), in a real headless Chromium against
a live relay: each provider's running and queued requests (id, model, priority, how long
so far), the state real traffic gave it (SPEC H5: a provider that answered 100 requests
is not "unverified · never checked", one whose last request found nothing listening is
failing), the model of refused requests, the queue time of requests that left while
queued, and the full date on hover of every time it shows.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import httpx
import trio
from helpers.assembled import chat, records, start_relay, wait_for
from helpers.webdriver import Browser, open_browser


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CONFIG = f"""
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.busy]
adapter = "fake"
models = ["echo"]
[providers.busy.profile]
lanes = 1
queue_max = 8
queue_timeout_s = 120
run_timeout_s = 120
[providers.gone]
adapter = "openai"
base_url = "http://127.0.0.1:{closed_port()}/v1"
models = ["qwen3-8b"]
[providers.gone.profile]
lanes = 1
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 20
[routes.story]
primary = "busy/echo?delay_s=60"
"""


def field(provider: str, name: str) -> str:
    return (f"const e = document.querySelector('[data-provider=\"{provider}\"] "
            f"[data-field=\"{name}\"]'); return e ? e.textContent : null;")


IN_FLIGHT = """
const rows = [...document.querySelectorAll(
  '[data-provider="busy"] [data-field="requests"] [data-request]')];
const text = (r, f) => r.querySelector('[data-field="' + f + '"]').textContent;
return rows.length === arguments[0] && rows.map(r => ({
  id: r.dataset.request, state: r.dataset.state,
  cells: ["state", "model", "priority", "for", "id"].map(f => text(r, f))}));
"""

# Every element whose own text shows a time of day or an age: does it (or an ancestor)
# carry a title with a full date?
UNDATED = r"""
const clock = /(^|[^\d.:])\d{1,2}:\d{2}(:\d{2})?(?![\d.:])|\bago\b|just now/;
const undated = [];
let seen = 0;
for (const e of document.querySelectorAll('body *')) {
  if (e.closest('[hidden]') || ['SCRIPT', 'STYLE'].includes(e.tagName)) continue;
  const own = [...e.childNodes].filter(n => n.nodeType === 3).map(n => n.data).join('');
  if (!clock.test(own)) continue;
  seen += 1;
  const titled = e.closest('[title]');
  if (!titled || !/\b20\d\d\b/.test(titled.title))
    undated.push(e.tagName + ': ' + own);
}
return {undated, seen};
"""


async def ask(client: httpx.AsyncClient, url: str, model: str, n: int = 0,
              priority: str = "normal") -> httpx.Response:
    return await client.post(f"{url}/v1/chat/completions", json=chat(model, f"hi {n}"),
                             headers={"X-Relay-Priority": priority})


async def test_the_page_shows_requests_in_flight_honest_states_and_dates(
        tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        served = await start_relay(nursery, CONFIG, tmp_path)
        url, lane = served.url, served.relay.providers["busy"].lane
        async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
            async with trio.open_nursery() as senders:   # 100 answered, ten at a time
                for start in range(10):
                    async def send_ten(start: int = start) -> None:
                        for n in range(start * 10, start * 10 + 10):
                            assert (await ask(client, url, "fake/echo", n)).status_code == 200
                    senders.start_soon(send_ten)
            r = await ask(client, url, "gone/qwen3-8b")
            assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable"
            assert (await ask(client, url, "nope/x")).status_code == 404
            # One queued request whose client leaves after waiting about a second.
            async with trio.open_nursery() as holders:
                holders.start_soon(ask, client, url, "story", 0, "normal")
                await wait_for(lambda: lane.statistics().running == 1)
                with trio.move_on_after(1.5):
                    await ask(client, url, "busy/echo", 1)
                await wait_for(lambda: len(records(tmp_path)) == 103)
                left = records(tmp_path)[-1]
                assert left["status"] == 499 and left["queue_ms"] >= 1000
                # The queue the page must show: one running, two waiting.
                holders.start_soon(ask, client, url, "busy/echo?delay_s=60", 2,
                                   "background")
                await wait_for(lambda: lane.statistics().queued == 1)
                holders.start_soon(ask, client, url, "busy/echo?delay_s=61", 3,
                                   "interactive")
                await wait_for(lambda: lane.statistics().queued == 2)
                status = (await client.get(f"{url}/relay/v1/status")).json()
                ids = [q["id"] for q in status["providers"]["busy"]["requests"]]
                async with open_browser(tmp_path) as browser:
                    await browser.get(url + "/")
                    await check_in_flight(browser, ids)
                    await check_states(browser)
                    await check_recent(browser, tmp_path, left)
                    times = await browser.execute(UNDATED)
                    # The 50 rows of recent requests, "updated …", two "state from real requests".
                    assert times["undated"] == [] and times["seen"] >= 53, times
                    png = await browser.screenshot()
                    assert png.startswith(b"\x89PNG")
                    if os.environ.get("RELAY_SCREENSHOT"):   # a copy to look at
                        await trio.Path(os.environ["RELAY_SCREENSHOT"]).write_bytes(png)
                    holders.cancel_scope.cancel()
                    # They left: the page's list empties.
                    await browser.wait_for("const e = document.querySelector("
                                           "'[data-provider=\"busy\"] [data-field=\"requests\"]');"
                                           "return e && e.hidden;")
        nursery.cancel_scope.cancel()


async def check_in_flight(browser: Browser, ids: list[str]) -> None:
    rows = await browser.wait_for(IN_FLIGHT, 3)
    assert [row["id"] for row in rows] == ids
    assert [(row["state"], row["cells"][0], row["cells"][1], row["cells"][2])
            for row in rows] == [
        ("running", "running", "story → echo?delay_s=60", "normal"),
        ("queued", "queued", "echo?delay_s=61", "interactive"),
        ("queued", "queued", "echo?delay_s=60", "background")]
    running, waiting = rows[0]["cells"][3], rows[1]["cells"][3]
    assert running.startswith("running ") and running.endswith((" s", " ms")), running
    assert waiting.startswith("waiting "), waiting
    assert [row["cells"][4] for row in rows] == [row["id"] for row in rows]
    # How long so far grows as the page refreshes.
    await browser.wait_for(
        "const e = document.querySelector('[data-provider=\"busy\"] [data-state=\"running\"] "
        "[data-field=\"for\"]'); return e && e.textContent !== arguments[0];", running)


async def check_states(browser: Browser) -> None:
    # 100 answered requests, never checked: connected, and it says where that came from.
    assert await browser.wait_for(field("fake", "state")) == "connected"
    line = await browser.execute(field("fake", "checked"))
    assert line.startswith("never checked · state from real requests"), line
    assert "unverified" not in line
    # Its last real request found nothing listening: failing, with the reason and words.
    assert await browser.execute(field("gone", "state")) == "failing"
    assert await browser.execute(field("gone", "state-reason")) == "upstream_unavailable"
    warning = await browser.execute(field("gone", "warning"))
    assert "could not be reached" in warning, warning
    # Nothing answered or failed for real on busy yet: it stays unverified.
    assert await browser.execute(field("busy", "state")) == "unverified"


async def check_recent(browser: Browser, tmp_path: Path, left: dict[str, Any]) -> None:
    rows = await browser.wait_for(
        "const rows = [...document.querySelectorAll('#requests tbody tr')];"
        "return rows.length >= 50 && Object.fromEntries(rows.map(r => [r.dataset.request, "
        "[...r.cells].map(c => c.textContent)]));")
    refused = next(r for r in records(tmp_path) if r["reason"] == "unknown_model")
    assert rows[refused["id"]][2] == "nope/x"            # what was asked for
    assert rows[refused["id"]][4] == "unknown_model"
    # The request that left while queued shows how long it waited.
    assert rows[left["id"]][3] == "499"
    assert rows[left["id"]][5] == f"{left['queue_ms'] / 1000:.1f} s"

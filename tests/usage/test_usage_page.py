"""The status page's usage panel (SPEC O7), in a real headless Chromium against a live
relay: today's tokens and cost by client and by model, and tokens per hour over the last
24 hours, as the database holds them."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio
from helpers.assembled import FAKE_ONLY, chat, start_relay
from helpers.usage_records import generated, lines, write_lines
from helpers.webdriver import open_browser


async def test_the_page_shows_todays_usage_by_client_and_model_and_a_chart(
        tmp_path: Path, client: httpx.AsyncClient) -> None:
    path = tmp_path / "records.jsonl"
    write_lines(path, generated(40, days=1 / 1440))  # the last minute: today's
    async with trio.open_nursery() as nursery:
        served = await start_relay(nursery, FAKE_ONLY, tmp_path)
        for i in range(3):
            r = await client.post(f"{served.url}/v1/chat/completions",
                                  json=chat("fake/echo", f"hi {i}"))
            assert r.status_code == 200
        with trio.fail_after(10):   # in the database (read about once a second)
            while served.relay.usage is None or served.relay.usage.behind or (
                    served.relay.usage.rolled_up < 43):
                await trio.sleep(0.05)
        async with open_browser(tmp_path) as browser:
            await browser.get(served.url + "/")
            await browser.wait_for("return document.getElementById('usage')"
                                   ".dataset.refreshed;")
            cells = await browser.execute(
                "const row = document.querySelector('[data-field=usage-clients] "
                "tr[data-client=default]');"
                "return [...row.cells].map(c => c.textContent);")
            assert cells[:2] == ["default", "3"]
            assert cells[-1] == "—"   # the fake provider has no price
            models = await browser.execute(
                "return [...document.querySelectorAll('[data-field=usage-models] "
                "tbody tr')].map(r => r.dataset.model);")
            assert "fake/echo" in models and "openai/gpt-5" in models
            # The chart: 24 hours; the tokens of the last ones are the records'.
            bars = await browser.execute(
                "return [...document.querySelectorAll('[data-field=usage-chart] .bar')]"
                ".map(b => Number(b.dataset.tokens));")
            assert len(bars) == 24
            records = lines(path)
            tokens = sum((r["usage"] or {}).get("prompt_tokens", 0)
                         + (r["usage"] or {}).get("completion_tokens", 0) for r in records)
            assert sum(bars[-2:]) == tokens and bars[-1] > 0
            png = await browser.screenshot()
            await trio.Path(tmp_path / "usage.png").write_bytes(png)
        nursery.cancel_scope.cancel()

"""What a request cost (SPEC O7): the packaged price table, a provider's own prices over
it, cache reads and writes priced apart, unknown prices as null (never a guess), a CLI
tool's subscription as 0 — on every record, through the assembled relay."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from fakes.upstream import FakeUpstream, Script
from helpers.assembled import chat, config_from, records, start_relay, wait_for, with_upstream

from relay.engine.clients import price_for
from relay.vocab.prices import FREE, Price, cost_of, lookup, packaged


def test_the_packaged_table_has_the_three_vendors_current_models() -> None:
    table = packaged()
    for model in ("gpt-5", "gpt-4o-mini", "claude-sonnet-4-5", "claude-opus-4-5",
                  "claude-haiku-4-5", "gemini-2.5-pro", "gemini-2.5-flash"):
        price = table[model]
        assert price.input and price.output and price.cached_input is not None, model
    assert table["claude-sonnet-4-5"] == Price(input=3.0, cached_input=0.3,
                                               cache_write=3.75, output=15.0)


def test_lookup_is_exact_then_without_a_date_then_the_longest_prefix() -> None:
    table = {"gpt-4o": Price(input=1.0), "gpt-4o-mini": Price(input=2.0),
             "claude-sonnet-4": Price(input=3.0), "claude-sonnet-4-5": Price(input=4.0)}
    assert lookup(table, "gpt-4o-mini") == Price(input=2.0)
    assert lookup(table, "gpt-4o-mini-2024-07-18") == Price(input=2.0)
    assert lookup(table, "gpt-4o-2024-08-06") == Price(input=1.0)
    assert lookup(table, "claude-sonnet-4-5-20250929") == Price(input=4.0)
    assert lookup(table, "claude-sonnet-4-5-thinking") == Price(input=4.0)
    assert lookup(table, "claude-sonnet-4-20250514") == Price(input=3.0)
    # a prefix counts only at a boundary: gpt-4o is not gpt-4 priced, and no guess
    assert lookup({"gpt-4": Price(input=9.0)}, "gpt-4o") is None
    assert lookup(table, "qwen3-8b") is None


def test_cost_prices_reads_and_writes_apart_and_never_guesses() -> None:
    price = Price(input=3.0, cached_input=0.3, cache_write=3.75, output=15.0)
    usage = {"prompt_tokens": 10_000, "completion_tokens": 1_000,
             "cache_read_tokens": 6_000, "cache_write_tokens": 2_000}
    # 2,000 uncached at $3, 6,000 read at $0.30, 2,000 written at $3.75, 1,000 out at $15
    assert cost_of(usage, price) == round((2000 * 3 + 6000 * 0.3 + 2000 * 3.75
                                           + 1000 * 15) / 1e6, 6) == 0.0303
    assert cost_of({"prompt_tokens": 100, "completion_tokens": 0}, Price(input=3.0)) == 0.0003
    assert cost_of(usage, Price(input=3.0, output=15.0)) is None  # reads: no price known
    assert cost_of({"prompt_tokens": 1, "completion_tokens": 1}, None) is None
    assert cost_of(None, price) is None
    assert cost_of(usage, FREE) == 0.0


def test_a_cli_tool_costs_nothing_and_an_override_lays_over_the_packaged_price(
        tmp_path: Path) -> None:
    config = config_from("""
[providers.claude]
adapter = "claude-cli"
command = "/bin/true"
[providers.openai]
adapter = "openai"
base_url = "http://127.0.0.1:9/v1"
profile = { lanes = 1, queue_max = 1, queue_timeout_s = 1, run_timeout_s = 600 }
[providers.openai.prices."gpt-4o-mini"]
output = 1.0
""", tmp_path)
    assert price_for(config.providers["claude"], "claude-sonnet-4-5") == FREE
    assert price_for(config.providers["openai"], "gpt-4o-mini-2024-07-18") == Price(
        input=0.15, cached_input=0.075, cache_write=0.15, output=1.0)
    assert price_for(config.providers["openai"], "my-local-model") is None


@pytest.mark.parametrize("extra, expected", [
    # the packaged price: 600 uncached at $0.15, 400 cached at $0.075, 100 out at $0.60
    ("", round((600 * 0.15 + 400 * 0.075 + 100 * 0.60) / 1e6, 6)),
    # the provider's own, over it
    ('[providers.up.prices."gpt-4o-mini"]\ninput = 2.0\ncached_input = 1.0\noutput = 4.0\n',
     round((600 * 2.0 + 400 * 1.0 + 100 * 4.0) / 1e6, 6)),
])
async def test_each_record_carries_its_cost(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream,
        client: httpx.AsyncClient, extra: str, expected: float) -> None:
    upstream.scripts["gpt-4o-mini-2024-07-18"] = Script(usage={
        "prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100,
        "prompt_tokens_details": {"cached_tokens": 400}})
    upstream.scripts["m1"] = Script()
    config = with_upstream(upstream, extra=extra).replace(
        '"Qwen/Qwen3-8B"]', '"Qwen/Qwen3-8B", "gpt-4o-mini-2024-07-18"]')
    served = await start_relay(nursery, config, tmp_path)
    for model in ("up/gpt-4o-mini-2024-07-18", "up/m1", "fake/echo"):
        r = await client.post(served.url + "/v1/chat/completions", json=chat(model))
        assert r.status_code == 200, r.text
    await wait_for(lambda: len(records(tmp_path)) == 3)
    priced, unknown, fake = records(tmp_path)
    assert priced["usage"]["cache_read_tokens"] == 400
    assert priced["cost_usd"] == expected and priced["client"] == "default"
    assert unknown["cost_usd"] is None and unknown["usage"]["prompt_tokens"] == 3
    assert fake["cost_usd"] is None


async def test_a_fanouts_cost_is_its_branches_at_each_ones_price(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, """
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.fake.prices."echo"]
input = 1.0
output = 2.0
[providers.dear]
adapter = "fake"
models = ["echo"]
[providers.dear.prices."echo"]
input = 10.0
output = 20.0
""", tmp_path)
    r = await client.post(served.url + "/relay/v1/fanout", json={
        "models": ["fake/echo", "dear/echo"],
        "messages": [{"role": "user", "content": "one two three"}]})
    assert r.status_code == 200, r.text
    await wait_for(lambda: len(records(tmp_path)) == 1)
    record = records(tmp_path)[0]
    # each branch: 3 words in, 3 out
    assert record["usage"]["total_tokens"] == 12
    assert record["cost_usd"] == round((3 * 1 + 3 * 2 + 3 * 10 + 3 * 20) / 1e6, 6)

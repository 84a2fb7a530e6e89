"""``GET /metrics``: Prometheus text that parses, and numbers that match the status and the
records (issue 8)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import prometheus_client
import trio
from helpers.assembled import chat, records, start_relay, wait_for
from helpers.metrics import scrape, value
from prometheus_client.parser import text_string_to_metric_families

CONFIG = """
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.slow]
adapter = "fake"
models = ["echo"]
[providers.slow.profile]
lanes = 2
queue_max = 5
queue_timeout_s = 120
run_timeout_s = 120
"""
LANE_GAUGES = {"relay_lane_running": "running", "relay_lane_capacity": "capacity",
               "relay_lane_queued": "queued", "relay_lane_queue_max": "queue_max"}








async def hold(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
    await client.post(f"{url}/v1/chat/completions", json=body)  # the test cancels it


async def test_metrics_match_status_under_load_and_records_after(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        served = await start_relay(nursery, CONFIG, tmp_path)
        url = served.url
        lane = served.relay.providers["slow"].lane
        async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
            async with trio.open_nursery() as holders:
                for n in range(5):  # 2 running, 3 queued
                    holders.start_soon(hold, client, url, chat("slow/echo?delay_s=60", str(n)))
                await wait_for(lambda: (lane.statistics().running,
                                        lane.statistics().queued) == (2, 3))
                status = (await client.get(f"{url}/relay/v1/status")).json()["providers"]
                samples = await scrape(client, url)
                for name, provider in status.items():
                    for metric, key in LANE_GAUGES.items():
                        assert value(samples, metric, provider=name) == \
                            provider["lanes"][key], (metric, name)
                    assert value(samples, "relay_provider_state", provider=name,
                                 state=provider["state"]) == 1.0
                assert value(samples, "relay_lane_running", provider="slow") == 2
                assert value(samples, "relay_lane_queued", provider="slow") == 3
                assert value(samples, "relay_in_flight") == 5
                assert value(samples, "relay_draining") == 0
                holders.cancel_scope.cancel()  # the five clients leave
            await wait_for(lambda: len(records(tmp_path)) == 5)

            # Requests that end every way: answered, failed upstream, unknown model.
            for _ in range(3):
                assert (await client.post(f"{url}/v1/chat/completions",
                                          json=chat("fake/echo"))).status_code == 200
            r = await client.post(f"{url}/v1/chat/completions",
                                  json=chat("fake/echo?fail=upstream_error"))
            assert r.status_code == 502, r.text
            r = await client.post(f"{url}/v1/chat/completions", json=chat("nope/x"))
            assert r.status_code == 404
            r = await client.post(f"{url}/relay/v1/providers/fake/check")
            assert r.status_code == 200 and r.json()["outcome"] == "answered", r.text
            await wait_for(lambda: len(records(tmp_path)) == 11)
            samples = await scrape(client, url)

        written = records(tmp_path)
        requests = [r for r in written if r["route"] != "(check)"]
        by_label = Counter((r["provider"] or "none", str(r["status"]), r["reason"] or "ok")
                           for r in requests)
        assert by_label == {("slow", "499", "client_disconnected"): 5,
                            ("fake", "200", "ok"): 3, ("fake", "502", "upstream_error"): 1,
                            ("none", "404", "unknown_model"): 1}
        counted = {labels: v for (name, labels), v in samples.items()
                   if name == "relay_requests_total"}
        assert counted == {(("provider", p), ("reason", reason), ("status", s)): float(n)
                           for (p, s, reason), n in by_label.items()}
        assert value(samples, "relay_checks_total", provider="fake", reason="ok") == 1

        for provider in ("slow", "fake"):
            mine = [r for r in requests if r["provider"] == provider]
            queued = [r["queue_ms"] for r in mine if r["queue_ms"] is not None]
            ran = [r["run_ms"] for r in mine if r["run_ms"] is not None]
            assert value(samples, "relay_queue_seconds_count", provider=provider) == len(queued)
            total = value(samples, "relay_queue_seconds_sum", provider=provider)
            assert total is not None and abs(total - sum(queued) / 1000) < 1e-6
            assert value(samples, "relay_run_seconds_count", provider=provider) == len(ran)
        # Stops: all five were stopped; the two that held a lane have a release lag.
        assert value(samples, "relay_stops_total", provider="slow",
                     reason="client_disconnected") == 5
        held = [r for r in requests if r["provider"] == "slow" and r["released_at"]]
        assert len(held) == 2
        assert value(samples, "relay_stop_release_lag_seconds_count", provider="slow") == 2
        assert (value(samples, "relay_stop_release_lag_seconds_bucket", provider="slow",
                      le="1.0") == 2)  # released within a second of the stop
        assert value(samples, "relay_lane_running", provider="slow") == 0
        assert value(samples, "relay_lane_queued", provider="slow") == 0
        nursery.cancel_scope.cancel()


async def test_each_relay_has_its_own_registry(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    async with trio.open_nursery() as nursery:
        a = await start_relay(nursery, CONFIG, tmp_path / "a")
        b = await start_relay(nursery, CONFIG, tmp_path / "b")
        async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
            r = await client.post(f"{a.url}/v1/chat/completions", json=chat("fake/echo"))
            assert r.status_code == 200
            await wait_for(lambda: len(records(tmp_path / "a")) == 1)
            mine, theirs = await scrape(client, a.url), await scrape(client, b.url)
        ok = {"provider": "fake", "status": "200", "reason": "ok"}
        assert value(mine, "relay_requests_total", **ok) == 1
        assert value(theirs, "relay_requests_total", **ok) is None
        nursery.cancel_scope.cancel()
    # Nothing went into prometheus_client's process-wide default registry.
    assert prometheus_client.REGISTRY.get_sample_value("relay_lane_running",
                                                       {"provider": "fake"}) is None


def test_relay_counts_as_prometheus_client_would() -> None:
    """relay counts itself and hands the counts to prometheus_client at a scrape: the
    samples are the ones prometheus_client's own Counter and Histogram give for the same
    records (a value on a bucket's bound is in that bucket)."""
    from relay.front.metrics import QUEUE_BUCKETS, RUN_BUCKETS, Metrics
    from relay.vocab.records import Record

    class NoProviders:
        providers: dict[str, Any] = {}
        in_flight: tuple[()] = ()
        draining = False

    ours = Metrics(NoProviders())  # type: ignore[arg-type]
    theirs = prometheus_client.CollectorRegistry()
    requests = prometheus_client.Counter("relay_requests", "", ["provider", "status",
                                                                "reason"], registry=theirs)
    queue = prometheus_client.Histogram("relay_queue_seconds", "", ["provider"],
                                        buckets=QUEUE_BUCKETS, registry=theirs)
    run = prometheus_client.Histogram("relay_run_seconds", "", ["provider"],
                                      buckets=RUN_BUCKETS, registry=theirs)
    cases = [("a", 200, None, 5.0, 250.0), ("a", 200, None, 0.0, 0.25 * 1000),
             ("b", 502, "upstream_error", 100.0, 1200_000.0), ("a", 200, None, 7.5, 1e7)]
    for provider, status, reason, queue_ms, run_ms in cases:
        ours.observe(Record(id="r", started_at=0.0, endpoint="/v1/chat/completions",
                            status=status, reason=reason, provider=provider,
                            queue_ms=queue_ms, run_ms=run_ms))
        requests.labels(provider, str(status), reason or "ok").inc()
        queue.labels(provider).observe(queue_ms / 1000)
        run.labels(provider).observe(run_ms / 1000)

    def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if family.name in ("relay_requests", "relay_queue_seconds",
                                   "relay_run_seconds") and not s.name.endswith("_created")}

    expected = samples(prometheus_client.generate_latest(theirs).decode())
    assert samples(ours.render().decode()) == expected
    assert expected[("relay_queue_seconds_bucket", (("le", "0.005"), ("provider", "a")))] == 2

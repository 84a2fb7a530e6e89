"""Connection checks and provider state (SPEC H1-H4, L7), and the seed's incident."""

from __future__ import annotations

import functools
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from fakes.upstream import FakeUpstream, Script, error_body
from helpers.assembled import (
    ASGIResult,
    asgi_request,
    chat,
    config_from,
    lane_idle,
    records,
    start_relay,
    wait_for,
)

import relay
from relay import open_relay


def incident(lanes: int) -> str:
    # One slow provider: a check takes 1.5 s, the queue timeout is 0.3 s (seed 000).
    return f"""
[server]
records = "records.jsonl"
[providers.slow]
adapter = "fake"
models = ["echo"]
check_model = "echo?delay_s=1.5"
[providers.slow.profile]
lanes = {lanes}
queue_max = 8
queue_timeout_s = 0.3
run_timeout_s = 10
"""


async def test_the_seed_incident_one_lane(nursery: trio.Nursery, tmp_path: Path,
                                          client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, incident(1), tmp_path)
    provider = served.relay.providers["slow"]
    provider.state = "connected"   # verified earlier
    provider.models = ["echo"]
    result: dict[str, Any] = {}

    async def run_check() -> None:
        r = await client.post(f"{served.url}/relay/v1/providers/slow/check")
        result.update(r.json())

    nursery.start_soon(run_check)
    await wait_for(lambda: provider.lane.statistics().running == 1)
    for _ in range(3):   # test calls while the check holds the only lane
        r = await client.post(f"{served.url}/v1/chat/completions", json=chat("slow/echo"))
        assert r.status_code == 429
        err = r.json()["error"]
        assert err["code"] == "provider_queue_timeout" and err["relay"]["phase"] == "capacity"
        assert int(r.headers["retry-after"]) >= 1
        assert err["relay"]["retry_after_s"] >= 1
        message = err["message"]
        assert "1/1 running" in message and "connection checks included" in message
        assert "retry in about" in message.lower()
        for advice in ("run the check", "check again", "re-check", "check the connection"):
            assert advice not in message.lower()
        assert provider.state == "connected"     # busy is not broken
    await wait_for(lambda: "outcome" in result)
    assert result["ok"] is True and result["outcome"] == "answered"
    assert result["status"]["state"] == "connected"
    assert result["status"]["models"] == ["echo"]
    r = await client.post(f"{served.url}/v1/chat/completions", json=chat("slow/echo", "hi"))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi"
    await wait_for(lambda: len(records(tmp_path)) == 5)
    check = next(x for x in records(tmp_path) if x["route"] == "(check)")
    assert check["priority"] == "interactive" and check["status"] == 200


async def test_the_seed_incident_three_lanes_runs_side_by_side(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, incident(3), tmp_path)
    provider = served.relay.providers["slow"]
    done = trio.Event()

    async def run_check() -> None:
        r = await client.post(f"{served.url}/relay/v1/providers/slow/check")
        assert r.json()["outcome"] == "answered"
        done.set()

    nursery.start_soon(run_check)
    await wait_for(lambda: provider.lane.statistics().running == 1)
    for _ in range(3):
        r = await client.post(f"{served.url}/v1/chat/completions", json=chat("slow/echo"))
        assert r.status_code == 200
    assert not done.is_set()     # the calls ran beside the check
    with trio.fail_after(5):
        await done.wait()
    assert provider.state == "connected" and lane_idle(served)


CHECKS = """
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.fake.profile]
lanes = 1
queue_max = 4
queue_timeout_s = 100
run_timeout_s = 20
"""


async def check(r: relay.Relay, name: str) -> dict[str, Any]:
    res = ASGIResult()
    await asgi_request(r.app, f"/relay/v1/providers/{name}/check", b"", res)
    assert res.status == 200, res.text()
    body: dict[str, Any] = res.json()
    return body


async def test_a_check_waits_first_in_line_but_never_stops_running_work(
        nursery: trio.Nursery, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    text = CHECKS.replace('models = ["echo"]', 'models = ["echo"]\ncheck_model = "echo?delay_s=5"')
    async with open_relay(config_from(text, tmp_path), discover=False) as r:
        running = ASGIResult()
        nursery.start_soon(asgi_request, r.app, "/v1/chat/completions",
                           chat("fake/echo?delay_s=10"), running)
        await trio.testing.wait_all_tasks_blocked()
        queued = ASGIResult()
        nursery.start_soon(asgi_request, r.app, "/v1/chat/completions", chat("fake/echo"),
                           queued)
        await trio.testing.wait_all_tasks_blocked()
        result = await check(r, "fake")       # queued after the normal request ...
        await queued.done.wait()
        assert running.status == 200          # ... never stopping the running one ...
        assert result["outcome"] == "answered"
        by_route = {rec["route"]: rec for rec in r.records.recent}
        normal = next(rec for rec in r.records.recent if rec["route"] is None
                      and rec["queue_ms"] and rec["queue_ms"] > 0)
        # ... but first in line: it ran 10 s to 15 s, the normal one waited until 15 s.
        assert by_route["(check)"]["queue_ms"] == pytest.approx(10_000)
        assert normal["queue_ms"] == pytest.approx(15_000)


async def test_a_check_that_fails_for_capacity_changes_nothing(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    text = CHECKS.replace("queue_timeout_s = 100", "queue_timeout_s = 5")
    async with open_relay(config_from(text, tmp_path), discover=False) as r:
        provider = r.providers["fake"]
        assert provider.state == "unverified"
        assert (await check(r, "fake"))["status"]["state"] == "connected"
        checked_at = provider.checked_at
        hold = ASGIResult()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(asgi_request, r.app, "/v1/chat/completions",
                               chat("fake/echo?delay_s=15"), hold)
            await trio.testing.wait_all_tasks_blocked()
            busy = await check(r, "fake")   # waits 5 s in the queue, then times out
            assert busy["outcome"] == "busy" and busy["reason"] == "provider_queue_timeout"
            assert busy["status"]["state"] == "connected"
            assert busy["status"]["models"] == ["echo"]
            assert provider.checked_at == checked_at
            hold.disconnect.set()


@pytest.mark.parametrize(("fail", "state", "warned"), [
    ("quota_exhausted", "connected", True),     # H3: a quota notice is a warning
    ("rate_limited", "connected", True),
    ("auth_required", "failing", True),
    ("upstream_unavailable", "failing", True),
    ("run_timeout", "unverified", True),        # slow is not broken: state unchanged
])
async def test_what_each_outcome_does_to_the_state(
        tmp_path: Path, autojump_clock: trio.abc.Clock, fail: str, state: str,
        warned: bool) -> None:
    text = CHECKS.replace('models = ["echo"]', f'models = ["echo"]\ncheck_model = '
                          f'"echo?fail={fail}"')
    async with open_relay(config_from(text, tmp_path), discover=False) as r:
        body = await check(r, "fake")
        assert body["status"]["state"] == state
        assert (body["status"]["warning"] is not None) == warned
        assert body["status"]["models"] == ["echo"]          # models are kept
        if state == "failing":
            assert body["status"]["state_reason"] == fail and body["ok"] is False


async def test_an_auth_failure_through_the_wire_says_how_to_log_in(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    upstream.scripts["m1"] = Script(status=401, error_body=error_body(401, "bad key"))
    text = f"""
[server]
records = "records.jsonl"
[providers.up]
adapter = "openai"
base_url = "{upstream.url}"
api_key_env = "RELAY_TEST_UP_KEY"
models = ["m1"]
[providers.up.profile]
lanes = 1
queue_max = 1
queue_timeout_s = 5
run_timeout_s = 5
"""
    import os
    os.environ["RELAY_TEST_UP_KEY"] = "wrong"
    try:
        served = await start_relay(nursery, text, tmp_path)
    finally:
        del os.environ["RELAY_TEST_UP_KEY"]
    r = await client.post(f"{served.url}/relay/v1/providers/up/check")
    body = r.json()
    assert body["outcome"] == "failed" and body["reason"] == "auth_required"
    status = body["status"]
    assert status["state"] == "failing" and status["state_reason"] == "auth_required"
    assert "RELAY_TEST_UP_KEY" in status["warning"]   # the action: which key to fix
    # The key never reaches a record or the status.
    await wait_for(lambda: len(records(tmp_path)) == 1)
    assert "wrong" not in (tmp_path / "records.jsonl").read_text()


async def test_an_unreachable_server_is_failing(nursery: trio.Nursery, tmp_path: Path,
                                                client: httpx.AsyncClient) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    text = f"""
[providers.down]
adapter = "openai"
base_url = "http://127.0.0.1:{port}/v1"
[providers.down.profile]
lanes = 1
queue_max = 1
queue_timeout_s = 5
run_timeout_s = 5
"""
    served = await start_relay(nursery, text, tmp_path)
    body = (await client.post(f"{served.url}/relay/v1/providers/down/check")).json()
    assert body["status"]["state"] == "failing"
    assert body["status"]["state_reason"] == "upstream_unavailable"
    r = await client.post(f"{served.url}/relay/v1/providers/nope/check")
    assert r.status_code == 404 and r.json()["error"]["code"] == "invalid_request"


async def test_interval_checks_skip_busy_lanes(nursery: trio.Nursery, tmp_path: Path,
                                               autojump_clock: trio.abc.Clock) -> None:
    text = CHECKS.replace('models = ["echo"]', 'models = ["echo"]\ncheck_interval_s = 10')
    async with open_relay(config_from(text, tmp_path), discover=False) as r:
        fake: Any = r.providers["fake"].adapter
        await trio.sleep(35)                     # checks at 0, 10, 20, 30
        assert fake.started == 4
        assert r.providers["fake"].state == "connected"
        hold = ASGIResult()
        nursery.start_soon(asgi_request, r.app, "/v1/chat/completions",
                           chat("fake/echo?delay_s=15"), hold)
        await trio.sleep(10)                     # the lane is busy at 40: skipped
        assert fake.started == 5
        await hold.done.wait()


async def test_start_up_checks(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    text = CHECKS.replace("[server]", "[server]\ncheck_on_start = true")
    async with open_relay(config_from(text, tmp_path), discover=False) as r:
        await trio.sleep(1)
        assert r.providers["fake"].state == "connected"
        await trio.sleep(100)
        assert r.providers["fake"].adapter.started == 1  # type: ignore[attr-defined]


async def test_check_from_the_command_line_helper(nursery: trio.Nursery, tmp_path: Path) -> None:
    # `relay check` is a blocking client: run it in a thread against a live relay.
    from relay.assembly.cli import main

    text = CHECKS.replace('models = ["echo"]', 'models = ["echo"]') + """
[providers.broken]
adapter = "fake"
models = ["echo"]
check_model = "echo?fail=auth_required"
"""
    served = await start_relay(nursery, text, tmp_path)
    code = await trio.to_thread.run_sync(functools.partial(
        main, ["check", "fake", "--url", served.url]))
    assert code == 0
    code = await trio.to_thread.run_sync(functools.partial(
        main, ["check", "--url", served.url]))
    assert code == 1      # one provider failed
    assert served.relay.providers["broken"].state == "failing"


class _StepCounter(trio.abc.Instrument):
    """Counts the steps of relay's check loop; stops the test if it spins."""

    def __init__(self, scope: trio.CancelScope, limit: int) -> None:
        self.scope, self.limit, self.steps = scope, limit, 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith("serve_checks"):
            self.steps += 1
            if self.steps > self.limit:
                self.scope.cancel()   # spinning: virtual time would never move again


async def test_a_check_slower_than_its_interval_does_not_spin_the_loop(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    # The loop skipped a provider whose check was still running but left its due time in
    # the past, so it woke at once, forever (54,907 iterations a second, 100 % CPU; on
    # virtual time the clock never moved again).
    text = CHECKS.replace('models = ["echo"]', 'models = ["echo"]\ncheck_interval_s = 1\n'
                          'check_model = "echo?delay_s=5"')
    with trio.CancelScope() as test_scope:
        counter = _StepCounter(test_scope, limit=5000)
        trio.lowlevel.add_instrument(counter)
        try:
            async with open_relay(config_from(text, tmp_path), discover=False) as r:
                fake: Any = r.providers["fake"].adapter
                await trio.sleep(57.5)
        finally:
            trio.lowlevel.remove_instrument(counter)
    assert not test_scope.cancelled_caught, f"the check loop spun: {counter.steps} steps"
    assert counter.steps < 100
    # A check at 0 (it takes 5 s), then each one 1 s after the last one ended.
    assert fake.started == 10
    answered = [rec for rec in r.records.recent
                if rec["route"] == "(check)" and rec["status"] == 200]
    assert len(answered) == 9                 # the tenth was still running at the end


async def test_no_check_starts_while_relay_drains(
        nursery: trio.Nursery, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    # The interval checks went on during a drain; one started after the drain had
    # stopped what it tracked ran unstopped, and the drain waited for it.
    text = CHECKS.replace("lanes = 1", "lanes = 2").replace(
        'models = ["echo"]', 'models = ["echo"]\ncheck_interval_s = 2\n'
        'check_model = "echo?delay_s=1"')
    async with open_relay(config_from(text, tmp_path), discover=False) as r:
        fake: Any = r.providers["fake"].adapter
        long = ASGIResult()          # its stop takes 4 s (a tool slow to confirm it)
        nursery.start_soon(asgi_request, r.app, "/v1/chat/completions",
                           chat("fake/echo?delay_s=100&ignore_stop_s=4"), long)
        await trio.sleep(0.5)        # the check at 0 and the long request run
        t0 = trio.current_time()
        await r.drain(2.0)           # grace 2 s, then stopped; its stop ends at 6.5
        assert trio.current_time() - t0 == pytest.approx(6.0)
        await long.done.wait()
        assert long.status == 503
        assert fake.started == 2     # the first check and the long request, nothing else
        checks = [rec for rec in r.records.recent if rec["route"] == "(check)"]
        assert [rec["status"] for rec in checks] == [200]
        # Asked for while draining: not run, and busy is not broken.
        result = await check(r, "fake")
        assert result["outcome"] == "busy" and result["reason"] == "shutting_down"
        assert result["status"]["state"] == "connected" and fake.started == 2
        assert r.records.recent[-1]["reason"] == "shutting_down"


async def test_a_check_cancelled_from_outside_is_not_recorded_as_answered(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    text = CHECKS.replace('models = ["echo"]', 'models = ["echo"]\ncheck_model = '
                          '"echo?delay_s=10"')
    async with open_relay(config_from(text, tmp_path), discover=False) as r:
        with trio.move_on_after(1):
            await check(r, "fake")
        await trio.testing.wait_all_tasks_blocked()
        rec = r.records.recent[-1]
        assert rec["route"] == "(check)"
        assert (rec["status"], rec["reason"]) == (503, "shutting_down")  # it said 200
        assert rec["stop_requested_at"] is not None and rec["released_at"] is not None


async def test_checks_started_in_the_same_millisecond_get_their_own_records(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    text = CHECKS.replace("lanes = 1", "lanes = 2")
    async with open_relay(config_from(text, tmp_path), discover=False) as r:
        results: list[dict[str, Any]] = []

        async def one() -> None:
            results.append(await check(r, "fake"))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
        assert [x["outcome"] for x in results] == ["answered"] * 3
        ids = [rec["id"] for rec in records(tmp_path) if rec["route"] == "(check)"]
        assert len(ids) == 3 and len(set(ids)) == 3, ids   # were all "check-fake-0"

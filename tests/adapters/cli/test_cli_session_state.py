"""The warm-process protocol (`adapters._session`): its table on its own, and what it
drives through the assembled relay with the fake tools.

The table tests need no event loop. The assembled tests stop a request while relay is
in the middle of writing a prompt over 64 KiB (the fake tool stops reading its stdin,
so the write blocks once the pipe is full) and then check that the process is never
handed to the next request, which must be answered promptly by a fresh process.
"""

from __future__ import annotations

import gc
import itertools
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers.assembled import chat, lane_idle, records, sse_events, wait_for
from helpers.cli_procs import open_cli_relay, tool_processes
from helpers.cli_turns import answer, config, fake_log, iso, post
from helpers.raw_http import close, raw_post

import relay  # noqa: F401  (imports the adapters through the registry, in order)
from relay.adapters.cli.base import MAX_ANSWER_BYTES, Outcome, Streamer, TextBuffer, Warm, WarmPool
from relay.adapters.cli.process import ToolProcess, spawn_tool
from relay.adapters.cli.session import KEEPABLE, TRANSITIONS, Event, ProtocolError, State, Wire
from relay.vocab.errors import RelayError
from relay.vocab.events import Delta

# --- the table on its own ----------------------------------------------------------------


def walk(wire: Wire, *events: Event, reply_id: int | None = None) -> list[State]:
    return [wire.handle(e, reply_id=reply_id if e.name.startswith("SEND") else None)
            for e in events]


def test_a_codex_request_goes_round_to_idle() -> None:
    wire = Wire()
    walk(wire, Event.SEND_CALL, reply_id=1)           # thread/start
    assert wire.state is State.WRITING and wire.pending is None   # not yet written
    wire.handle(Event.WRITTEN)
    assert (wire.state, wire.pending) == (State.AWAITING_REPLY, 1)
    wire.handle(Event.REPLY)
    assert (wire.state, wire.pending) == (State.IDLE, None)
    wire.handle(Event.SEND_TURN, reply_id=2)          # turn/start
    wire.handle(Event.WRITTEN)
    assert (wire.state, wire.pending) == (State.IN_TURN, 2)
    wire.handle(Event.REPLY)                          # turn/start's reply: the turn's id
    assert (wire.state, wire.pending) == (State.IN_TURN, None)
    wire.handle(Event.SEND_ANSWER)                    # refusing an approval
    wire.handle(Event.WRITTEN)
    assert wire.state is State.IN_TURN
    wire.handle(Event.TURN_END)
    assert wire.state is State.IDLE and wire.ready and wire.keepable


def test_an_interrupt_keeps_a_notification_turn_pending() -> None:
    # gemini: session/cancel is a notification; the prompt's reply stays due.
    wire = Wire()
    walk(wire, Event.SEND_TURN, Event.WRITTEN, reply_id=7)
    walk(wire, Event.SEND_INTERRUPT, Event.WRITTEN)
    assert (wire.state, wire.pending) == (State.INTERRUPTING, 7)
    wire.handle(Event.TURN_END)
    assert (wire.state, wire.pending) == (State.IDLE, None)


def test_claude_clearing_is_keepable_but_not_ready() -> None:
    wire = Wire()
    walk(wire, Event.SEND_TURN, Event.WRITTEN, Event.TURN_END, Event.SEND_CLEAR,
         Event.WRITTEN)
    assert wire.state is State.CLEARING and wire.keepable and not wire.ready
    wire.handle(Event.CLEARED)
    assert wire.ready


@pytest.mark.parametrize("state", [State.IDLE, State.AWAITING_REPLY, State.IN_TURN,
                                   State.INTERRUPTING, State.CLEARING])
def test_a_cut_write_is_out_of_sync_from_any_state(state: State) -> None:
    wire = Wire()
    wire.state = state
    wire.pending = 3 if state in (State.AWAITING_REPLY, State.IN_TURN) else None
    send = next(e for (s, e), to in TRANSITIONS.items() if s is state and to is State.WRITING
                ) if state is not State.CLEARING else None
    if send is not None:
        wire.handle(send)
        assert not wire.in_sync and not wire.keepable   # mid-write: never reusable
    wire.handle(Event.CUT)
    assert wire.state is State.OUT_OF_SYNC and wire.pending is None
    assert not (wire.in_sync or wire.keepable or wire.ready)
    with pytest.raises(ProtocolError):   # nothing but the end from here
        wire.handle(Event.SEND_CALL)
    wire.handle(Event.CLOSE)
    assert wire.state is State.CLOSED


def test_every_state_and_event_pair_is_decided_by_the_table() -> None:
    # The table is the whole truth: a pair it lists moves there, any other raises and
    # leaves the wire out of sync (or closed) — never reusable.
    for state, event in itertools.product(State, Event):
        wire = Wire()
        wire.state = state
        wire.pending = 1
        if state is State.WRITING:
            wire._after = State.IN_TURN   # as a SEND_TURN would have set it
        expected = TRANSITIONS.get((state, event))
        if state is State.WRITING and event is Event.WRITTEN:
            expected = State.IN_TURN
        if expected is None:
            with pytest.raises(ProtocolError):
                wire.handle(event)
            assert wire.state in (State.OUT_OF_SYNC, State.CLOSED), (state, event)
        else:
            assert wire.handle(event) is expected, (state, event)
    assert frozenset({State.IDLE, State.CLEARING}) == KEEPABLE


def test_a_reply_nobody_waits_for_is_illegal() -> None:
    wire = Wire()
    walk(wire, Event.SEND_TURN, Event.WRITTEN)        # claude: a turn has no reply id
    with pytest.raises(ProtocolError, match="no request is waiting"):
        wire.handle(Event.REPLY)
    assert wire.state is State.OUT_OF_SYNC


async def test_send_marks_a_cancelled_write_as_a_cut() -> None:
    wire = Wire()
    started = trio.Event()

    async def blocked_write() -> None:
        started.set()
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wire.send, Event.SEND_TURN, blocked_write)
        await started.wait()
        assert wire.state is State.WRITING
        nursery.cancel_scope.cancel()
    assert wire.state is State.OUT_OF_SYNC


async def test_send_with_a_stop_already_due_writes_nothing_and_stays_in_sync() -> None:
    wire = Wire()
    wrote = []

    async def write() -> None:
        wrote.append(1)

    with trio.CancelScope() as scope:
        scope.cancel()
        await wire.send(Event.SEND_CALL, write, reply_id=1)
    assert wrote == [] and wire.state is State.IDLE and wire.ready


async def test_receive_a_cancelled_read_changes_nothing_a_failed_one_is_a_cut() -> None:
    wire = Wire()
    walk(wire, Event.SEND_TURN, Event.WRITTEN)

    with trio.move_on_after(0.01):
        await wire.receive(trio.sleep_forever)
    assert wire.state is State.IN_TURN            # reads are lossless when cancelled

    async def end() -> None:
        return None

    assert await wire.receive(end) is None
    assert wire.state is State.CLOSED             # the output ended

    wire = Wire()
    walk(wire, Event.SEND_TURN, Event.WRITTEN)

    async def fail() -> None:
        raise ValueError("a line too long to frame")

    with pytest.raises(ValueError):
        await wire.receive(fail)
    assert wire.state is State.OUT_OF_SYNC


# --- through the assembled relay ------------------------------------------------------------

BIG = 256 * 1024   # characters: four times the pipe's buffer


@pytest.mark.parametrize("provider", ["codex-s", "gemini-s", "claude-s"])
async def test_a_stop_mid_write_never_hands_the_process_on(tmp_path: Path,
                                                           provider: str) -> None:
    # Regression: a stop that landed while relay was writing a prompt over 64 KiB left
    # half a JSON line in the warm process's stdin; its interrupt saw nothing pending,
    # "confirmed", and the next request's first line was glued onto that half and never
    # answered (504 after the whole budget). claude's interrupt was glued on too, and
    # waited out the whole grace period before the kill.
    text = config(tmp_path, ', FAKE_CLI_STDIN_STALL_S = "30"', grace=5.0)
    async with open_cli_relay(text, tmp_path) as served, httpx.AsyncClient(
            trust_env=False, timeout=httpx.Timeout(20.0)) as client:
        pool = served.relay.providers[provider].adapter.pool  # type: ignore[attr-defined]
        stream = await raw_post(served.url, chat(f"{provider}/ok", "x" * BIG, stream=True))
        # The tool stopped reading in the middle of the prompt's line: relay's write is
        # blocked (the rest does not fit in the pipe).
        await wait_for(lambda: any(e.get("event") == "stdin-stall"
                                   for e in fake_log(tmp_path)), limit_s=10)
        [first] = [w.tool.pid for w in pool.busy]
        await close(stream, "fin")
        await wait_for(lambda: lane_idle(served) and len(records(tmp_path)) == 1,
                       limit_s=10)
        rec = records(tmp_path)[0]
        assert rec["status"] == 499
        took = iso(rec["released_at"]) - iso(rec["stop_requested_at"])
        print(f"\n{provider}: stop mid-write → closed, lane released in "
              f"{took * 1000:.0f} ms (grace 5000 ms)")
        assert took < 2.0, took        # out of sync: SIGINT, no wait for a confirmation
        with trio.fail_after(10):      # promptly, on a fresh process
            reply = await post(client, served, chat(f"{provider}/ok"))
        tool = provider.partition("-")[0]
        assert answer(reply) == f"Hello from the fake {tool} (FAKE-{tool.upper()}-OK)."
        assert pool.started == 2
        assert first not in [w.tool.pid for w in pool.idle]
        assert first not in [pid for pid, _ in tool_processes(str(tmp_path))]
        assert not any(e.get("event") == "bad-line" for e in fake_log(tmp_path))


# --- the pool ------------------------------------------------------------------------------

async def _process(tmp_path: Path, *argv: str) -> ToolProcess:
    return await spawn_tool(list(argv), env=dict(os.environ), cwd=tmp_path, provider="p",
                            install_hint="")


async def test_two_takes_with_two_dead_idle_processes(tmp_path: Path) -> None:
    # Regression: each take listed the dead idle processes, then removed them one by one
    # with an await (their aclose) in between; the second take removed one the first
    # still meant to remove, and `list.remove` raised (a 500 for a request).
    pool: WarmPool[Warm] = WarmPool(2)
    for _ in range(2):
        dead = await _process(tmp_path, "true")
        await dead.wait_exit()
        pool.idle.append(Warm(dead))

    async def start() -> Warm:
        return Warm(await _process(tmp_path, "sleep", "30"))

    got: list[Warm] = []

    async def take() -> None:
        got.append(await pool.take(None, start))

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(take)
            nursery.start_soon(take)
        assert len(got) == 2 and pool.started == 2 and pool.idle == []
    finally:
        for warm in got:
            pool.give_back(warm, keep=False)
            await warm.tool.aclose()


async def test_concurrent_starts_never_exceed_the_pool_size(tmp_path: Path) -> None:
    # Regression: a process being started was counted nowhere, so a second take for
    # another key saw room and started one more: three processes in a pool of two.
    pool: WarmPool[Warm] = WarmPool(2)
    other = Warm(await _process(tmp_path, "sleep", "30"), key="A")
    pool.idle.append(other)
    peak = 0

    async def start() -> Warm:
        warm = Warm(await _process(tmp_path, "sleep", "30"), key="B")
        await trio.sleep(0.05)   # a tool takes a while to start (initialize …)
        return warm

    got: list[Warm] = []

    async def take() -> None:
        nonlocal peak
        got.append(await pool.take("B", start))
        peak = max(peak, len([w for w in [other, *got] if w.tool.alive]))

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(take)
            nursery.start_soon(take)
        assert peak <= 2 and not other.tool.alive   # the idle one of key A was retired
        assert pool.total == 2
    finally:
        for warm in [other, *got]:
            await warm.tool.aclose()


async def test_a_process_handed_back_after_the_pool_closed_is_not_kept(
        tmp_path: Path) -> None:
    # Regression: at shutdown, a process that was being started while the pool closed
    # (so the pool's close did not see it) was handed back into the idle list when its
    # request ended — where nobody would ever close it.
    pool: WarmPool[Warm] = WarmPool(2)
    go = trio.Event()
    taken: list[Warm] = []

    async def start() -> Warm:
        warm = Warm(await _process(tmp_path, "sleep", "30"))
        taken.append(warm)
        await go.wait()    # initialize … still under way
        return warm

    async def request() -> None:
        warm = await pool.take(None, start)
        assert pool.give_back(warm, keep=True) is False

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(request)
            await wait_for(lambda: bool(taken))
            await pool.aclose()
            go.set()
        assert pool.idle == []
    finally:
        for warm in taken:
            await warm.aclose()


# --- the answer's size and the work it costs ---------------------------------------------

class ListSink:
    def __init__(self) -> None:
        self.events: list[Any] = []

    async def send(self, event: Any) -> None:
        self.events.append(event)


async def test_accumulating_deltas_is_linear() -> None:
    # Regression: `seen += text` per delta copied the whole answer each time: 1.25 MiB in
    # 8-character deltas took 32 s of CPU on the event loop. Eight times the deltas must
    # cost about eight times the CPU (a copy per delta costs 64 times): measured against
    # itself, as a machine's speed varies (CI's ran the line reader 3 times slower).
    async def cpu_of(n: int) -> float:
        sink = ListSink()
        streamer = Streamer(sink, provider="p")
        gc.collect()
        gc.disable()   # the collector's passes over the growing list are not the copy
        try:
            t0 = time.process_time()
            for _ in range(n):
                await streamer.delta("abcdefgh")
            await streamer.finish(Outcome(streamer.seen), "p")
            cpu = time.process_time() - t0
        finally:
            gc.enable()
        print(f"\n{n} deltas of 8 characters: {cpu * 1000:.0f} ms of CPU")
        text = "".join(e.content for e in sink.events if isinstance(e, Delta))
        assert len(text) == n * 8 and text == streamer.seen
        return cpu

    n = (1 << 20) * 5 // 4 // 8
    few = await cpu_of(n // 8)
    many = await cpu_of(n)
    assert many < 24 * few, (many, few)


async def test_held_back_text_is_sent_whole_once_past_the_hold() -> None:
    sink = ListSink()
    streamer = Streamer(sink, provider="p", hold=10)
    for piece in ("abc", "defg", "hij", "k", "lm"):
        await streamer.delta(piece)
    assert [e.content for e in sink.events] == ["abcdefghijk", "lm"]
    assert streamer.sent == 13 and streamer.seen == "abcdefghijklm"


def test_the_answer_is_bounded_in_bytes() -> None:
    buffer = TextBuffer("p", limit=10)
    buffer.append("aaaaaaaa")
    with pytest.raises(RelayError) as caught:
        buffer.append("é")          # 2 bytes of UTF-8: 10 in all, still allowed
        buffer.append("z")
    assert caught.value.reason == "bad_upstream_response"
    assert buffer.text == "aaaaaaaaé" and buffer.size == 10
    assert MAX_ANSWER_BYTES == 32 * 1024 * 1024


@pytest.mark.parametrize("provider", ["codex", "codex-s", "gemini", "gemini-s",
                                      "claude", "claude-s"])
async def test_an_answer_over_32_mib_is_a_bad_upstream_response(
        tmp_path: Path, provider: str) -> None:
    async with open_cli_relay(config(tmp_path), tmp_path) as served, httpx.AsyncClient(
            trust_env=False, timeout=httpx.Timeout(60.0)) as client:
        resp = await post(client, served, chat(f"{provider}/huge"))
        assert resp.status_code == 502, resp.text[:300]
        error = resp.json()["error"]
        assert error["code"] == "bad_upstream_response", error
        # One of the two bounds (SPEC O5): the answer's 32 MiB, or — where the tool prints
        # the whole answer on one line, as codex exec does in its final item — the 8 MiB
        # bound on one line of a tool's output, which is met first.
        assert ("larger than 33554432 bytes" in error["message"]
                or "longer than 8 MiB" in error["message"]), error["message"]
    # (open_cli_relay: the tool's turn was stopped and no process of it is left)


@pytest.mark.parametrize("provider", ["codex-s", "gemini-s"])
async def test_a_reply_without_the_id_it_must_carry_is_a_bad_upstream_response(
        tmp_path: Path, provider: str) -> None:
    # Regression: `reply["result"]["thread"]["id"]` (codex) and `["sessionId"]` (gemini)
    # raised KeyError on a reply without them: a 500 internal_error, not the tool's fault
    # named as such (and not one a route falls back on).
    async with open_cli_relay(config(tmp_path), tmp_path) as served, httpx.AsyncClient(
            trust_env=False, timeout=httpx.Timeout(20.0)) as client:
        resp = await post(client, served, chat(f"{provider}/badreply"))
        assert resp.status_code == 502, resp.text
        assert resp.json()["error"]["code"] == "bad_upstream_response"
        pool = served.relay.providers[provider].adapter.pool  # type: ignore[attr-defined]
        # the process is still in step (the reply was read whole): it is kept, and codex
        # (whose model is per thread) serves the next request on it
        assert len(pool.idle) == 1
        assert answer(await post(client, served, chat(f"{provider}/ok"))).startswith("Hello")
        assert pool.started == (1 if provider == "codex-s" else 2)


# What the fake's "flaky" scenario answers once it does (its LONG_USAGE: over the E2 fence).
LONG_USAGE = ("Here is how a usage limit works in most APIs. " * 20 +
              "When you hit the usage limit, requests are refused until the window resets.")


async def test_a_retry_on_a_fresh_process_starts_from_an_empty_answer(
        tmp_path: Path) -> None:
    # Regression: a warm claude process that died with its first deltas held back (the
    # E2 fence) was replaced and the turn retried — with the same streamer, so the dead
    # process's deltas were sent ahead of the new answer.
    async with open_cli_relay(config(tmp_path), tmp_path) as served, httpx.AsyncClient(
            trust_env=False, timeout=httpx.Timeout(20.0)) as client:
        for stream in (False, True):
            (tmp_path / "fake-cli.jsonl.flaky").unlink(missing_ok=True)
            resp = await post(client, served, chat("claude-s/flaky", stream=stream))
            assert resp.status_code == 200, resp.text
            if stream:
                text = "".join(e["choices"][0]["delta"].get("content") or ""
                               for e in sse_events(resp.text)[:-1] if e["choices"])
            else:
                text = answer(resp)
            assert text == LONG_USAGE
        assert served.relay.providers["claude-s"].adapter.pool.started == 3  # type: ignore[attr-defined]


# --- the one-shot process's end -------------------------------------------------------------

async def test_a_tool_killed_for_lingering_after_its_final_event_is_not_an_error(
        tmp_path: Path) -> None:
    # Regression: a tool still running REAP_S after its final event was killed by relay,
    # and then its exit status (-9, relay's own kill) was read as an error the tool
    # signalled at the end: the answer was marked recovered (SPEC E3).
    async with open_cli_relay(config(tmp_path), tmp_path) as served, httpx.AsyncClient(
            trust_env=False, timeout=httpx.Timeout(20.0)) as client:
        assert answer(await post(client, served, chat("codex/linger"))).startswith("Hello")
    rec = records(tmp_path)[0]
    assert rec["status"] == 200 and rec["recovered"] is False


async def test_an_empty_completed_run_that_exits_in_error_keeps_its_words(
        tmp_path: Path) -> None:
    # Regression: the exit status was read after the process was closed, when its stderr
    # file was closed too: the failure came without the tool's own words.
    async with open_cli_relay(config(tmp_path), tmp_path) as served, httpx.AsyncClient(
            trust_env=False, timeout=httpx.Timeout(20.0)) as client:
        resp = await post(client, served, chat("codex/emptyexit"))
        assert resp.status_code == 502, resp.text
        error = resp.json()["error"]
        assert error["code"] == "bad_upstream_response"
        assert "exited with status 1" in error["relay"]["upstream_message"]
        assert "FAKE-EMPTY-EXIT" in error["relay"]["upstream_message"]

"""Lanes on virtual time: queue full, queue timeout, priorities, pacer, the grant race."""

from __future__ import annotations

import functools

import pytest
import trio
import trio.lowlevel
import trio.testing

from relay.capacity.lanes import Lane
from relay.vocab.errors import RelayError
from relay.vocab.profile import Profile


def lane(lanes: int = 1, queue_max: int = 8, queue_timeout_s: float = 30.0,
         rpm: float = 0.0) -> Lane:
    return Lane("p", Profile(lanes=lanes, queue_max=queue_max, queue_timeout_s=queue_timeout_s,
                             run_timeout_s=60.0, rpm=rpm))


async def hold(ln: Lane, release: trio.Event, *, priority: str = "normal",
               task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    async with ln.slot(priority):
        task_status.started()
        await release.wait()


async def test_free_slot_is_taken_at_once(autojump_clock: trio.abc.Clock) -> None:
    ln = lane(lanes=2)
    async with ln.slot() as ticket:
        assert ln.statistics().running == 1
        assert ticket.queue_s == 0
    stats = ln.statistics()
    assert (stats.running, stats.queued) == (0, 0)
    assert ticket.released_at is not None


async def test_queue_full_is_refused_at_once(nursery: trio.Nursery,
                                             autojump_clock: trio.abc.Clock) -> None:
    ln = lane(lanes=1, queue_max=1)
    release = trio.Event()
    await nursery.start(hold, ln, release)
    nursery.start_soon(hold, ln, release)          # waits in the queue
    await trio.testing.wait_all_tasks_blocked()
    assert ln.statistics().queued == 1
    t0 = trio.current_time()
    with pytest.raises(RelayError) as info:
        async with ln.slot():
            pass
    assert trio.current_time() == t0                # at once
    err = info.value
    assert err.reason == "provider_queue_full" and err.status == 429
    assert err.phase == "capacity" and err.retry_after_s is not None
    assert "1/1 running, 1 queued" in err.message
    assert "check" not in err.message.replace("connection checks included", "")  # L7
    release.set()


async def test_queue_timeout_after_exactly_its_limit(nursery: trio.Nursery,
                                                     autojump_clock: trio.abc.Clock) -> None:
    ln = lane(queue_timeout_s=30.0)
    release = trio.Event()
    await nursery.start(hold, ln, release)
    t0 = trio.current_time()
    with pytest.raises(RelayError) as info:
        async with ln.slot():
            pass
    assert trio.current_time() - t0 == 30.0
    assert info.value.reason == "provider_queue_timeout"
    assert "waited 30 s for earlier requests" in info.value.message
    assert ln.statistics().queued == 0
    release.set()


async def test_priority_order_and_fifo_within_a_class(nursery: trio.Nursery,
                                                      autojump_clock: trio.abc.Clock) -> None:
    ln = lane(queue_max=10)
    release = trio.Event()
    await nursery.start(hold, ln, release)
    order: list[str] = []

    async def wait(name: str, priority: str) -> None:
        async with ln.slot(priority):
            order.append(name)
            await trio.sleep(1)

    for name, priority in [("low1", "background"), ("mid1", "normal"), ("hi1", "interactive"),
                           ("mid2", "normal"), ("low2", "background"), ("hi2", "interactive")]:
        nursery.start_soon(wait, name, priority)
        await trio.testing.wait_all_tasks_blocked()
    release.set()
    await trio.sleep(2.5)   # hi1, hi2 done; mid1 running
    nursery.start_soon(wait, "late-hi", "interactive")  # arrives while others still wait
    await trio.sleep(10)
    assert order == ["hi1", "hi2", "mid1", "late-hi", "mid2", "low1", "low2"]
    assert ln.statistics().running == 0 and ln.statistics().queued == 0


async def test_pacer_allows_rpm_starts_a_minute_and_its_wait_is_queue_time(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    ln = lane(lanes=10, rpm=3.0, queue_timeout_s=2.5)    # three starts in any minute
    starts: list[float] = []
    failures: list[str] = []

    async def one() -> None:
        try:
            async with ln.slot():
                starts.append(trio.current_time())
                await trio.sleep(0.1)
        except RelayError as exc:
            failures.append(exc.reason)

    t0 = trio.current_time()
    for _ in range(5):
        nursery.start_soon(one)
    await trio.sleep(10)
    assert [s - t0 for s in starts] == [0.0, 0.0, 0.0]    # a burst within rpm: at once
    assert failures == ["provider_queue_timeout"] * 2     # pacing wait is queue time
    assert ln.statistics().running == 0 and ln.statistics().queued == 0


async def test_the_pacer_is_a_sliding_minute(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    """At most rpm starts in any 60 s, however they fall: not one every 60 / rpm s, and
    not a fixed minute that lets 2 x rpm through around its edge."""
    ln = lane(lanes=10, rpm=3.0, queue_timeout_s=600)
    t0 = trio.current_time()
    starts: list[float] = []

    async def one() -> None:
        async with ln.slot():
            starts.append(trio.current_time() - t0)

    nursery.start_soon(one)                               # t=0
    await trio.sleep(50)
    for _ in range(5):                                    # t=50: two now, then one at 60
        nursery.start_soon(one)                           # (the start at 0 leaves the
    await trio.sleep(200)                                 # window), two at 110
    assert starts == [0.0, 50.0, 50.0, 60.0, 110.0, 110.0]
    for t in starts:  # no 60 s window holds more than three
        assert sum(1 for u in starts if t <= u < t + 60) <= 3


async def test_pacer_wait_is_cancellable(nursery: trio.Nursery,
                                         autojump_clock: trio.abc.Clock) -> None:
    ln = lane(lanes=2, rpm=1.0)
    async with ln.slot():
        with trio.move_on_after(5) as scope:
            async with ln.slot():
                pytest.fail("the pacer allows one start a minute")
        assert scope.cancelled_caught
        assert ln.statistics().queued == 0
    assert ln.statistics().running == 0


async def test_cancelled_at_the_instant_of_the_grant_gives_the_slot_back(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    ln = lane()
    release = trio.Event()
    await nursery.start(hold, ln, release)
    entered: list[bool] = []
    waiter_scope = trio.CancelScope()

    async def waiter() -> None:
        with waiter_scope:
            async with ln.slot():
                entered.append(True)

    nursery.start_soon(waiter)
    await trio.testing.wait_all_tasks_blocked()
    assert ln.statistics().queued == 1
    # In one tick: the waiter is cancelled, then the holder releases (granting it).
    waiter_scope.cancel()
    release.set()
    await trio.testing.wait_all_tasks_blocked()
    assert entered == []
    stats = ln.statistics()
    assert (stats.running, stats.queued) == (0, 0)   # a naive limiter leaks 1 here
    async with ln.slot():                             # and the lane still works
        assert ln.statistics().running == 1


async def test_capacity_changes_in_place(nursery: trio.Nursery,
                                         autojump_clock: trio.abc.Clock) -> None:
    ln = lane(lanes=1, queue_max=10)
    release = trio.Event()
    for _ in range(4):
        nursery.start_soon(hold, ln, release)
    await trio.testing.wait_all_tasks_blocked()
    assert (ln.statistics().running, ln.statistics().queued) == (1, 3)
    ln.update_profile(Profile(lanes=3, queue_max=10, queue_timeout_s=30, run_timeout_s=60))
    await trio.testing.wait_all_tasks_blocked()
    assert (ln.statistics().running, ln.statistics().queued) == (3, 1)
    ln.update_profile(Profile(lanes=1, queue_max=10, queue_timeout_s=30, run_timeout_s=60))
    assert ln.statistics().running == 3                 # running work is never revoked
    release.set()
    await trio.testing.wait_all_tasks_blocked()
    assert (ln.statistics().running, ln.statistics().queued) == (0, 0)


async def test_many_waiters_with_random_cancels_never_leak(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    import random

    rng = random.Random(17)
    ln = lane(lanes=3, queue_max=1000, queue_timeout_s=5.0)
    done = 0

    async def job() -> None:
        nonlocal done
        with trio.move_on_after(rng.uniform(0, 6)):
            try:
                async with ln.slot(rng.choice(["interactive", "normal", "background"])):
                    await trio.sleep(rng.uniform(0, 0.5))
            except RelayError:
                pass
        done += 1

    for _ in range(500):
        nursery.start_soon(job)
        if rng.random() < 0.3:
            await trio.lowlevel.checkpoint()
    await trio.sleep(60)
    assert done == 500
    assert (ln.statistics().running, ln.statistics().queued) == (0, 0)


async def test_retry_after_is_estimated_from_recent_run_times(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    ln = Lane("p", Profile(lanes=1, queue_max=1, queue_timeout_s=1000, run_timeout_s=600),
              expected_run_s=1.0)
    for _ in range(20):             # recent runs take 60 s each
        async with ln.slot():
            await trio.sleep(60)
    release = trio.Event()
    await nursery.start(hold, ln, release)
    nursery.start_soon(hold, ln, release)
    await trio.testing.wait_all_tasks_blocked()
    with pytest.raises(RelayError) as info:
        async with ln.slot():
            pass
    # One running and one queued ahead, each about 60 s: retry in about two minutes.
    assert info.value.retry_after_s == pytest.approx(120, rel=0.05)
    seconds = int(info.value.message.split("Retry in about ")[1].split(" s")[0])
    assert 110 <= seconds <= 125
    release.set()


async def test_a_paced_free_slot_is_not_left_idle(nursery: trio.Nursery,
                                                  autojump_clock: trio.abc.Clock) -> None:
    # Found in review: a waiter that began waiting after the pacer's last start time had
    # passed slept without a deadline; when a slot then freed while the pacer held starts
    # back, nobody woke it at the pacer's next start, and the slot sat idle.
    ln = lane(lanes=2, rpm=1.0, queue_timeout_s=600)   # one start in any 60 s
    release_a, release_b, release_c = trio.Event(), trio.Event(), trio.Event()
    t0 = trio.current_time()
    await nursery.start(hold, ln, release_a)           # starts at 0
    await trio.sleep(60)
    await nursery.start(hold, ln, release_b)           # starts at 60: both slots busy
    await trio.sleep(66)                               # t = 126: the pacer would allow one
    started: list[float] = []

    async def waiter() -> None:
        async with ln.slot("normal"):
            started.append(trio.current_time() - t0)

    nursery.start_soon(waiter)                         # waits (no slot), no pacer deadline
    await trio.testing.wait_all_tasks_blocked()
    nursery.start_soon(functools.partial(hold, ln, release_c, priority="interactive"))
    await trio.testing.wait_all_tasks_blocked()
    release_a.set()                                    # t = 126: the interactive one starts
    await trio.sleep(6)
    release_b.set()                                    # t = 132: a slot frees; pacer: at 186
    await trio.sleep(120)
    assert started == [186.0]                          # not left idle until someone leaves
    release_c.set()


async def test_a_paced_free_slot_is_handed_on_when_the_woken_head_leaves(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    # Found by the lane fuzz: a slot freed before the pacer's next start wakes only the
    # head of the queue, to sleep until that start. When the head then left (client gone,
    # or its queue timeout), nobody else was woken: D below, waiting without a deadline,
    # failed provider_queue_timeout at t=246 with running=0 instead of starting at t=132.
    ln = lane(lanes=1, rpm=1.0, queue_timeout_s=180)   # one start in any 60 s
    t0 = trio.current_time()
    release_a, release_h = trio.Event(), trio.Event()
    await nursery.start(hold, ln, release_a)           # A starts at 0: next start at 60
    await trio.sleep(66)
    outcome: dict[str, float | str] = {}

    async def waiter(name: str, priority: str, scope: trio.CancelScope) -> None:
        with scope:
            try:
                async with ln.slot(priority):
                    outcome[name] = trio.current_time() - t0
            except RelayError as exc:
                outcome[name] = f"{exc.reason} at {trio.current_time() - t0:g}"

    nursery.start_soon(waiter, "D", "normal", trio.CancelScope())   # t=66: no pacer wait
    await trio.testing.wait_all_tasks_blocked()
    nursery.start_soon(functools.partial(hold, ln, release_h, priority="interactive"))
    await trio.testing.wait_all_tasks_blocked()
    x_scope = trio.CancelScope()
    nursery.start_soon(waiter, "X", "interactive", x_scope)         # ahead of D
    await trio.testing.wait_all_tasks_blocked()
    await trio.sleep(6)
    release_a.set()            # t=72: H starts (the pacer allows); next start at 132
    await trio.sleep(6)
    release_h.set()            # t=78: a free slot, paced: X, the head, waits for t=132
    await trio.sleep(6)
    x_scope.cancel()           # t=84: X's client leaves
    await trio.sleep(240)
    assert outcome == {"D": 132.0}
    assert (ln.statistics().running, ln.statistics().queued) == (0, 0)


async def test_a_grant_handed_straight_back_is_not_a_paced_start(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    # Found by the lane fuzz: a waiter cancelled in the very tick it was granted a slot
    # gave the slot back, but the pacer counted its start, so the next waiter sat beside
    # the free slot for a whole pacer interval.
    ln = lane(lanes=1, rpm=1.0, queue_timeout_s=600)   # one start in any 60 s
    t0 = trio.current_time()
    started: list[float] = []
    first_scope = trio.CancelScope()

    async def waiter(scope: trio.CancelScope) -> None:
        with scope:
            async with ln.slot():
                started.append(trio.current_time() - t0)

    async with ln.slot():                              # starts at 0
        nursery.start_soon(waiter, first_scope)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(waiter, trio.CancelScope())
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(72)
        first_scope.cancel()   # in the same tick as the release below: granted, handed back
    await trio.sleep(180)
    assert started == [72.0]                           # not 132
    assert (ln.statistics().running, ln.statistics().queued) == (0, 0)


async def test_a_reloaded_rpm_applies_to_the_next_start(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    # Found by the lane fuzz: the pacer kept the next start computed with the old rpm —
    # raised from 1 to 60 it still waited out the minute; lowered, it let starts through
    # faster than the new rpm.
    ln = lane(lanes=2, rpm=1.0, queue_timeout_s=100)
    t0 = trio.current_time()
    started: list[float] = []

    async def one() -> None:
        async with ln.slot():
            started.append(trio.current_time() - t0)
            await trio.sleep(0.1)

    nursery.start_soon(one)                              # starts at 0
    await trio.sleep(0.5)
    nursery.start_soon(one)                              # paced: would start at 60
    await trio.sleep(1.5)
    ln.update_profile(Profile(lanes=2, queue_max=8, queue_timeout_s=100, run_timeout_s=60,
                              rpm=60.0))                 # t=2: one start a second
    await trio.testing.wait_all_tasks_blocked()
    assert started == [0.0, 2.0]
    ln.update_profile(Profile(lanes=2, queue_max=8, queue_timeout_s=100, run_timeout_s=60,
                              rpm=2.0))                  # two in any minute: 0 and 2 count
    await trio.sleep(1)
    nursery.start_soon(one)
    await trio.sleep(90)
    assert started == [0.0, 2.0, 60.0]


async def test_wait_idle_returns_at_once_when_idle_and_when_the_last_one_leaves(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    ln = lane(lanes=1, rpm=1.0, queue_timeout_s=5.0)
    t0 = trio.current_time()
    await ln.wait_idle()
    assert trio.current_time() == t0                     # idle: at once
    returned: list[float] = []

    async def watch(ln: Lane) -> None:
        await ln.wait_idle()
        stats = ln.statistics()
        assert (stats.running, stats.queued) == (0, 0)
        returned.append(trio.current_time() - t0)

    # The last holder releases.
    release = trio.Event()
    await nursery.start(hold, ln, release)               # starts at 0
    nursery.start_soon(watch, ln)
    await trio.sleep(1)
    assert returned == []
    release.set()
    await trio.testing.wait_all_tasks_blocked()
    assert returned == [1.0]
    # The last waiter (paced: nothing runs) leaves by its queue timeout ...
    nursery.start_soon(watch, ln)
    with pytest.raises(RelayError, match="waited 5 s"):
        async with ln.slot():
            pass
    await trio.testing.wait_all_tasks_blocked()
    assert returned == [1.0, 6.0]
    # ... or because its client left.
    nursery.start_soon(watch, ln)
    with trio.move_on_after(2):
        async with ln.slot():
            pass
    await trio.testing.wait_all_tasks_blocked()
    assert returned == [1.0, 6.0, 8.0]
    # Cancelled at the instant of its grant: the slot comes back, the lane is idle.
    unpaced = lane(lanes=1)
    release = trio.Event()
    await nursery.start(hold, unpaced, release)
    scope = trio.CancelScope()

    async def cancelled_waiter() -> None:
        with scope:
            async with unpaced.slot():
                pytest.fail("cancelled before it could start")

    nursery.start_soon(cancelled_waiter)
    await trio.sleep(1)
    nursery.start_soon(watch, unpaced)
    await trio.testing.wait_all_tasks_blocked()
    scope.cancel()
    release.set()
    await trio.testing.wait_all_tasks_blocked()
    assert returned == [1.0, 6.0, 8.0, 9.0]


async def test_wait_idle_never_returns_while_a_request_runs_or_waits(
        autojump_clock: trio.abc.Clock) -> None:
    # It checked the lane, then checkpointed before returning: a request arriving in that
    # checkpoint took the slot, and wait_idle returned with running=1 (the fuzz saw it).
    # The order of tasks inside one tick is random in trio, so try it many times.
    ln = lane(lanes=1, queue_max=4)
    seen: list[tuple[int, int]] = []
    for _ in range(40):
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                await ln.wait_idle()
                seen.append((ln.statistics().running, ln.statistics().queued))

            async with ln.slot():
                nursery.start_soon(watch)
                await trio.testing.wait_all_tasks_blocked()
            # Released: the watcher is woken; a new request arrives in the same tick.
            await trio.lowlevel.checkpoint()
            async with ln.slot():
                await trio.sleep(1)
    assert seen == [(0, 0)] * 40


async def test_a_bad_priority_is_refused_and_leaves_the_lane_idle(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    ln = lane(lanes=1, queue_max=4)
    with pytest.raises(ValueError, match="unknown priority 'urgent'"):
        async with ln.slot("urgent"):   # a free slot: it was taken, priority unchecked
            pytest.fail("an unknown priority must not run")
    release = trio.Event()
    await nursery.start(hold, ln, release)
    with pytest.raises(ValueError, match="unknown priority 'urgent'"):
        async with ln.slot("urgent"):   # queued: a KeyError after the lane was marked busy
            pass
    release.set()
    with trio.fail_after(1):
        await ln.wait_idle()             # it hung: the lane looked busy forever


async def test_a_failing_on_queued_callback_leaves_no_ghost_waiter(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    # on_queued ran after the waiter was queued but outside the try that takes it out
    # again: if it raised, a ghost stayed queued, was granted the next free slot, and
    # held it forever.
    ln = lane(lanes=1, queue_max=4)
    release = trio.Event()
    await nursery.start(hold, ln, release)

    def boom() -> None:
        raise RuntimeError("a bug in the caller's notice")

    with pytest.raises(RuntimeError):
        async with ln.slot(on_queued=boom):
            pass
    assert (ln.statistics().running, ln.statistics().queued) == (1, 0)
    release.set()
    await trio.testing.wait_all_tasks_blocked()
    assert (ln.statistics().running, ln.statistics().queued) == (0, 0)
    with trio.fail_after(1):
        async with ln.slot():            # the slot went to no ghost
            assert ln.statistics().running == 1

"""Token budgets on the coordination server (SPEC L12 on a shared provider, L11).

A provider with ``shared = true`` keeps its token budgets and its hold where its lanes
are kept: on the coordination server, moved only by the Lua scripts of
`relay.shared.budget_scripts`, on the server's clock (``TIME``), never a relay's.
What any relay takes, settles and learns from a provider's headers (or its 429s, or a
usage-window notice) moves the same buckets, so the relays sharing one key stay inside
its limits together.

The buckets are `relay.capacity.budget`'s: at most their limit (the lower of the configured
figure a relay sends and the last header), refilled continuously; a header's
``remaining`` only ever lowers a level; a hold stops every start on every relay but a
connection check's, and an answer begun after the hold began ends it.

`SharedBudget.take` runs once the request holds its shared slot (`SharedLane.slot`): the
slot is counted across relays first, then the tokens, so on a shared provider a holder
may wait for tokens while it holds its slot (the provider's budget is every relay's: no
other request could start in its place without overdrawing it). The holders that wait
for tokens wait in one queue on the server, in the slots' order (priority class, then
arrival), whichever relay they are on: only its head takes tokens, so a large request is
never passed by smaller ones that came after it (SPEC L9). The head asks again when the
server says its need may fit; a waiter behind it when the server wakes it (the head took
its tokens or left, or a settlement gave tokens back: ``g <member>`` on its relay's
wake-up channel, which `SharedLane.woken` hears); each at least every `POLL_S`, which
also keeps its place (a relay that stops asking loses its waiters' places after
`PLACE_S`). Its waiting notices say what it waits for (`waiting_for`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

import trio

from relay.capacity.budget import Learned, Need, bounded_hold, too_large
from relay.vocab.errors import RelayError
from relay.vocab.limits import KINDS, RateLimits
from relay.vocab.profile import Profile

from .budget_scripts import SCRIPTS
from .coordinator import Coordinator

__all__ = ["SCRIPTS", "Place", "SharedBudget"]

logger = logging.getLogger("relay.dispatch")

_WHAT = {"requests": "request starts", "tokens": "tokens", "input": "input tokens",
         "output": "output tokens"}


class Place(Protocol):
    """A request's place in its shared lane (the slot it holds), as the token queue
    sees it."""

    member: str
    rank: int
    queued: bool  # the lane's waiting notices have begun
    on_queued: Callable[[], None] | None
    event: trio.Event  # set when the server says this head may go


class SharedBudget:
    """One shared provider's token budgets and hold (see the module docstring).

    It is given what it needs of its lane: the provider's name, the relay's coordinator,
    the lane's profile as it stands (``profile``) and the place of the slot the calling
    task holds (``holder``)."""

    POLL_S = 1.0
    PLACE_S = 5.0  # a token waiter's place lasts this long unless its relay asks again

    def __init__(self, name: str, coordinator: Coordinator, *,
                 profile: Callable[[], Profile], holder: Callable[[], Place | None]
                 ) -> None:
        self.name = name
        self._coord = coord = coordinator
        self._profile = profile
        self._holder = holder
        base = "{" + f"{coord.prefix}:{name}" + "}"
        # B, T, TX, F (`relay.shared.budget_scripts`), and the lane's holders (H: whether
        # the first start after a hold still holds its slot).
        self._keys = [f"{base}:b", f"{base}:t", f"{base}:tx", f"{base}:f",
                      coord.keys(name)[0]]
        self._known = False  # the server had these keys at this relay's last call
        # (its scripts, `SCRIPTS`, are the coordinator's to run, beside its own)
        self._waiting: dict[str, tuple[int, str]] = {}  # member -> (ahead, in words)
        self._peeked: tuple[float, list[Any]] | None = None  # (when, TOKENS_PEEK's reply)
        self.learned = Learned()  # this relay's answers (the output reservation)

    def _configured(self) -> list[str]:
        p = self._profile()
        return [repr(float(p.tpm)), repr(float(p.itpm)), repr(float(p.otpm))]

    async def _call(self, script: str, *args: Any) -> list[Any]:
        # (First: whether this relay has found the keys before: if the server has them
        # no more, they were lost, and the scripts start from the next header.)
        reply: list[Any] = await self._coord.call(
            script, self._keys, ["1" if self._known else "0", *args], provider=self.name)
        self._known = True
        return reply

    def waiting_for(self) -> str | None:
        """What this relay's request nearest the head of the token queue waits for, in
        words with its numbers (the waiting notices' text); None when none waits."""
        return min(self._waiting.values())[1] if self._waiting else None

    def member_here(self) -> str:
        """The place of the slot this task holds ('' : none), as the scripts name it."""
        m = self._holder()
        return m.member if m is not None else ""

    async def take(self, need: Need, *, deadline: float, leave_if_held: bool,
                   probe: bool) -> tuple[float, str | None, frozenset[str]]:
        """Wait until ``need`` fits the shared budgets and this request heads the token
        queue (priority class, then arrival, across relays), and take it. Returns how
        long it waited, the hold that delayed it (None: none did), and the budgets it
        was taken from (for its settlement).

        Raises:
            RelayError: ``request_too_large``; the hold's reason (a fallback to go to, or
                the hold outlasts the queue timeout); ``provider_queue_timeout``;
                ``coordination_unavailable``.
        """
        m = self._holder()
        member, rank = (m.member, m.rank) if m is not None else (
            self._coord.new_member(), 1)
        try:
            return await self._take(need, m, member, rank, deadline=deadline,
                                     leave_if_held=leave_if_held, probe=probe)
        except BaseException:
            self._waiting.pop(member, None)
            if not probe:  # its place goes, and the next in line is told (bounded)
                # (noqa, ASYNC912: the call awaits the server's answer.)
                with trio.CancelScope(shield=True,  # noqa: ASYNC912
                                      deadline=trio.current_time()
                                      + self._coord.command_timeout_s):
                    try:
                        await self._call("TOKENS_LEAVE", member,
                                         self._coord.channel_prefix)
                    except RelayError:
                        pass  # its place ends PLACE_S after its last question
            raise

    async def _take(self, need: Need, m: Place | None, member: str, rank: int, *,
                    deadline: float, leave_if_held: bool, probe: bool
                    ) -> tuple[float, str | None, frozenset[str]]:
        began = trio.current_time()
        held_by: str | None = None
        name = self.name
        while True:
            reply = await self._call("TOKENS_TAKE", need.input, need.output,
                                     *self._configured(), 1 if probe else 0, member, rank,
                                     int(self.PLACE_S * 1000),
                                     self._coord.channel_prefix)
            code = int(reply[0])
            if code == 0:
                self._waiting.pop(member, None)
                return trio.current_time() - began, held_by, frozenset(map(str, reply[1:]))
            if code < 0:
                raise too_large(name, need, str(reply[1]), int(reply[2]), float(reply[3]))
            now, wait = trio.current_time(), code / 1000
            if reply[1] == "hold":
                held_by = str(reply[2]) or "the provider said wait"
                if leave_if_held or now + wait > deadline:
                    why = ("it has a fallback to go to" if leave_if_held else
                           "past this request's queue timeout")
                    raise RelayError(
                        str(reply[3]) or "rate_limited",
                        f"provider {name!r} holds every start for about {math.ceil(wait)} "
                        f"s more ({held_by}); {why}. This request was not sent.",
                        provider=name, retry_after_s=max(1.0, wait))
            said = self._said(reply, wait)
            if now >= deadline:
                raise RelayError(
                    "provider_queue_timeout", f"waited {now - began:.0f} s for provider "
                    f"{name!r}'s shared token budget ({said}): this request was not "
                    f"sent. Retry in about {math.ceil(wait)} s.", provider=name,
                    retry_after_s=max(1.0, wait))
            self._waiting[member] = (int(reply[2]) if reply[1] == "queue" else 0, said)
            if m is not None and not m.queued and m.on_queued is not None:
                m.queued = True  # (its waiting notices now say what it waits for)
                m.on_queued()
            event = trio.Event()
            if m is not None:
                m.event = event  # set when the server says this head may go (`woken`)
            with trio.move_on_after(min(wait, self.POLL_S, max(0.0, deadline - now))):
                await event.wait()

    def _said(self, reply: list[Any], wait: float) -> str:
        """A `TOKENS_TAKE` reply that is not a start, in words."""
        about = f"about {math.ceil(wait)} s"
        if reply[1] == "hold":
            cause = str(reply[2]) or "the provider said wait"
            return f"waiting for the provider's hold ({cause}): no start for {about}"
        if reply[1] == "queue":
            return (f"waiting for the provider's token budget, behind {int(reply[2])} "
                    f"earlier request(s) of the relays sharing it")
        if reply[1] == "first":
            return ("waiting for the first request after the provider's hold to be "
                    "answered")
        kind, free, want = str(reply[1]).split()
        return (f"waiting for the provider's {_WHAT.get(kind, kind)} budget: "
                f"{max(0, int(free)):,} of {int(float(want)):,} free, {about}")

    async def settle(self, need: Need, used_in: int, used_out: int,
                     kinds: frozenset[str] | None) -> None:
        """Give back to the budgets it was taken from what a request reserved and did not
        use (take what it used beyond); ``kinds`` None: every budget."""
        await self._call("TOKENS_SETTLE", need.input, need.output, used_in, used_out,
                         *self._configured(), self._coord.channel_prefix,
                         self.member_here(),  # (a first start after a hold ends here)
                         *sorted(kinds if kinds is not None else KINDS))

    @property
    def command_timeout_s(self) -> float:
        """How long one call to the server may take (the coordinator's bound)."""
        return self._coord.command_timeout_s

    def seen_soon(self, limits: RateLimits, *, began_s_ago: float, member: str) -> None:
        """`seen` for an answer's rate-limit headers, in the coordinator's nursery (the
        answer goes on meanwhile): a server that cannot be reached is logged, never the
        coordinator's (and relay's) crash."""
        self._coord.start_soon(self._seen_logged, limits, began_s_ago, member)

    async def _seen_logged(self, limits: RateLimits, began_s_ago: float,
                           member: str) -> None:
        try:
            await self.seen(limits, ok=True, began_s_ago=began_s_ago, member=member)
        except RelayError as exc:
            logger.warning("shared token budget of %s not updated: %s", self.name,
                           exc.message)

    # --- visibility ---------------------------------------------------------------------
    async def refresh(self) -> None:
        """Read the budgets as they stand on the server (`SharedLane.sync` does, at each
        renewal): what `status` shows.

        Raises:
            RelayError: ``coordination_unavailable``.
        """
        self._peeked = (trio.current_time(), await self._call("TOKENS_PEEK",
                                                              *self._configured()))

    def status(self, iso: Callable[[float | None], str | None]) -> dict[str, Any] | None:
        """The provider's ``budgets`` object of the status, as `Budget.status`'s, from
        the last renewal's reading (``as_of``), every relay's ``used_last_minute``."""
        if self._peeked is None:
            return None
        at, reply = self._peeked
        now = trio.current_time()
        configured = dict(zip(("tokens", "input", "output"),
                              (float(f) for f in self._configured()), strict=True))
        budgets: dict[str, Any] = {}
        for i in range(4, len(reply), 5):
            kind, limit, level, header, others = (
                str(reply[i]), float(reply[i + 1]), float(reply[i + 2]),
                float(reply[i + 3]), float(reply[i + 4]))
            figure = configured.get(kind, 0.0)
            refill = limit - others  # (what others on the key take is left to them)
            budgets[kind] = {
                "limit_per_minute": limit,
                "remaining": max(0, math.floor(min(limit, level + (now - at) * refill / 60))),
                "source": "header" if header and (not figure or header <= figure)
                else "configured",
                "configured": figure or None, "header": header or None, "header_at": None,
                "others_per_minute": round(others)}
        left = float(reply[0]) / 1000 - (now - at)
        per_minute = {k: v["limit_per_minute"] for k, v in budgets.items()}
        return {
            "budgets": budgets, "shared": True, "as_of": iso(at),
            "token_waiters": int(reply[2]),  # every relay's holders waiting for tokens
            "used_last_minute": int(reply[3]),  # every relay's, on the server's clock
            "reserved_output": None, "per_minute": [],
            "hold": ({"until": iso(now + left), "left_s": round(left, 3),
                      "cause": str(reply[1])} if left > 0 else None),
            "tokens_limit": per_minute.get("tokens") or (
                sum(per_minute.get(k, 0.0) for k in ("input", "output")) or None),
        }

    async def seen(self, limits: RateLimits | None, *, ok: bool = False,
                   began_s_ago: float = 0.0, reason: str = "rate_limited",
                   member: str = "") -> None:
        """An answer's rate-limit headers and hold, for every relay sharing the
        provider. ``began_s_ago``: when the answering request started; ``member``: its
        place (what started after it is taken off a header's ``remaining``)."""
        if limits is None and not ok:
            return
        triples: list[Any] = []
        for kind, window in (limits.windows.items() if limits is not None else ()):
            triples += [kind, "" if window.limit is None else repr(float(window.limit)),
                        "" if window.remaining is None else repr(float(window.remaining))]
        hold_s, cause = 0.0, ""
        if limits is not None and limits.hold_s:
            hold_s, cause = bounded_hold(limits, self._profile().max_hold_s, reason)
        await self._call("TOKENS_SEEN", *self._configured(), int(hold_s * 1000), cause,
                         reason,
                         1 if ok else 0, int(began_s_ago * 1000),
                         self._coord.channel_prefix, member, *triples)

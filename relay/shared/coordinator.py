"""One relay's connection to the shared lanes' server: Redis 7 or Valkey (SPEC L11).

Theory of operation. A `Coordinator` lives as one task of relay's own nursery (`serve`)
and holds, for the relay's life, a `relay.redis.resp` client (one pipelined connection,
no task of its own), one pub/sub subscription on this relay's own wake-up channel, and
the renewal loop. Every `SharedLane` of the relay calls the server through `call`, which
bounds each command (``command_timeout_s``: a deadline that fires far past its time was
this relay's own loop standing still, and the command goes once more) and turns any
failure into ``coordination_unavailable``.

Why no blocking command: a ``BLPOP`` cancelled by a trio scope leaves a pipelined
connection blocked behind it (measured with valkey-glide: the next ``GET`` timed out).
So every command here returns at once; a waiter is woken by a published message on a
connection of its own (the subscription), and any message lost (pub/sub is at most
once) is made up by the next renewal, which lists this relay's granted waiters.

Renewal: every ``lease / 4`` the loop renews every lease this relay holds (slots and
places in queues), one `SYNC` script per shared lane. ``renewed_at`` is when the last
renewal that reached the server for every lane was *sent*; the server's leases end no
sooner than ``renewed_at + lease``. A holder's body is cancelled at ``lost_at`` —
``renewed_at + lease / 2`` — so it stops (``coordination_lost``) before its lease can
expire and another relay be granted its slot. Half a lease is what its cleanup has.

Health: after a failed command the server counts as unreachable and a shared lane
answers ``coordination_unavailable`` at once (no request waits on a dead server) until
a renewal gets through again; while it is down the loop retries every
``DOWN_RETRY_S``. Local providers never call this module.

A relay stopped (SIGSTOP, a suspended laptop) for longer than its lease loses its slots
on the server, which grants them to others: until it wakes, its own requests still hold
their upstream calls, so the provider may see more than ``lanes`` at once. When it
wakes, ``lost_at`` has passed: its holders are cancelled at once, before any renewal
(documented in the README; tested).
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
from typing import Any, Protocol

import trio

from relay.redis import resp
from relay.vocab.errors import ConfigError, RelayError

from . import budget_scripts, client_scripts, deployment, figures, lane_scripts


class CoordinatedLane(Protocol):
    """What the coordinator asks of each shared lane (`relay.shared.lane.SharedLane`,
    which imports this module)."""

    name: str

    async def wait_idle(self) -> None: ...
    async def sync(self, *, at_start: bool = False, mode: str | None = None) -> None: ...
    def renewed(self, lost_at: float) -> None: ...
    async def retry_give_back(self, script: str, member: str) -> None: ...
    def pump_hint(self, ms: int) -> None: ...
    def woken(self, member: str) -> bool: ...

__all__ = ["Coordinator"]

logger = logging.getLogger(__name__)


# What a command raises when the server is gone, refuses, or the connection breaks.
_FOREIGN = (resp.RespError, resp.ConnectionLost, OSError)

DOWN_RETRY_S = 0.25  # while the server is unreachable: how often the renewal retries
LOST_FRACTION = 0.5  # a holder stops this far into a lease that could not be renewed


class Coordinator:
    """This relay's side of the shared lanes. See the module docstring."""

    def __init__(self, url: str, *, prefix: str, lease_s: float, relay_id: str) -> None:
        self._url = url
        self.prefix = prefix
        self.lease_s = lease_s
        self.relay_id = relay_id
        self.instance = f"{relay_id}#{secrets.token_hex(4)}"
        self.channel_prefix = f"{prefix}:wake:"
        self.channel = self.channel_prefix + self.instance
        self.tick_s = lease_s / 4
        self.ping_s = lease_s / 4  # the subscription's health: see `_listen`
        self.subscription_renewals = 0  # silent subscriptions noticed (a test reads it)
        self._subscription: tuple[resp.Subscription, trio.CancelScope] | None = None
        self._silent = False  # the subscription did not answer its ping in time
        self.command_timeout_s = min(1.0, lease_s / 4)
        self.lanes: dict[str, CoordinatedLane] = {}
        self.available = False
        self.down_reason = "not connected yet"
        self.renewed_at = -math.inf
        self.subscribed = trio.Event()
        self._members = itertools.count()
        self._client: resp.Client | None = None
        # The lanes', the token budgets' (SPEC L12), the clients' (L14), a status read's.
        sources = {**{n: getattr(lane_scripts, n) for n in (
            "SYNC", "ACQUIRE", "LEAVE", "RELEASE", "PUMP", "CLAIM")}, **budget_scripts.SCRIPTS,
            **{n: getattr(client_scripts, n) for n in client_scripts.__all__},
            "COUNTS": figures.COUNTS}
        self._scripts = {name: resp.Script(source) for name, source in sources.items()}
        self._renew_now = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._calls = 0  # commands on their way (a stop lets them land first)
        self._calls_done = trio.Event()
        # Give-backs (LEAVE, RELEASE) that did not reach the server: member -> (lane,
        # script, since). Retried after each renewal until the lease has ended them.
        self.orphans: dict[str, tuple[CoordinatedLane, str, float]] = {}

    # --- what lanes ask ---------------------------------------------------------------------
    @property
    def lost_at(self) -> float:
        """When this relay's holders must stop unless a renewal gets through first."""
        return self.renewed_at + self.lease_s * LOST_FRACTION

    def add(self, lane: CoordinatedLane) -> None:
        self.lanes[lane.name] = lane
        self._renew_now.set()

    async def forget_when_idle(self, lane: CoordinatedLane) -> None:
        """A removed provider's lane: renewed until its last request has left."""
        await lane.wait_idle()
        if self.lanes.get(lane.name) is lane:
            del self.lanes[lane.name]

    def new_member(self) -> str:
        return f"{self.instance}|{next(self._members)}"

    def keys(self, lane: str) -> list[str]:
        base = "{" + f"{self.prefix}:{lane}" + "}"
        return [f"{base}:{k}" for k in ("h", "w", "wx", "m", "r", "s")]

    def renew_soon(self) -> None:
        self._renew_now.set()

    def start_soon(self, fn: Any, *args: Any) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    def unavailable(self, provider: str, why: str | None = None) -> RelayError:
        return RelayError(
            "coordination_unavailable",
            f"shared provider {provider!r} cannot take requests now: its coordination "
            f"server is unreachable ({why or self.down_reason}). Nothing was sent to the "
            f"provider. Retry in about {math.ceil(self.lease_s)} s; providers that are "
            "not shared are unaffected.",
            provider=provider, retry_after_s=self.lease_s)

    async def call(self, script: str, keys: list[str], args: list[Any], *,
                   provider: str) -> Any:
        """Run one of `shared_scripts` on the server, bounded in time.

        Raises:
            RelayError: ``coordination_unavailable`` (the server did not answer in time,
                refused, or is not connected).
        """
        client = self._client
        if client is None:
            raise self.unavailable(provider)
        self._calls += 1
        try:
            return await self._call(client, script, keys, args, provider)
        finally:
            self._calls -= 1
            if not self._calls:
                self._calls_done.set()
                self._calls_done = trio.Event()

    async def _call(self, client: resp.Client, script: str, keys: list[str],
                    args: list[Any], provider: str, again: bool = False) -> Any:
        began = trio.current_time()
        try:
            with trio.fail_after(self.command_timeout_s):
                try:
                    reply = await client.script(self._scripts[script], keys, args)
                    return self._after_retry(script, reply) if again else reply
                except resp.ConnectionLost:
                    # A connection the server dropped (it restarted): once more, on a
                    # fresh one, if the server takes connections at all. Every script is
                    # safe to run twice (the member says where it stands).
                    if not await self._reachable():
                        raise
                    reply = await client.script(self._scripts[script], keys, args)
                    return self._after_retry(script, reply)
        except trio.TooSlowError as exc:
            client.reset()  # the server may be stuck (SIGSTOP): the next call connects anew
            if again or trio.current_time() - began < self.command_timeout_s * 1.5:
                self._down(f"no answer within {self.command_timeout_s:g} s")
                raise self.unavailable(provider) from exc
        except _FOREIGN as exc:
            self._down(f"{type(exc).__name__}: {exc}")
            raise self.unavailable(provider) from exc
        # (fired far past its time: this relay's loop stood still, not the server)
        return await self._call(client, script, keys, args, provider, again=True)

    def _after_retry(self, script: str, reply: Any) -> Any:
        """A script run again after its connection broke before the reply: the first run
        may have landed. A RELEASE that then finds its slot ``gone`` released it the first
        time, while this relay's lease still stands on the server (``renewed_at + lease``:
        the server's leases end no sooner): not an expired lease."""
        if (script == "RELEASE" and isinstance(reply, list) and reply and reply[0] == "gone"
                and trio.current_time() < self.renewed_at + self.lease_s):
            return ["released", *reply[1:]]
        return reply

    async def claim_check(self, lane: str, interval_s: float) -> bool:
        """True when this relay runs the lane's interval check now (one relay per
        interval across relays); False when another has it or the server is down."""
        if not self.available:
            await trio.lowlevel.checkpoint()
            return False
        key = "{" + f"{self.prefix}:{lane}" + "}:check"
        try:
            won = await self.call("CLAIM", [key], [self.relay_id, max(
                1, int(interval_s * 1000))], provider=lane)
        except RelayError:
            return False
        return bool(won)

    # --- its life -----------------------------------------------------------------------
    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        """Connect, register every shared lane, then renew until cancelled.

        Raises:
            ConfigError: at start, a shared provider's lanes, queue_max or rpm differ
                from those the relays already there agreed on (SPEC L11).
        """
        try:
            opened = resp.open_client(self._url, timeout_s=self.command_timeout_s,
                                      name=f"relay:{self.instance}")
        except ValueError as exc:  # (checked at load; never quoted: it may hold a password)
            raise ConfigError([f"[server] coordination_url: {exc}"]) from exc
        async with opened as client, trio.open_nursery() as nursery:
            self._client, self._nursery = client, nursery
            nursery.start_soon(self._listen)
            with trio.move_on_after(self.command_timeout_s * 2):
                await self.subscribed.wait()
            await self._renew_all(at_start=True)
            if self.available:
                await deployment.warn_about_eviction(client, 2 * self.command_timeout_s)
            else:
                logger.warning("shared lanes: the coordination server is unreachable at "
                               "start (%s); shared providers answer "
                               "coordination_unavailable until it is back", self.down_reason)
            task_status.started()
            try:
                await self._renew_loop()
            finally:
                # Relay stops: no new call starts, and give-backs already on their way
                # (requests stopped by the same cancel) may land before the connections
                # close — shielded, bounded by one command's time.
                self._client, self.available = None, False
                with trio.CancelScope(shield=True, deadline=trio.current_time()
                                      + self.command_timeout_s):
                    await trio.lowlevel.checkpoint()  # their finally blocks run first
                    while self._calls:
                        await self._calls_done.wait()

    async def _renew_loop(self) -> None:
        while True:
            wait = self.tick_s if self.available else min(self.tick_s, DOWN_RETRY_S)
            with trio.move_on_after(wait):
                await self._renew_now.wait()
            self._renew_now = trio.Event()
            await self._renew_all()

    async def _reachable(self) -> bool:
        """Whether the server accepts a connection now (`resp.Client.reachable`)."""
        if self._client is None:
            return False
        try:
            await self._client.reachable()
        except resp.ConnectionLost as exc:
            self._down(str(exc))
            return False
        return True

    async def _renew_all(self, *, at_start: bool = False) -> None:
        if not self.available and not await self._reachable():
            return
        sent = trio.current_time()
        for lane in list(self.lanes.values()):
            try:
                await lane.sync(at_start=at_start)
            except RelayError:
                return
            except ConfigError:
                if at_start:
                    raise
        was = self.available
        self.renewed_at = max(self.renewed_at, sent)
        self.available = True
        if not was:
            logger.info("shared lanes: the coordination server answers (%s)",
                        ", ".join(self.lanes) or "no shared provider yet")
        for lane in self.lanes.values():
            lane.renewed(self.lost_at)
        # After the renewal, never delaying it: a relay leaves an old primary that still
        # takes writes (the Sentinels moved on) by its next renewal.
        if self._client is not None:
            try:
                self._follow(await self._client.follow_primary())
            except resp.ConnectionLost as exc:  # (the primary may still answer: go on)
                logger.debug("shared lanes: the Sentinels could not be asked (%s)", exc)
        for member, (lane, script, since) in list(self.orphans.items()):
            if trio.current_time() - since < self.lease_s:
                try:
                    await lane.retry_give_back(script, member)
                except RelayError:
                    return
            self.orphans.pop(member, None)

    def _down(self, why: str) -> None:
        if self.available:
            logger.warning("shared lanes: the coordination server is unreachable (%s); "
                           "shared providers answer coordination_unavailable", why)
        self.available = False
        self.down_reason = why

    async def _listen(self) -> None:
        """This relay's wake-up channel: grants (``g member``) and the pacer's "ask
        again in N ms" (``p lane ms``). A lost message costs one renewal tick.

        Health: a PING on the subscription every ``ping_s / 2``, its pong due within
        ``ping_s / 2``: a connection a NAT or a load balancer silently dropped is noticed
        within one ping interval (``ping_s``), logged once, and subscribed again at once;
        the renewal that follows makes up the wake-ups lost meanwhile. The subscription
        is also made again when the Sentinels name another primary."""
        first = True
        while True:
            if not await self._reachable():
                await trio.sleep(DOWN_RETRY_S)
                continue
            client = self._client
            assert client is not None
            self._silent = False
            try:
                async with client.subscribe(self.channel) as subscription, \
                        trio.open_nursery() as nursery:
                    self._subscription = (subscription, nursery.cancel_scope)
                    self.subscribed.set()
                    if not first:
                        self.renew_soon()  # wake-ups may have been lost meanwhile
                    first = False
                    nursery.start_soon(self._ping, subscription, nursery.cancel_scope)
                    while True:
                        self._message(await subscription.message())
            except* _FOREIGN as group:  # (a stop, trio.Cancelled, passes through)
                logger.debug("shared lanes: the subscription ended (%r); renewals make up "
                             "for lost wake-ups meanwhile", group.exceptions[0])
            finally:
                self._subscription = None
            self.subscribed = trio.Event()
            if not self._silent:
                await trio.sleep(DOWN_RETRY_S)

    async def _ping(self, subscription: resp.Subscription, scope: trio.CancelScope) -> None:
        half = self.ping_s / 2
        while True:
            await trio.sleep(half)
            seen = subscription.pongs
            await subscription.ping()
            with trio.move_on_after(half):
                await subscription.pong(seen)
                continue
            self.subscription_renewals += 1
            logger.warning("shared lanes: the wake-up subscription did not answer a ping "
                           "within %g s (a connection dropped on the way?); subscribing "
                           "again", half)
            self._silent = True
            scope.cancel()
            return

    def _follow(self, primary: tuple[str, int] | None) -> None:
        """The Sentinels named ``primary``: a subscription elsewhere is made again."""
        current = self._subscription
        if primary is not None and current is not None and current[0].address not in (
                None, primary):
            current[1].cancel()

    def _message(self, data: str) -> None:
        kind, _, rest = data.partition(" ")
        if kind == "g":
            self.granted(rest)
        elif kind == "p":
            name, _, ms = rest.rpartition(" ")
            lane = self.lanes.get(name)
            if lane is not None and ms.lstrip("-").isdigit():
                lane.pump_hint(int(ms))

    def granted(self, member: str) -> None:
        for lane in self.lanes.values():
            if lane.woken(member):
                return

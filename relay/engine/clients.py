"""Clients at run time (SPEC L14, O7): what each has spent, its per-minute gate, and what
each request cost.

Theory of operation.

- **Cost.** Every record is completed as it is written (`Clients.complete`, one of the
  record writer's completers): its ``cost_usd`` is its usage at its model's price —
  the provider's ``[providers.NAME.prices."MODEL"]`` over the packaged table; 0 on a CLI
  adapter (a subscription); None when a price it needs is not known (`price_for`).
- **Per-day and per-month limits** (``tokens_per_day``, ``usd_per_day``,
  ``usd_per_month``) are counted in UTC days and months, from the records: every record
  written adds its tokens and cost to its client's windows of the day and month it
  started in, and at start the windows are seeded from the records file (`seed`: the
  lines of this month, the rotated files included), so a restart does not reset them.
  A request is admitted (`admit`, before anything is queued) while its client's spend
  plus what its running requests reserved is below each limit; else ``client_limit``
  429 with the window's reset as Retry-After. A dollar limit reserves the request's
  estimated cost (estimated input at the input price, output reservation at the output
  price)
  at admission; its record settles it to the real cost. So a burst overshoots a limit
  by at most what was running when the last of it was admitted.
- **Per-minute limits and lanes** (``rpm``, ``tpm``, ``lanes``): each attempt passes its
  client's `Gate` before it enters the provider's lane: it waits there like any waiter
  (in order, cancellable, its notices naming the limit) up to the provider's
  ``queue_timeout_s``; ``lanes`` counts the client's attempts running at once, across
  providers, ``rpm`` their starts in any 60 s, ``tpm`` their estimated tokens (input and
  output reservation) in any 60 s, settled to what they used.

- **Across relays** (SPEC L11): with ``[server] coordination_url`` set, the coordination
  server holds what must hold for a client on every relay (`shared`,
  `relay.shared.client_limits`): a chat request admitted here is admitted there too
  (`confirm`, as its first attempt reaches its client's gate: every relay's spend today
  and this month, each written by its relay as the total of its own records, plus the
  reservations of every relay's running requests), and its record writes this relay's
  spend there and ends its reservation; the gate's ``rpm`` and ``tpm`` are counted there.
  ``tokens_per_day`` goes the same way (each relay's total). ``lanes`` stays per relay.
  Without the server (or while it is unreachable), each relay counts on its own.
"""

from __future__ import annotations

import collections
import datetime as dt
import functools
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from relay.capacity.estimate import estimate_input, output_reservation
from relay.config import ClientConfig, Config
from relay.shared.client_limits import SharedClientLimits
from relay.vocab.errors import RelayError
from relay.vocab.events import Call
from relay.vocab.prices import FREE, Price, cost_of, lookup, packaged
from relay.vocab.profile import ProviderConfig
from relay.vocab.records import Clock, Record

from .gate import Gate

__all__ = ["Clients", "price_for"]

logger = logging.getLogger(__name__)

CHECK_ROUTE = "(check)"  # a connection check's record: no client's spend


def price_for(provider: ProviderConfig, model: str) -> Price | None:
    """``model``'s price on ``provider`` (SPEC O7): 0 on a CLI tool (a subscription);
    the provider's own price over the packaged one; None when neither knows it."""
    if provider.adapter.endswith("-cli"):
        return FREE
    own = lookup(provider.prices, model) if provider.prices else None
    base = _packaged_price(model)
    return own.over(base) if own is not None else base


@functools.lru_cache(maxsize=1024)  # (every request looks its model up: a few each)
def _packaged_price(model: str) -> Price | None:
    return lookup(packaged(), model)


def _windows(wall: float) -> tuple[str, str]:
    """The UTC day and month of a ``time.time()``: ``("2025-11-20", "2025-11")``."""
    return _day_windows(int(wall // 86400))


@functools.lru_cache(maxsize=4)
def _day_windows(days: int) -> tuple[str, str]:
    day = dt.datetime.fromtimestamp(days * 86400, tz=dt.UTC).strftime("%Y-%m-%d")
    return day, day[:7]


def _resets(wall: float) -> tuple[float, float]:
    """When this UTC day and this UTC month end, as ``time.time()`` values."""
    now = dt.datetime.fromtimestamp(wall, tz=dt.UTC)
    today = now.replace(hour=0, minute=0, second=0, microsecond=0)
    month = today.replace(day=1)
    next_month = (month + dt.timedelta(days=32)).replace(day=1)
    return (today + dt.timedelta(days=1)).timestamp(), next_month.timestamp()


@attrs.define
class _Spent:
    tokens: int = 0
    usd: float = 0.0


class Clients:
    """Every client's spend and gate in one relay. See the module docstring."""

    def __init__(self, config: Callable[[], Config], clock: Clock) -> None:
        self._config = config
        self.clock = clock
        self._spent: dict[tuple[str, str], _Spent] = {}   # (client, day | month) → spent
        self._reserved: dict[str, tuple[str, float]] = {}  # request id → (client, usd)
        self._reserved_by: dict[str, float] = collections.defaultdict(float)
        self._gates: dict[str, Gate] = {}
        # SPEC L11: the coordination server's side (set when relay has one), and the
        # requests it admitted (request id -> client).
        self.shared: SharedClientLimits | None = None
        self.relay_id = ""
        self._confirmed: dict[str, str] = {}

    # --- who --------------------------------------------------------------------------
    def client(self, name: str) -> ClientConfig:
        """``name``'s settings now (a reload may change them); the defaults for a name
        the config does not hold (``default`` without ``[clients]``)."""
        return self._config().clients.get(name) or ClientConfig(name=name)

    def gate(self, name: str) -> Gate:
        gate = self._gates.get(name)
        if gate is None:
            gate = self._gates[name] = Gate(name, self.client, shared=lambda: self.shared,
                                            admit=functools.partial(self.confirm, name))
        return gate

    # --- cost and spend -----------------------------------------------------------------
    def complete(self, record: Record) -> None:
        """A record about to be written: its cost, and its client's spend settled."""
        if record.cost_usd is None:   # (a fan-out's is its branches' sum, set before)
            record.cost_usd = self.cost(record)
        held = self._reserved.pop(record.id, None)
        if held is not None:
            self._reserved_by[held[0]] -= held[1]
            if self._reserved_by[held[0]] <= 1e-12:
                del self._reserved_by[held[0]]
        if record.route != CHECK_ROUTE:
            self._add(record.client, self.clock.wall(record.started_at), record.usage,
                      record.cost_usd)
        self._confirmed.pop(record.id, None)
        if (self.shared is not None and record.route != CHECK_ROUTE
                and self.client(record.client).spend_limited):
            day, month = _windows(self.clock.wall(trio.current_time()))
            self.shared.spent_soon(record.client, self.relay_id, day, month,
                                   self._mine(record.client), record.id)

    def _mine(self, client: str) -> tuple[float, int, float]:
        """This relay's own spend of ``client``: dollars today, tokens today, dollars
        this month (UTC)."""
        day, month = _windows(self.clock.wall(trio.current_time()))
        today = self._spent.get((client, day), _Spent())
        return today.usd, today.tokens, self._spent.get((client, month), _Spent()).usd

    async def confirm(self, name: str, request_id: str) -> None:
        """Admit a request of client ``name`` across relays (SPEC L11): every relay's
        spend and running reservations on the coordination server, under its per-day and
        per-month limits; its estimated dollars reserved there. Once per request (its
        first attempt); nothing without a server or a limit, or when the server cannot be
        asked (this relay's own admission stands).

        Raises:
            RelayError: ``client_limit``, Retry-After the window's reset.
        """
        client = self.client(name)
        shared = self.shared
        if shared is None or not client.spend_limited or request_id in self._confirmed:
            await trio.lowlevel.checkpoint()
            return
        now = self.clock.wall(trio.current_time())
        day, month = _windows(now)
        estimate = self._reserved.get(request_id, (name, 0.0))[1]
        said = await shared.admit(name, self.relay_id, day, month, self._mine(name),
                                  request_id, estimate,
                                  (client.usd_per_day, client.usd_per_month,
                                   float(client.tokens_per_day)))
        if said is None:
            return
        if said.ok:
            self._confirmed[request_id] = name
            if len(self._confirmed) > 4096:  # (a fan-out's branches have no record)
                del self._confirmed[next(iter(self._confirmed))]
            return
        self._refuse(client, now, _Spent(said.tokens_today, said.usd_today),
                     _Spent(0, said.usd_this_month), said.reserved, " across relays")

    def cost(self, record: Record) -> float | None:
        """What ``record``'s usage cost at its provider's price for its model."""
        provider = (self._config().providers.get(record.provider) if record.provider
                    else None)
        if provider is None or record.model is None or not record.usage:
            return None
        return cost_of(record.usage, price_for(provider, record.model))

    def _add(self, client: str, wall: float, usage: dict[str, Any] | None,
             cost: float | None) -> None:
        tokens = _tokens(usage)
        if not tokens and not cost:
            return
        day, month = _windows(wall)
        today, this_month = _windows(self.clock.wall(trio.current_time()))
        for window, current in ((day, today), (month, this_month)):
            if window >= current:   # (a request begun in a window that has ended: gone)
                spent = self._spent.setdefault((client, window), _Spent())
                spent.tokens += tokens
                spent.usd += cost or 0.0

    def spent(self, client: str) -> dict[str, float]:
        """What ``client`` spent today and this month (UTC), and holds reserved."""
        day, month = _windows(self.clock.wall(trio.current_time()))
        today = self._spent.get((client, day), _Spent())
        this_month = self._spent.get((client, month), _Spent())
        return {"tokens_today": today.tokens, "usd_today": round(today.usd, 6),
                "usd_this_month": round(this_month.usd, 6),
                "usd_reserved": round(self._reserved_by.get(client, 0.0), 6)}

    def admit(self, client: ClientConfig, request_id: str, estimate_usd: float | None) -> None:
        """Admit a request of ``client`` under its per-day and per-month limits, and
        reserve its estimated cost; ``client_limit`` (429) when a window is spent.

        Raises:
            RelayError: ``client_limit``, Retry-After the window's reset.
        """
        if not client.spend_limited:
            return
        now = self.clock.wall(trio.current_time())
        self._prune(now)
        day, month = _windows(now)
        self._refuse(client, now, self._spent.get((client.name, day), _Spent()),
                     self._spent.get((client.name, month), _Spent()),
                     self._reserved_by.get(client.name, 0.0))
        if estimate_usd and (client.usd_per_day or client.usd_per_month):
            self._reserved[request_id] = (client.name, estimate_usd)
            self._reserved_by[client.name] += estimate_usd

    def _refuse(self, client: ClientConfig, now: float, today: _Spent, this_month: _Spent,
                reserved: float, where: str = "") -> None:
        """``client_limit`` when a window of ``client`` is spent (``where``: the spend
        is every relay's)."""
        day_end, month_end = _resets(now)
        over: list[tuple[str, str, float]] = []
        if client.tokens_per_day and today.tokens >= client.tokens_per_day:
            over.append(("tokens_per_day", f"{today.tokens} tokens today of its "
                         f"{client.tokens_per_day}", day_end))
        if client.usd_per_day and today.usd + reserved >= client.usd_per_day:
            over.append(("usd_per_day", f"${today.usd + reserved:.4f} today (running "
                         f"requests' estimates included) of its ${client.usd_per_day:g}",
                         day_end))
        if client.usd_per_month and this_month.usd + reserved >= client.usd_per_month:
            over.append(("usd_per_month", f"${this_month.usd + reserved:.4f} this month "
                         f"(running requests' estimates included) of its "
                         f"${client.usd_per_month:g}", month_end))
        if over:
            reset = max(end for _, _, end in over)
            keys = ", ".join(key for key, _, _ in over)
            when = dt.datetime.fromtimestamp(reset, tz=dt.UTC).strftime("%Y-%m-%dT%H:%MZ")
            raise RelayError(
                "client_limit", f"client {client.name!r} has used its limit for now"
                f"{where}: {'; '.join(said for _, said, _ in over)}; it resets at {when} "
                "(UTC)", retry_after_s=max(1.0, math.ceil(reset - now)),
                action=f"wait for the reset, or raise {keys} in [clients.{client.name}]")

    def reserve_more(self, client: ClientConfig, request_id: str, usd: float | None) -> None:
        """One more estimate for an admitted request (a fan-out's next branch)."""
        if usd and (client.usd_per_day or client.usd_per_month):
            name, held = self._reserved.get(request_id, (client.name, 0.0))
            self._reserved[request_id] = (name, held + usd)
            self._reserved_by[name] += usd

    def _prune(self, now: float) -> None:
        day, month = _windows(now)
        for key in [k for k in self._spent if k[1] not in (day, month)]:
            del self._spent[key]

    def estimate_usd(self, provider: ProviderConfig, call: Call,
                     learned: int | None) -> float | None:
        """A request's estimated cost at its start: relay's estimate of its input at the
        input price, its output reservation at the output price."""
        price = price_for(provider, call.model)
        provider_max = getattr(provider.settings, "max_tokens", None)
        out = output_reservation(call, learned,
                                 provider_max if isinstance(provider_max, int) else None)
        return cost_of({"prompt_tokens": estimate_input(call), "completion_tokens": out},
                       price)

    # --- restart -------------------------------------------------------------------------
    def seed(self, path: Path | None, keep: int) -> int:
        """Count this month's records (the file and its rotated ones) into the clients'
        windows, so a restart does not reset their limits. Reads only files written to
        this month; a line that does not parse is skipped. Returns the records counted."""
        config = self._config()
        if path is None or not any(c.spend_limited for c in config.clients.values()):
            return 0
        now = self.clock.wall(trio.current_time())
        month_start = dt.datetime.fromtimestamp(now, tz=dt.UTC).replace(
            day=1, hour=0, minute=0, second=0, microsecond=0)
        since = month_start.strftime("%Y-%m-%dT%H:%M:%S")
        counted = 0
        for file in [path.with_name(f"{path.name}.{i}") for i in range(keep, 0, -1)] + [path]:
            try:
                if file.stat().st_mtime < month_start.timestamp():
                    continue
                lines = file.read_bytes().splitlines()
            except OSError:
                continue
            for line in lines:
                entry = _entry(line)
                if entry is None or str(entry.get("started_at") or "") < since:
                    continue
                if entry.get("route") == CHECK_ROUTE:
                    continue
                try:
                    started = dt.datetime.fromisoformat(
                        str(entry["started_at"]).replace("Z", "+00:00")).timestamp()
                except ValueError:
                    continue
                cost = entry.get("cost_usd")
                self._add(str(entry.get("client") or "default"), started,
                          entry.get("usage") if isinstance(entry.get("usage"), dict) else None,
                          cost if isinstance(cost, int | float) else None)
                counted += 1
        return counted


def _entry(line: bytes) -> dict[str, Any] | None:
    if b'"client"' not in line:   # (written before clients: nobody's limit)
        return None
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None


def _tokens(usage: dict[str, Any] | None) -> int:
    if not usage:
        return 0
    total = usage.get("total_tokens")
    if isinstance(total, int):
        return total
    return sum(v for k in ("prompt_tokens", "completion_tokens")
               if isinstance(v := usage.get(k), int))

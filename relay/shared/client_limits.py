"""A client's limits across relays (SPEC L14 with L11): what relays with one coordination
server count of each client together, on the server (`client_scripts`).

Theory of operation. With ``[server] coordination_url`` set, relay keeps on the server
what must hold for a client whichever relay its requests reach:

- the per-minute limits (``rpm``, ``tpm``): the head of the client's gate on a relay
  (`relay.engine.gate`) asks `start`; the server counts the start (and its tokens) or
  says how long to wait, which the gate waits exactly as it waits for its own limits
  (its notices name the limit; its queue timeout's Retry-After is that wait);
- the per-day and per-month limits (``usd_per_day``, ``usd_per_month``,
  ``tokens_per_day``): `admit` sums every relay's spend and every admitted request's
  reservation on the server, refusing (``client_limit``) as one relay would, and
  reserves the request's estimate; `spent` writes this relay's own spend (its records'
  total) and ends the reservation when the request's record is written.

``lanes`` (a client's requests running at once) stays per relay: counting it across
relays would need leases renewed like a shared slot's (a relay that died would else hold
its count for ever). A reservation lasts `RESERVE_S` unless settled first (its relay
died). When the server cannot be reached, each relay counts on its own (logged once per
outage) rather than refuse the client's requests: the limits then hold per relay only.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs

from relay.vocab.errors import RelayError

from .coordinator import Coordinator

__all__ = ["RESERVE_S", "Admitted", "SharedClientLimits"]

logger = logging.getLogger(__name__)

RESERVE_S = 3600.0  # how long a request's dollar reservation lasts unless settled


@attrs.frozen
class Admitted:
    """Every relay's spend of a client, as the server summed it at an admission."""

    ok: bool
    usd_today: float
    tokens_today: int
    usd_this_month: float
    reserved: float


class SharedClientLimits:
    """Clients' limits kept on the coordination server (see the module docstring)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coord = coordinator
        self._warned = False

    @property
    def command_timeout_s(self) -> float:
        return self._coord.command_timeout_s

    def new_member(self) -> str:
        return self._coord.new_member()

    def _base(self, client: str) -> str:
        return "{" + f"{self._coord.prefix}:client:{client}" + "}"

    def _spend_keys(self, client: str, day: str, month: str) -> list[str]:
        base = self._base(client)
        return [f"{base}:d:{day}", f"{base}:mo:{month}", f"{base}:r", f"{base}:rs",
                f"{base}:who"]

    async def _call(self, script: str, keys: list[str], args: list[Any], client: str
                    ) -> Any | None:
        """A script's reply; None when the server could not be reached (logged)."""
        try:
            reply = await self._coord.call(script, keys, args, provider=f"client {client}")
        except RelayError:
            if not self._warned:
                self._warned = True
                logger.warning("client limits: the coordination server is unreachable "
                               "(%s); each relay counts its clients' limits on its own "
                               "until it is back", self._coord.down_reason)
            return None
        self._warned = False
        return reply

    async def start(self, client: str, member: str, tokens: int, rpm: float, tpm: float
                    ) -> tuple[str, float, float] | None:
        """Count a start of ``client`` (with its estimated ``tokens``) against its
        per-minute limits across relays: ``("ok", 0, 0)``, or what holds it back
        (``"rpm"`` or ``"tpm"``), the seconds to wait, and the starts or tokens of the
        last minute; None when the server could not be asked."""
        reply = await self._call("CLIENT_START", [f"{self._base(client)}:min"],
                                 [member, int(tokens), repr(float(rpm)), repr(float(tpm))],
                                 client)
        if reply is None:
            return None
        return str(reply[0]), int(reply[1]) / 1000, float(reply[2])

    def used_soon(self, client: str, member: str, estimate: int, used: int) -> None:
        """`used`, in the coordinator's nursery (the gate's exit does not wait)."""
        self._coord.start_soon(self.used, client, member, estimate, used)

    def spent_soon(self, client: str, relay_id: str, day: str, month: str,
                   mine: tuple[float, int, float], request_id: str) -> None:
        """`spent`, in the coordinator's nursery (a record is written synchronously)."""
        self._coord.start_soon(self.spent, client, relay_id, day, month, mine, request_id)

    async def used(self, client: str, member: str, estimate: int, used: int) -> None:
        """A start's tokens, settled to what it used."""
        await self._call("CLIENT_USED", [f"{self._base(client)}:min"],
                         [member, int(estimate), int(used)], client)

    async def admit(self, client: str, relay_id: str, day: str, month: str,
                    mine: tuple[float, int, float], request_id: str, estimate: float,
                    limits: tuple[float, float, float]) -> Admitted | None:
        """Sum every relay's spend of ``client`` and the reservations of the requests
        admitted before, write this relay's own (``mine``: dollars today, tokens today,
        dollars this month), and reserve ``estimate`` unless a limit (``limits``:
        dollars a day, a month, tokens a day; 0 for none) is spent. None when the server
        could not be asked."""
        reply = await self._call(
            "CLIENT_ADMIT", self._spend_keys(client, day, month),
            [relay_id, repr(float(mine[0])), int(mine[1]), repr(float(mine[2])), request_id,
             repr(float(estimate)), int(RESERVE_S * 1000), *(repr(float(x)) for x in limits)],
            client)
        if reply is None:
            return None
        return Admitted(reply[0] == "ok", float(reply[1]), int(float(reply[2])),
                        float(reply[3]), float(reply[4]))

    async def spent(self, client: str, relay_id: str, day: str, month: str,
                    mine: tuple[float, int, float], request_id: str) -> None:
        """Write this relay's spend of ``client`` (its total) and end the request's
        reservation: its record is written."""
        await self._call("CLIENT_SPENT", self._spend_keys(client, day, month),
                         [relay_id, repr(float(mine[0])), int(mine[1]), repr(float(mine[2])),
                          request_id], client)

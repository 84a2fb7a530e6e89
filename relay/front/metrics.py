"""Prometheus metrics for one relay: ``GET /metrics`` (issue 8).

Each relay has its own registry (never prometheus_client's global one), so two relays
in one process — an embedding program, or the tests — never share or collide. Two kinds
of numbers:

- **Gauges read at scrape time** by a collector: every provider's lanes (running,
  capacity, queued, queue_max, the same numbers as ``/relay/v1/status``), its state, the
  requests in flight, and whether relay is draining. Nothing is cached, so a scrape and a
  status call made together agree.
- **Counters and histograms fed by the records.** Every request ends in exactly one
  record (DESIGN invariant 5), so `Metrics.observe` — called by the record writer for
  each record — is the single place they are counted: requests by provider, status and
  reason; queue and run time; stops and their release lag (from the stop being asked to
  the last lane being given back, SPEC C4). Connection checks are counted apart
  (``relay_checks_total``) so that client traffic stays readable.

relay counts itself (a dict entry per label set, a bucket found by bisection); a scrape
hands the counts to prometheus_client, which writes the text format. prometheus_client
is imported by the first scrape, not at start (~3 MB and ~20 ms that a relay nobody
scrapes never spends), and counting costs no lock.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from relay.engine.engine import Engine
from relay.vocab.records import Record

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["CONTENT_TYPE", "Metrics"]

# The classic text format, which every Prometheus-compatible scraper reads
# (prometheus_client's CONTENT_TYPE_PLAIN_0_0_4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STATES = ("unverified", "connected", "warning", "failing")
NO_PROVIDER = "none"  # a request refused before it named a provider (bad model, guard)

# Seconds. Queues wait from milliseconds to the 10 minutes a CLI lane may ask (SPEC L5);
# runs last from a local model's second to a CLI tool's ten minutes.
QUEUE_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
RUN_BUCKETS = (0.05, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200)
# A stop should release its lane at once for HTTP adapters; CLI tools take up to their
# interrupt grace (5 s by default), then a kill.
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


# relay_tokens_total's kinds, and the keys of a record's usage they are read from.
_KINDS = (("input", "prompt_tokens"), ("output", "completion_tokens"),
          ("cache_read", "cache_read_tokens"), ("cache_write", "cache_write_tokens"))


class _Counter:
    """A counter family: one value per label set."""

    def __init__(self, name: str, doc: str, labels: list[str]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def family(self) -> Metric:
        from prometheus_client.core import CounterMetricFamily
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for labels, number in self.values.items():
            family.add_metric(list(labels), number)
        return family


class _Histogram:
    """A histogram family: per label set, the count in each bucket and the sum."""

    def __init__(self, name: str, doc: str, labels: list[str],
                 buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.labels, self.buckets = name, doc, labels, buckets
        self.counts: dict[tuple[str, ...], list[int]] = {}
        self.sums: dict[tuple[str, ...], float] = {}

    def observe(self, value: float, *labels: str) -> None:
        counts = self.counts.setdefault(labels, [0] * (len(self.buckets) + 1))
        counts[bisect_left(self.buckets, value)] += 1  # le: a value on a bound is in it
        self.sums[labels] = self.sums.get(labels, 0.0) + value

    def family(self) -> Metric:
        from prometheus_client.core import HistogramMetricFamily
        from prometheus_client.utils import floatToGoString
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        bounds = [*map(floatToGoString, self.buckets), "+Inf"]
        for labels, counts in self.counts.items():
            cumulative = list(zip(bounds, map(float, accumulate(counts)), strict=True))
            family.add_metric(list(labels), cumulative, self.sums[labels])
        return family


class Metrics:
    """The metrics of one relay."""

    def __init__(self, relay: Engine) -> None:
        self.relay = relay
        self.requests = _Counter(
            "relay_requests", "Requests ended, by provider, HTTP status and reason "
            "(reason 'ok' when answered)", ["provider", "status", "reason"])
        self.checks = _Counter(
            "relay_checks", "Connection checks ended, by provider and reason ('ok' when "
            "answered)", ["provider", "reason"])
        self.queue_seconds = _Histogram(
            "relay_queue_seconds", "Time a request waited for a lane (pacer and queue)",
            ["provider"], QUEUE_BUCKETS)
        self.run_seconds = _Histogram(
            "relay_run_seconds", "Time a request held a lane", ["provider"], RUN_BUCKETS)
        self.stops = _Counter(
            "relay_stops", "Requests stopped before they completed (client gone, timeout, "
            "shutdown), by provider and reason", ["provider", "reason"])
        self.release_lag = _Histogram(
            "relay_stop_release_lag_seconds", "From a stop being asked to the request's "
            "last lane being released", ["provider"], LAG_BUCKETS)
        self.tokens_used = _Counter(
            "relay_tokens_used", "Tokens requests used at providers (their reported usage; "
            "relay's estimate where none was reported), SPEC L12", ["provider"])
        self.tokens = _Counter(
            "relay_tokens", "Tokens of the requests' usage (kind: input — the whole prompt, "
            "cache included — output, cache_read, cache_write), by client, provider and "
            "model, connection checks included (SPEC O7)",
            ["client", "provider", "model", "kind"])
        self.cost = _Counter(
            "relay_cost_usd", "US dollars the requests cost, where their price is known, by "
            "client, provider and model (SPEC O7)", ["client", "provider", "model"])
        self.token_wait = _Histogram(
            "relay_token_wait_seconds", "Of a request's queue time, how long it waited "
            "for its provider's token budget or hold (SPEC L12)", ["provider"],
            QUEUE_BUCKETS)
        self._registry: Any = None  # prometheus_client's, made by the first scrape

    def observe(self, record: Record) -> None:
        """Count one ended request (the record writer calls this for every record)."""
        provider = record.provider or NO_PROVIDER
        reason = record.reason or "ok"
        if record.usage or getattr(record, "cost_usd", None) is not None:
            self._usage(record, provider)
        if record.route == "(check)":
            self.checks.inc(provider, reason)
            return
        self.requests.inc(provider, str(record.status), reason)
        if record.queue_ms is not None:
            self.queue_seconds.observe(record.queue_ms / 1000, provider)
        if record.run_ms is not None:
            self.run_seconds.observe(record.run_ms / 1000, provider)
        if record.tokens_used:
            self.tokens_used.inc(provider, amount=record.tokens_used)
        if record.token_wait_ms is not None:
            self.token_wait.observe(record.token_wait_ms / 1000, provider)
        if record.stop_requested_at is not None:
            self.stops.inc(provider, reason)
            if record.released_at is not None:  # None: it was stopped before it held a lane
                lag = max(0.0, record.released_at - record.stop_requested_at)
                self.release_lag.observe(lag, provider)

    def _usage(self, record: Record, provider: str) -> None:
        """SPEC O7: the record's tokens by kind, and its cost when known (``client`` and
        ``cost_usd`` are read where the record has them: ``default``, unknown)."""
        client = getattr(record, "client", None) or "default"
        model = record.model or ""
        usage = record.usage or {}
        for kind, key in _KINDS:
            count = usage.get(key)
            if type(count) is int and count > 0:
                self.tokens.inc(client, provider, model, kind, amount=count)
        cost = getattr(record, "cost_usd", None)
        if isinstance(cost, int | float) and not isinstance(cost, bool) and cost >= 0:
            self.cost.inc(client, provider, model, amount=float(cost))

    def render(self) -> bytes:
        """The Prometheus text exposition of everything above."""
        from prometheus_client import CollectorRegistry, generate_latest
        if self._registry is None:
            # Each relay has its own registry, never prometheus_client's global one.
            self._registry = CollectorRegistry(auto_describe=False)
            self._registry.register(_LiveCollector(self))
        return generate_latest(self._registry)


def _budget_families(relay: Engine) -> Iterator[Metric]:
    """SPEC L12: each provider's token budgets (limit, remaining, where the figure comes
    from), tokens used in the last minute, and the seconds left of a hold."""
    from prometheus_client.core import GaugeMetricFamily
    limit = GaugeMetricFamily("relay_token_budget_limit", "A provider's budget per "
                              "minute (budget: requests, tokens, input, output; source: "
                              "configured or header; model: the model's own budget, \"\" the "
                              "account's; account: \"\" for a provider without accounts)",
                              labels=["provider", "account", "model", "budget", "source"])
    remaining = GaugeMetricFamily("relay_token_budget_remaining", "What relay counts as "
                                  "left of the budget now",
                                  labels=["provider", "account", "model", "budget"])
    used = GaugeMetricFamily("relay_tokens_last_minute", "Tokens used at the provider in "
                             "the last minute", labels=["provider"])
    hold = GaugeMetricFamily("relay_provider_hold_seconds", "Seconds left of the "
                             "provider's (account's) hold on every start of the model "
                             "(\"\": of every model; 0: none)",
                             labels=["provider", "account", "model"])
    for name, provider in relay.providers.items():
        status = provider.budgets()
        if status is None:
            continue
        # SPEC L13: each account's (one, "", without accounts); L12a: the account's
        # budgets (model "") and each model's own.
        accounts = [(a["name"], a["budgets"]) for a in provider.accounts(relay.clock)
                    ] if provider.config.accounts else [("", status)]
        for account, budgets in accounts:
            for model, figures_of in (("", budgets), *budgets.get("models", {}).items()):
                for kind, figures in figures_of["budgets"].items():
                    limit.add_metric([name, account, model, kind, figures["source"]],
                                     figures["limit_per_minute"])
                    remaining.add_metric([name, account, model, kind],
                                         figures["remaining"])
                hold.add_metric([name, account, model],
                                figures_of["hold"]["left_s"] if figures_of["hold"] else 0.0)
        used.add_metric([name], status["used_last_minute"])
    yield from (limit, remaining, used, hold)
    yield from _account_families(relay)


def _account_families(relay: Engine) -> Iterator[Metric]:
    """SPEC L13: each account's lanes and state (providers with accounts)."""
    from prometheus_client.core import GaugeMetricFamily
    labels = ["provider", "account"]
    running = GaugeMetricFamily("relay_account_running", "Requests on the account's "
                                "lane slots", labels=labels)
    capacity = GaugeMetricFamily("relay_account_capacity", "The account's lane slots",
                                 labels=labels)
    state = GaugeMetricFamily("relay_account_state", "1 for the account's current state "
                              "(ok, held, out)", labels=[*labels, "state"])
    for name, provider in relay.providers.items():
        if not provider.config.accounts:
            continue
        for account in provider.accounts(relay.clock):
            running.add_metric([name, account["name"]], account.get("running", 0))
            capacity.add_metric([name, account["name"]], account.get("capacity", 0))
            for each in ("ok", "held", "out"):
                state.add_metric([name, account["name"], each],
                                 1.0 if account.get("state") == each else 0.0)
    yield from (running, capacity, state)


class _LiveCollector:
    """What a scrape reads: the counted families as they stand, then gauges computed
    from the relay's current providers."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return list(self._families())  # the names, without reading any lane

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.samples import Sample
        m = self.metrics
        for counted in (m.requests, m.checks, m.queue_seconds, m.run_seconds, m.stops,
                        m.release_lag, m.tokens_used, m.token_wait, m.tokens, m.cost):
            yield counted.family()
        families = self._families()
        running, capacity, queued, queue_max, state, in_flight, draining, held = families
        relay = m.relay
        for name, provider in relay.providers.items():
            stats = provider.lane.statistics()
            # SPEC L11: a shared lane's numbers are every relay's; ``scope="global"``
            # says so, so that a dashboard does not sum them across relays.
            labels = {"provider": name, **({"scope": "global"} if provider.lane.shared
                                           else {})}
            for family, number in ((running, stats.running), (capacity, stats.capacity),
                                   (queued, stats.queued), (queue_max, stats.queue_max)):
                family.samples.append(Sample(family.name, labels, number))
            held.add_metric([name], provider.lane.held_here)
            for each in STATES:
                state.add_metric([name, each], 1.0 if provider.state == each else 0.0)
        in_flight.add_metric([], len(relay.in_flight))
        draining.add_metric([], 1.0 if relay.draining else 0.0)
        yield from families
        yield from _budget_families(relay)

    @staticmethod
    def _families() -> tuple[Any, ...]:
        from prometheus_client.core import GaugeMetricFamily
        lane = ["provider"]
        return (
            GaugeMetricFamily("relay_lane_running", "Requests holding a lane slot",
                              labels=lane),
            GaugeMetricFamily("relay_lane_capacity", "Lane slots (the profile's lanes)",
                              labels=lane),
            GaugeMetricFamily("relay_lane_queued", "Requests waiting for a lane slot",
                              labels=lane),
            GaugeMetricFamily("relay_lane_queue_max", "Requests allowed to wait",
                              labels=lane),
            GaugeMetricFamily("relay_provider_state", "1 for the provider's current state",
                              labels=["provider", "state"]),
            GaugeMetricFamily("relay_in_flight", "Requests and checks in flight",
                              labels=[]),
            GaugeMetricFamily("relay_draining", "1 while relay is draining (shutting down)",
                              labels=[]),
            GaugeMetricFamily("relay_lane_held_here", "Lane slots this relay holds (of a "
                              "shared lane: this relay's part)", labels=["provider"]),
        )

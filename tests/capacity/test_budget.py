"""The token budget's rules on the local `Budget` alone, on a clock the test moves (SPEC
L12, L12a; issue 33): a header's remaining at the answering request's grant, settlement
to the reported usage, and the margin at a bucket's edge. The same rules on the shared
scripts: tests/shared/test_budget_rules.py; through the assembled relay:
tests/capacity/test_tokens.py."""

from __future__ import annotations

import random

import pytest
from fakes.fake_metered import Bucket

from relay.capacity import budget as budget_module
from relay.capacity.budget import Budget, Need, Reservation
from relay.vocab.limits import RateLimits, Window
from relay.vocab.profile import Profile


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def profile(**figures: float) -> Profile:
    return Profile(lanes=8, queue_max=8, queue_timeout_s=60, run_timeout_s=60, **figures)


def free(budget: Budget) -> dict[str, int]:
    return {k: v["remaining"] for k, v in budget.status(lambda t: None)["budgets"].items()}


def granted(budget: Budget, need: Need) -> Reservation:
    assert budget.wait_s(need) == 0
    r = budget.reserve(need)
    assert r is not None
    return r


def test_a_bursts_header_does_not_take_off_what_was_granted_before_the_answering_one(
        ) -> None:
    # Eight requests queued at once and granted 0.1 s apart (400 in, max_tokens 1,000).
    # The answer of the sixth says what the provider admitted: the first six, their
    # output reservations too (OpenAI counts max_tokens; Anthropic estimates output from
    # it at the start), and 5,000 another client of the key spent. Relay takes off the
    # seventh and eighth only: 30,000 - 5,000 - 8 * 1,400.
    clock = Clock()
    budget = Budget(profile(tpm=30_000), clock)
    burst = []
    for _ in range(8):
        burst.append(granted(budget, Need(400, 1_000)))
        clock.now += 0.1
    clock.now = 0.8
    said = RateLimits({"tokens": Window(limit=30_000, remaining=25_000 - 6 * 1_400)})
    budget.observe(said, started_at=burst[5].at, ok=True, own=burst[5])
    assert free(budget) == {"tokens": 25_000 - 8 * 1_400}
    # The six are counted: their settlement gives back only the output they did not use.
    for r in burst[:6]:
        assert r.counted == {"tokens"}
    assert not burst[6].counted and not burst[7].counted


def test_an_over_estimate_is_given_back_after_a_header() -> None:
    clock = Clock()
    budget = Budget(profile(itpm=60_000), clock)
    a = granted(budget, Need(10_000, 1_000))
    clock.now = 1.0
    b = granted(budget, Need(10_000, 1_000))
    clock.now = 2.0
    # (below relay's 42,000: another client of the key spent some)
    budget.observe(RateLimits({"input": Window(60_000, 38_000)}), started_at=a.at, ok=True,
                   own=a)
    assert free(budget) == {"input": 28_000}  # 38,000 less b, granted after a
    budget.settle(b, 4_000, 1_000)  # b's 6,000 over-estimate comes back
    budget.settle(a, 4_000, 1_000)  # a's real input is in the header's figure already
    assert free(budget) == {"input": 34_000}
    # A header that sets nothing (above relay's count) counts nothing: settled whole.
    c = granted(budget, Need(10_000, 1_000))
    clock.now = 3.0
    budget.observe(RateLimits({"input": Window(60_000, 59_000)}), started_at=c.at, ok=True,
                   own=c)
    budget.settle(c, 3_000, 1_000)
    assert free(budget) == {"input": 34_000 - 3_000 + 1_000}


@pytest.mark.parametrize("margin", [budget_module.EDGE_MARGIN, 0.0])
def test_the_margin_at_the_edge_keeps_a_provider_on_a_later_clock_from_a_429(
        monkeypatch: pytest.MonkeyPatch, margin: float) -> None:
    # A provider metering 12,000 input tokens a minute (the fake's own bucket) admits
    # each request 0.3 s after relay granted it and counts each prompt 2 tokens more than
    # relay's estimate (it rounds otherwise); relay is configured to the provider's very
    # figure, no headers. With the margin no request meets a full bucket; without it,
    # relay runs the bucket to its last token and the provider refuses (the control).
    monkeypatch.setattr(budget_module, "EDGE_MARGIN", margin)
    rng = random.Random(33)
    clock = Clock()
    budget = Budget(profile(itpm=12_000), clock)
    provider = Bucket(12_000)
    refused = 0
    pending: list[tuple[float, Need, Reservation]] = []  # granted, not yet admitted
    t = 0.0
    while t < 600:
        need = Need(rng.choice([100, 400, 1_500, 3_000]), 0)
        wait = budget.wait_s(need)
        clock.now = t = t + wait + rng.uniform(0.0, 0.2)
        for at, n, r in [p for p in pending if p[0] <= t]:  # the provider admits them
            pending.remove((at, n, r))
            if provider.wait_s(at, n.input + 2) > 0:
                refused += 1
                budget.settle(r, 0, 0)
                continue
            provider.level -= n.input + 2
            budget.settle(r, n.input + 2, 0)
        if budget.wait_s(need) == 0:
            pending.append((t + 0.3, need, granted(budget, need)))
    if margin:
        assert refused == 0
    else:
        assert refused > 0

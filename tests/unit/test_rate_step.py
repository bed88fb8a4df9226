"""The limiter's one step (``contract.rate_step``), on a clock given by hand: what every
backend's port of it (the Redis script, the SQL and MongoDB ones to come) must answer."""

from __future__ import annotations

import pytest

from aio_keuss.contract import RateGrant, RateRule, RateState, rate_step

T0 = 1_700_000_000.0


def _steps(
    rule: RateRule, calls: list[tuple[float, int, float]]
) -> tuple[RateState, list[RateGrant]]:
    """(seconds after T0, count, hold) calls in turn, from no state."""
    state, grants = RateState(), []
    for at, count, hold in calls:
        state, grant = rate_step(state, T0 + at, rule, count, hold)
        grants.append(grant)
    return state, grants


def test_an_idle_limiter_grants_a_burst_then_waits_for_the_next() -> None:
    rule = RateRule(limit=5, period=10.0, burst=5)  # one every 2 s
    _, grants = _steps(rule, [(0, 20, 0), (0, 20, 0), (1, 1, 0), (2, 20, 0)])
    assert [g.granted for g in grants] == [5, 0, 0, 1]
    assert grants[0].wait == pytest.approx(2.0)  # the next one falls due a period / limit on
    assert grants[1].wait == pytest.approx(2.0)
    assert grants[2].wait == pytest.approx(1.0)
    assert grants[3].wait == pytest.approx(2.0)


def test_a_take_gets_no_more_than_it_asks() -> None:
    _, grants = _steps(RateRule(5, 10.0, 5), [(0, 2, 0), (0, 2, 0), (0, 2, 0)])
    assert [g.granted for g in grants] == [2, 2, 1]
    assert grants[1].wait == 0.0  # one is still due


def test_a_burst_of_one_spaces_the_grants_evenly() -> None:
    rule = RateRule(2, 1.0, 1)
    _, grants = _steps(rule, [(0, 5, 0), (0.25, 5, 0), (0.5, 5, 0), (0.75, 5, 0), (10, 5, 0)])
    assert [g.granted for g in grants] == [1, 0, 1, 0, 1]  # at 0, 0.5, and later


def test_a_quiet_while_refills_no_more_than_the_burst() -> None:
    _, grants = _steps(RateRule(5, 10.0, 3), [(0, 10, 0), (1000, 10, 0)])
    assert [g.granted for g in grants] == [3, 3]


def test_grants_given_back_are_granted_again_but_never_lent() -> None:
    rule = RateRule(3, 3600.0, 3)
    state, grants = _steps(rule, [(0, 3, 0), (0, -2, 0), (0, 5, 0)])
    assert [g.granted for g in grants] == [3, 0, 2]
    # giving back more than was taken lends nothing: the next take still gets a burst only
    _, grants = _steps(rule, [(0, -100, 0), (0, 10, 0)])
    assert [g.granted for g in grants] == [0, 3]
    assert state.tat == pytest.approx(T0 + 3 * 1200.0)


def test_a_hold_stops_every_grant_until_it_ends_and_a_give_back_does_not_shorten_it() -> None:
    rule = RateRule(10, 1.0, 10)
    _, grants = _steps(
        rule, [(0, 1, 0), (0, 0, 30.0), (1, 5, 0), (1, -1, 0), (29.9, 1, 0), (30, 4, 0)]
    )
    assert [g.granted for g in grants] == [1, 0, 0, 0, 0, 4]
    assert grants[1].wait == pytest.approx(30.0)
    assert grants[2].wait == pytest.approx(29.0)
    assert grants[3].wait == pytest.approx(29.0)
    # a shorter hold does not cut a longer one
    state, _ = _steps(rule, [(0, 0, 30.0), (1, 0, 5.0)])
    assert state.until == pytest.approx(T0 + 30.0)


def test_the_wait_answered_is_when_the_next_take_gets_one() -> None:
    """A consumer sleeping for the answered wait (never less) gets a grant when it wakes:
    the rounding slack keeps a float's error from answering nothing then."""
    rule = RateRule(7, 3.0, 2)
    now = T0
    state, grant = rate_step(RateState(), now, rule, 10, 0.0)
    assert grant.granted == 2
    for _ in range(50):
        assert grant.wait > 0
        now += grant.wait
        state, grant = rate_step(state, now, rule, 10, 0.0)
        assert grant.granted == 1
        _, none = rate_step(state, now + grant.wait * 0.99, rule, 10, 0.0)
        assert none.granted == 0


def test_grants_given_back_late_give_back_only_what_is_still_ahead() -> None:
    """A take's grants given back after their time went by (its store round trip was slow)
    must not lend the grants of the takes made since: the step moved the limiter's time on
    for them, and taking the give-back's intervals off the end of it handed out a second
    burst at once (a burst of one: two deliveries together)."""
    rule = RateRule(10, 10.0, 1)  # one a second
    state, first = rate_step(RateState(), T0, rule, 1, 0.0)  # A: granted, its grant ends at 1
    assert first.granted == 1 and first.end == pytest.approx(T0 + 1.0)
    state, other = rate_step(state, T0 + 1.5, rule, 1, 0.0)  # B, once A's second went by
    assert other.granted == 1
    state, _ = rate_step(state, T0 + 1.5, rule, -1, 0.0, end=first.end)  # A found nothing
    _, after = rate_step(state, T0 + 1.5, rule, 1, 0.0)
    assert after.granted == 0  # before: 1, beside B's of this very instant
    # given back at once, all of it is ahead: granted again
    state, taken = rate_step(RateState(), T0, RateRule(3, 3600.0, 3), 3, 0.0)
    state, _ = rate_step(state, T0, RateRule(3, 3600.0, 3), -2, 0.0, end=taken.end)
    _, again = rate_step(state, T0, RateRule(3, 3600.0, 3), 5, 0.0)
    assert again.granted == 2


def test_the_limiter_counts_the_takes_it_refuses() -> None:
    """A take granted fewer than it asked counts one refusal (``refused``), a take granted
    all, a give-back or a hold none: a give-back whose answer counts more refusals than its
    take's came after a consumer was refused (``Queue._limited`` announces only those)."""
    rule = RateRule(1, 3600.0, 1)
    state, taken = rate_step(RateState(), T0, rule, 1, 0.0)
    assert (taken.granted, taken.refused) == (1, 0)
    state, back = rate_step(state, T0 + 1, rule, -1, 0.0, taken.end)
    assert back.refused == 0  # nobody refused meanwhile: nothing to announce
    state, taken = rate_step(state, T0 + 2, rule, 1, 0.0)
    state, refused = rate_step(state, T0 + 3, rule, 1, 0.0)
    assert (refused.granted, refused.refused) == (0, 1)
    state, back = rate_step(state, T0 + 4, rule, -1, 0.0, taken.end)
    assert back.refused == 1 and back.wait == 0
    state, partial = rate_step(state, T0 + 5, rule, 3, 0.0)
    assert (partial.granted, partial.refused) == (1, 2)
    state, held = rate_step(state, T0 + 6, rule, 0, 60.0)
    assert held.refused == 2

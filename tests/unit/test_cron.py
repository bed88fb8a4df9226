"""The cron parser and the occurrence times of ``Queue.repeat``: pure functions, no server.

Expected instants are written out by hand from a calendar, and a brute-force reference (every
minute of a span, read in the zone) checks the search on expressions and zones with daylight
saving changes in the span.
"""

from __future__ import annotations

import math
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import pytest

from aio_keuss import InvalidDelayError, InvalidInputError
from aio_keuss.cron import Cron, Every, every, parse_cron, zone
from aio_keuss.repeat import RepeatPlan


def _at(text: str, tz: str = "UTC") -> float:
    """Seconds since the epoch of a wall-clock time ``YYYY-MM-DD HH:MM`` in ``tz``."""
    return datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(tz)).timestamp()


def _walls(expression: str, start: str, count: int, tz: str = "UTC") -> list[str]:
    """The ``count`` occurrences after ``start`` as local wall-clock text with offset."""
    schedule = parse_cron(expression, tz)
    t = _at(start, tz)
    out = []
    for _ in range(count):
        t = schedule.next_after(t)
        out.append(datetime.fromtimestamp(t, ZoneInfo(tz)).isoformat(timespec="minutes"))
    return out


@pytest.mark.parametrize(
    ("expression", "start", "expected"),
    [
        ("* * * * *", "2026-05-01 10:07", ["10:08", "10:09", "10:10"]),
        ("*/15 * * * *", "2026-05-01 10:07", ["10:15", "10:30", "10:45"]),
        ("5-20/5 * * * *", "2026-05-01 10:07", ["10:10", "10:15", "10:20"]),
        ("0,30 * * * *", "2026-05-01 10:30", ["11:00", "11:30", "12:00"]),
        ("0 9-17/4 * * *", "2026-05-01 08:00", ["09:00", "13:00", "17:00"]),
        ("59 23 * * *", "2026-05-01 23:59", ["23:59"]),
        ("7 */6 * * *", "2026-05-01 00:07", ["06:07", "12:07", "18:07"]),
        ("0 0-23/12,5 * * *", "2026-05-01 00:00", ["05:00", "12:00", "00:00"]),
    ],
)
def test_minutes_and_hours(expression: str, start: str, expected: list[str]) -> None:
    got = [wall[11:16] for wall in _walls(expression, start, len(expected))]
    assert got == expected


@pytest.mark.parametrize(
    ("expression", "start", "expected"),
    [
        # lists and names, any case
        ("0 0 1,15 * *", "2026-01-10 00:00", ["2026-01-15", "2026-02-01", "2026-02-15"]),
        ("0 12 1 jan,JUL *", "2026-02-01 00:00", ["2026-07-01", "2027-01-01"]),
        ("0 12 1 Mar-May/2 *", "2026-01-01 00:00", ["2026-03-01", "2026-05-01", "2027-03-01"]),
        # 2026-05-01 is a Friday
        ("0 0 * * mon-fri", "2026-05-01 12:00", ["2026-05-04", "2026-05-05"]),
        ("0 0 * * SAT,sun", "2026-05-01 12:00", ["2026-05-02", "2026-05-03", "2026-05-09"]),
        # 0 and 7 are both Sunday
        ("0 0 * * 7", "2026-05-01 12:00", ["2026-05-03", "2026-05-10"]),
        ("0 0 * * 0", "2026-05-01 12:00", ["2026-05-03", "2026-05-10"]),
        ("0 0 * * 5-7", "2026-05-01 12:00", ["2026-05-02", "2026-05-03", "2026-05-08"]),
        ("0 0 * * */3", "2026-05-01 12:00", ["2026-05-02", "2026-05-03", "2026-05-06"]),
        # both day fields restricted: either matches (crontab(5)); the 13th or a Friday
        (
            "0 0 13 * fri",
            "2026-05-01 12:00",
            ["2026-05-08", "2026-05-13", "2026-05-15", "2026-05-22"],
        ),
        # a day field beginning with * leaves AND: odd days that are Fridays
        ("0 0 */2 * fri", "2026-05-01 12:00", ["2026-05-15", "2026-05-29", "2026-06-05"]),
        ("0 0 13 * *", "2026-05-01 12:00", ["2026-05-13", "2026-06-13"]),
        # month ends: months without the day are stepped over
        ("0 0 31 * *", "2026-01-31 00:00", ["2026-03-31", "2026-05-31", "2026-07-31"]),
        ("0 0 30 * *", "2026-01-30 00:00", ["2026-03-30", "2026-04-30"]),
        ("0 0 28-31 * *", "2026-02-27 00:00", ["2026-02-28", "2026-03-28"]),
        # leap day: every four years (2100 is no leap year)
        ("0 0 29 2 *", "2025-01-01 00:00", ["2028-02-29", "2032-02-29"]),
        ("0 0 29 2 *", "2096-03-01 00:00", ["2104-02-29"]),
        # February 29 on a Sunday (AND: the weekday field begins with *)
        ("0 0 29 2 */7", "2026-01-01 00:00", ["2032-02-29", "2060-02-29"]),
        ("@yearly", "2026-05-01 00:00", ["2027-01-01"]),
        ("@monthly", "2026-05-01 00:00", ["2026-06-01"]),
        ("@weekly", "2026-05-01 00:00", ["2026-05-03"]),
        ("@DAILY", "2026-05-01 00:00", ["2026-05-02"]),
        ("@midnight", "2026-05-01 00:00", ["2026-05-02"]),
    ],
)
def test_days_and_months(expression: str, start: str, expected: list[str]) -> None:
    got = [wall[:10] for wall in _walls(expression, start, len(expected))]
    assert got == expected


def test_hourly_nickname_and_year_end() -> None:
    assert _walls("@hourly", "2026-12-31 23:30", 2) == [
        "2027-01-01T00:00+00:00",
        "2027-01-01T01:00+00:00",
    ]
    assert _walls("0 0 1 1 *", "2026-12-31 23:59", 1) == ["2027-01-01T00:00+00:00"]


def test_strictly_after_and_within_the_minute() -> None:
    schedule = parse_cron("30 10 * * *")
    at = _at("2026-05-01 10:30")
    assert schedule.next_after(at - 0.001) == at
    assert schedule.next_after(at) == at + 86400
    assert schedule.next_after(at + 59.9) == at + 86400


def test_dst_gap_is_skipped_madrid() -> None:
    # 2026-03-29: Europe/Madrid jumps from 02:00 to 03:00; 02:30 does not exist that day
    assert _walls("30 2 * * *", "2026-03-28 12:00", 2, "Europe/Madrid") == [
        "2026-03-30T02:30+02:00",
        "2026-03-31T02:30+02:00",
    ]
    # an hourly job loses the skipped hour only
    assert _walls("0 * * * *", "2026-03-29 00:30", 3, "Europe/Madrid") == [
        "2026-03-29T01:00+01:00",
        "2026-03-29T03:00+02:00",
        "2026-03-29T04:00+02:00",
    ]


def test_a_schedule_only_of_skipped_walls_is_refused_for_its_zone() -> None:
    """02:00 on the last Sunday of March is the hour the European Union's zones skip every
    year, so this schedule never fires there: it was refused as one that "matches no date"
    (from a branch whose comment said parse_cron made it unreachable), which it does, in
    any zone. The message now names the zone, whose skipped hour is the reason."""
    expression = "0 2 25-31 3 */7"  # */7 of day-of-week: Sunday, days ANDed
    assert (
        parse_cron(expression, "UTC").next_after(0)
        == datetime(1970, 3, 29, 2, tzinfo=UTC).timestamp()
    )
    berlin = parse_cron(expression, "Europe/Berlin")
    with pytest.raises(InvalidInputError, match="exists in Europe/Berlin"):
        berlin.next_after(datetime(2026, 1, 1, tzinfo=UTC).timestamp())


def test_dst_overlap_fires_once_madrid() -> None:
    # 2026-10-25: Europe/Madrid goes back from 03:00 to 02:00; 02:xx happens twice
    walls = _walls("*/20 * * * *", "2026-10-25 01:30", 8, "Europe/Madrid")
    assert walls == [
        "2026-10-25T01:40+02:00",
        "2026-10-25T02:00+02:00",
        "2026-10-25T02:20+02:00",
        "2026-10-25T02:40+02:00",
        # the second pass of 02:00-02:59 (+01:00) fires nothing
        "2026-10-25T03:00+01:00",
        "2026-10-25T03:20+01:00",
        "2026-10-25T03:40+01:00",
        "2026-10-25T04:00+01:00",
    ]


def test_dst_new_york() -> None:
    # 2026-03-08 02:00 -> 03:00 and 2026-11-01 02:00 -> 01:00 in America/New_York
    assert _walls("30 2 * * *", "2026-03-07 12:00", 2, "America/New_York") == [
        "2026-03-09T02:30-04:00",
        "2026-03-10T02:30-04:00",
    ]
    schedule = parse_cron("30 1 * * *", "America/New_York")
    first = schedule.next_after(_at("2026-10-31 12:00", "America/New_York"))
    assert datetime.fromtimestamp(first, UTC) == datetime(2026, 11, 1, 5, 30, tzinfo=UTC)
    second = schedule.next_after(first)  # not 06:30 UTC, the repeated 01:30 (EST)
    assert datetime.fromtimestamp(second, UTC) == datetime(2026, 11, 2, 6, 30, tzinfo=UTC)
    # asked from inside the repeated hour: the next day's 01:30, not the hour again
    inside = datetime(2026, 11, 1, 6, 10, tzinfo=UTC).timestamp()  # 01:10 EST
    assert schedule.next_after(inside) == second


def _brute(schedule: Cron, start: float, end: float) -> list[float]:
    """Every occurrence in (start, end], minute by minute: a local wall time matching the
    fields, read at its first instant (the second pass of a repeated hour is left out)."""
    out = []
    t = (math.floor(start / 60) + 1) * 60.0
    tz = schedule.tz
    while t <= end:
        local = datetime.fromtimestamp(t, tz)
        if (
            local.fold == 0
            and local.minute in schedule.minutes
            and local.hour in schedule.hours
            and local.month in schedule.months
            and schedule.day_matches(local.date())
        ):
            out.append(t)
        t += 60.0
    return out


@pytest.mark.parametrize(
    ("expression", "tz", "start"),
    [
        ("*/7 1-3 * * *", "Europe/Madrid", "2026-03-28 00:00"),
        ("*/7 1-3 * * *", "Europe/Madrid", "2026-10-24 00:00"),
        ("15,45 * * * *", "America/New_York", "2026-10-31 00:00"),
        ("0,30 0-3 * * sun", "America/New_York", "2026-03-07 00:00"),
        ("*/10 1-3 * * *", "Australia/Lord_Howe", "2026-04-04 00:00"),  # a 30-minute shift
        ("*/10 1-3 * * *", "Australia/Lord_Howe", "2026-10-03 00:00"),
        ("0 * 1,31 * mon", "Asia/Kolkata", "2026-05-30 00:00"),
    ],
)
def test_matches_brute_force(expression: str, tz: str, start: str) -> None:
    schedule = parse_cron(expression, tz)
    begin = _at(start, tz)
    end = begin + 3 * 86400
    expected = _brute(schedule, begin, end)
    assert expected
    got, t = [], begin
    while (t := schedule.next_after(t)) <= end:
        got.append(t)
    assert got == expected


def test_every_is_aligned_to_the_epoch() -> None:
    half = every(0.5)
    assert half == Every(0.5)
    assert half.next_after(10.2) == 10.5
    assert half.next_after(10.5) == 11.0
    assert half.next_after(-0.2) == 0.0
    minute = every(60)
    t = minute.next_after(1_777_777_777.5)
    assert t == 1_777_777_800.0 and t % 60 == 0
    # two processes asking at different moments agree on the instants (and their ids)
    tenth = every(0.1)
    a = tenth.next_after(1_777_777_777.123)
    b = tenth.next_after(1_777_777_777.15)
    assert a == b and round(a * 1000) == 1_777_777_777_200
    for after in (0.3, 0.7, 1e9 + 0.05, 1_777_777_777.3):
        assert tenth.next_after(after) > after
        assert tenth.next_after(after) - after <= 0.1 + 1e-6
    assert every(1).longest_gap(0.0) == 1.0


def test_longest_gap() -> None:
    weekdays = parse_cron("0 9 * * mon-fri")
    assert weekdays.longest_gap(_at("2026-05-01 00:00")) == 3 * 86400
    assert parse_cron("*/5 * * * *").longest_gap(0.0) == 300


@pytest.mark.parametrize(
    ("expression", "tz", "start", "gap"),
    [
        # every minute of 9:00 to 10:59: 10:59 to 9:00 the next day, whenever asked
        ("* 9-10 * * *", "UTC", "2026-06-01 08:59", 22 * 3600 + 60),
        ("* 9-10 * * *", "UTC", "2026-06-01 11:00", 22 * 3600 + 60),
        # every five minutes on Mondays, asked on a Monday morning: Monday 23:55 to the next
        ("*/5 * * * mon", "UTC", "2026-06-01 00:00", 6 * 86400 + 300),
        # every half hour: 90 minutes over the autumn change, months away
        ("*/30 * * * *", "Europe/Madrid", "2026-06-01 00:00", 5400),
        # 2:30 a.m. does not exist on the spring change: two days less an hour, months away
        ("30 2 * * *", "Europe/Madrid", "2026-06-01 00:00", 2 * 86400 - 3600),
        # February 29: eight years across 2100
        (
            "0 0 29 2 *",
            "UTC",
            "2026-06-01 00:00",
            (date(2104, 2, 29) - date(2096, 2, 29)).days * 86400,
        ),
    ],
)
def test_longest_gap_does_not_depend_on_when_it_is_asked(
    expression: str, tz: str, start: str, gap: float
) -> None:
    """The gap compared with dedup_window is the schedule's longest, not the longest of the
    next 64 occurrences (they missed all of these), so the warning of a repeat whose
    occurrences outlast the window no longer depends on the time its process started."""
    assert parse_cron(expression, tz).longest_gap(_at(start, tz)) == gap
    plan = RepeatPlan.make("k", None, expression, tz, None)
    assert plan.dedup_warning(gap + 60, _at(start, tz)) is None
    warning = plan.dedup_warning(gap + 59, _at(start, tz))
    assert warning is not None and f"up to {gap:g} s apart" in warning


@pytest.mark.parametrize(
    ("expression", "words"),
    [
        ("* * * *", ["4 fields", "minute hour day-of-month month day-of-week"]),
        ("* * * * * *", ["6 fields"]),
        ("", ["0 fields"]),
        ("60 * * * *", ["minute field '60'", "outside 0-59"]),
        ("* 24 * * *", ["hour field '24'", "outside 0-23"]),
        ("* * 0 * *", ["day-of-month field '0'", "outside 1-31"]),
        ("* * 32 * *", ["day-of-month field '32'"]),
        ("* * * 13 *", ["month field '13'", "outside 1-12"]),
        ("* * * * 8", ["day-of-week field '8'", "outside 0-7"]),
        ("*/0 * * * *", ["minute field '*/0'", "step"]),
        ("*/x * * * *", ["minute field '*/x'", "step"]),
        ("5/2 * * * *", ["minute field '5/2'", "a step needs a range or *"]),
        ("30-10 * * * *", ["minute field '30-10'", "runs backwards"]),
        ("* * * * fri-sun", ["day-of-week field 'fri-sun'", "runs backwards"]),
        ("* * * foo *", ["month field 'foo'", "month name"]),
        ("* * * * monday", ["day-of-week field 'monday'", "weekday name"]),
        ("* jan * * *", ["hour field 'jan'", "not a number"]),
        ("1,,2 * * * *", ["minute field '1,,2'", "empty item"]),
        ("1- * * * *", ["minute field '1-'", "not a number"]),
        ("-1 * * * *", ["minute field '-1'"]),
        ("+1 * * * *", ["minute field '+1'"]),
        ("\u0661 * * * *", ["minute field"]),  # an Arabic-Indic digit is no cron number
        ("0 0 30 2 *", ["day-of-month field '30'", "never fire"]),
        ("0 0 31 4,6,9,11 *", ["never fire"]),
        ("0 0 31 2 */2", ["never fire"]),
        ("@reboot", ["unknown nickname"]),
    ],
)
def test_bad_expressions(expression: str, words: list[str]) -> None:
    with pytest.raises(InvalidInputError) as caught:
        parse_cron(expression)
    for word in words:
        assert word in str(caught.value)


def test_either_day_field_may_make_an_impossible_day_possible() -> None:
    # February 31 or any Monday: both fields restricted, so the Mondays of February fire
    schedule = parse_cron("0 0 31 2 mon")
    t = schedule.next_after(_at("2026-01-01 00:00"))
    assert datetime.fromtimestamp(t, UTC).date().isoformat() == "2026-02-02"


@pytest.mark.parametrize("value", [None, 5, b"* * * * *"])
def test_cron_must_be_text(value: object) -> None:
    with pytest.raises(InvalidInputError, match="cron must be a str"):
        parse_cron(value)


@pytest.mark.parametrize("value", [0, -1, 0.0005, math.nan, math.inf, 2e9, True, "1", None])
def test_bad_every(value: object) -> None:
    with pytest.raises(InvalidDelayError, match="every"):
        every(value)


@pytest.mark.parametrize(
    "value",
    # "localtime": the host's own zone, a different one on each machine (ZoneInfo loads it
    # from the zone directory like an IANA key)
    ["Mars/Olympus", "", "../etc/passwd", 3, None, "UTC ", "localtime"],
)
def test_bad_tz(value: object) -> None:
    with pytest.raises(InvalidInputError, match="tz"):
        zone(value)
    with pytest.raises(InvalidInputError, match="tz"):
        parse_cron("* * * * *", value)


def test_the_host_zone_is_refused_as_a_zoneinfo_too() -> None:
    # ZoneInfo("localtime") is each machine's own zone, as the name is: processes on
    # machines in different zones would fire (and name) every occurrence differently
    try:
        host = ZoneInfo("localtime")
    except (ZoneInfoNotFoundError, ValueError):
        pytest.skip("no 'localtime' in this system's zone directory")
    with pytest.raises(InvalidInputError, match="tz"):
        zone(host)
    with pytest.raises(InvalidInputError, match="tz"):
        parse_cron("0 12 * * *", host)


def test_zone_instances_and_names() -> None:
    madrid = ZoneInfo("Europe/Madrid")
    assert zone(madrid) is madrid
    assert parse_cron("0 12 * * *", madrid).tz is madrid
    assert zone("America/New_York").key == "America/New_York"
    noon = parse_cron("0 12 * * *", "Asia/Kolkata").next_after(_at("2026-05-01 00:00"))
    assert datetime.fromtimestamp(noon, UTC) == datetime(2026, 5, 1, 6, 30, tzinfo=UTC)
    assert timedelta(seconds=noon - _at("2026-05-01 00:00", "Asia/Kolkata")).seconds == 43200


@pytest.mark.parametrize(
    ("seconds", "k"), [(0.1, 17_304_598_408), (0.1, 4_593_533_577), (0.3, 123)]
)
def test_every_just_before_an_occurrence_returns_it(seconds: float, k: int) -> None:
    """``after`` one float below occurrence ``k``: the division may round up to ``k``, which
    must not make the search start at ``k + 1`` and skip the occurrence."""
    occurrence = k * seconds
    after = math.nextafter(occurrence, -math.inf)
    assert every(seconds).next_after(after) == occurrence


@pytest.mark.parametrize("seconds", [1 / 3, 0.0015, 0.0025])
def test_scheduled_header_and_id_name_the_same_millisecond(seconds: float) -> None:
    """Occurrences off the millisecond grid: the ``scheduled`` header reads the instant the
    id's milliseconds give, not one truncated a millisecond earlier."""
    plan = RepeatPlan.make("k", seconds, None, "UTC", None)
    t = 1_777_777_777.0
    for _ in range(20):
        t = plan.schedule.next_after(t)
        ms = int(plan.message_id(t).rpartition("@")[2])
        scheduled = datetime.fromisoformat(str(plan.headers_at(t)["scheduled"]))
        assert round(scheduled.timestamp() * 1000) == ms


@pytest.mark.parametrize(
    ("expression", "words"),
    [
        ("1" * 5000 + " * * * *", ["minute field", "outside 0-59"]),
        ("* * * * 1-" + "2" * 5000, ["day-of-week field", "outside 0-7"]),
    ],
)
def test_numbers_too_long_for_int_are_refused_as_bad_input(
    expression: str, words: list[str]
) -> None:
    """Python refuses to convert a decimal string of more than 4300 digits (a ValueError of
    its own, not ours); such a number is only ever out of range."""
    with pytest.raises(InvalidInputError) as caught:
        parse_cron(expression)
    for word in words:
        assert word in str(caught.value)
    # a step that long is valid: it picks the start of the range alone
    assert parse_cron("*/" + "7" * 5000 + " * * * *").minutes == (0,)

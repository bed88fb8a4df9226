"""When a repeat fires: standard cron expressions and fixed intervals, as pure functions.

The cron dialect is the one of crontab(5) (Vixie cron, cronie): five fields, minute hour
day-of-month month day-of-week; ``*``, numbers, ranges ``a-b``, steps ``*/n`` and ``a-b/n``,
comma lists, month and weekday names (``jan``..``dec``, ``sun``..``sat``, any case, in ranges
too), day-of-week 0-7 with both 0 and 7 Sunday, and the nicknames ``@yearly`` (``@annually``),
``@monthly``, ``@weekly``, ``@daily`` (``@midnight``) and ``@hourly``. As crontab(5) says,
when both day fields are restricted a day matches if EITHER does; a day field counts as
unrestricted when it begins with ``*`` (so ``*/2`` in one of them still restricts the day
with AND, as Vixie cron's ``DOM_STAR`` / ``DOW_STAR`` flags do). An expression no date can
ever satisfy (``0 0 30 2 *``) is refused rather than accepted and never run.

The fields are read as wall-clock times of an IANA time zone (``zoneinfo``). Daylight saving
makes some wall times not exist (the hour skipped in spring) and others happen twice (the
hour repeated in autumn): an occurrence that does not exist is skipped, and one that happens
twice fires once, at its first instant (PEP 495's ``fold=0``). Vixie cron instead runs jobs of
the skipped hour right after the jump; a skipped occurrence is easier to reason about when
several processes must agree on the same instants, which is the point here.

Intervals (``every``) are aligned to the Unix epoch: the occurrences are ``k * every``
seconds since 1970-01-01 UTC, so every process computes the same instants without talking.
"""

from __future__ import annotations

import bisect
import calendar
import functools
import itertools
import math
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .errors import InvalidDelayError, InvalidInputError
from .options import MAX_SECONDS, brief

MIN_EVERY = 0.001
"""Shortest interval: occurrence ids carry the time in whole milliseconds, so two
occurrences closer than that would share an id."""

_FIELDS = (
    ("minute", 0, 59),
    ("hour", 0, 23),
    ("day-of-month", 1, 31),
    ("month", 1, 12),
    ("day-of-week", 0, 7),
)
_MONTHS = {
    name: number
    for number, name in enumerate(
        ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"),
        start=1,
    )
}
_WEEKDAYS = {
    name: number for number, name in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))
}
_NAMES: dict[int, dict[str, int]] = {3: _MONTHS, 4: _WEEKDAYS}
_NICKNAMES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_LONGEST_MONTH = {
    1: 31,
    2: 29,
    3: 31,
    4: 30,
    5: 31,
    6: 30,
    7: 31,
    8: 31,
    9: 30,
    10: 31,
    11: 30,
    12: 31,
}
_SEARCH_YEARS = 401
"""Weekdays and leap years repeat every 400 Gregorian years: an expression that matches a
date at all matches one within that span of any start (February 29 on a given weekday may
be 40 years away)."""


@dataclass(frozen=True, slots=True)
class Every:
    """Occurrences every ``seconds``, at whole multiples of it since the Unix epoch."""

    seconds: float

    def next_after(self, after: float) -> float:
        """The first occurrence strictly after ``after`` (seconds since the epoch)."""
        # The division may round either way near a multiple: step down while the one before
        # is still past ``after``, then up while this one is not.
        k = math.floor(after / self.seconds) + 1
        while (k - 1) * self.seconds > after:
            k -= 1
        t = k * self.seconds
        while t <= after:
            k += 1
            t = k * self.seconds
        return t

    def longest_gap(self, after: float) -> float:
        return self.seconds


@dataclass(frozen=True, slots=True)
class Cron:
    """A parsed cron expression read in the zone ``tz`` (build it with :func:`parse_cron`)."""

    expression: str
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days: frozenset[int]
    months: tuple[int, ...]
    weekdays: frozenset[int]
    """0 = Sunday ... 6 = Saturday (a 7 in the expression is stored as 0)."""
    any_day: bool
    """The day-of-month field begins with ``*``: days are matched with AND, not OR."""
    any_weekday: bool
    tz: ZoneInfo

    def day_matches(self, day: date) -> bool:
        """crontab(5)'s rule: both day fields restricted, either may match; else both must
        (the unrestricted one matches every day)."""
        in_month = day.day in self.days
        in_week = day.isoweekday() % 7 in self.weekdays
        if self.any_day or self.any_weekday:
            return in_month and in_week
        return in_month or in_week

    def next_after(self, after: float) -> float:
        """The first occurrence strictly after ``after`` (seconds since the epoch): the
        earliest matching wall-clock minute of ``tz`` that exists there, at its first
        instant when the wall clock shows it twice."""
        local = datetime.fromtimestamp(after, self.tz)
        wall = local.replace(tzinfo=None, second=0, microsecond=0, fold=0)
        # Walls map to instants in increasing order once each is taken at fold=0, so the
        # first matching wall whose instant is past ``after`` is the answer. Right after an
        # autumn overlap the walls just past ``after``'s are instants already gone (the
        # first pass): at most an hour of them is stepped over.
        limit = wall.year + _SEARCH_YEARS
        while True:
            wall = self._next_wall(wall, limit)
            instant = self._instant(wall)
            if instant is not None and instant > after:
                return instant
            wall += timedelta(minutes=1)

    def longest_gap(self, after: float) -> float:
        """The longest time between two occurrences in a row, to compare a schedule with the
        queue's ``dedup_window``: the longest gap of the wall-clock pattern over a whole
        400-year cycle of the calendar (within a day, and from a matching day's last
        occurrence to the next matching day's first), and the real gaps around the offset
        changes of ``tz`` in the :data:`GAP_YEARS` after ``after`` (a skipped or repeated
        hour), walked occurrence by occurrence. Not a sample of the occurrences after
        ``after``: those of the hours and days next to it miss the gap of a schedule
        restricted to some hours or weekdays (every minute of 9:00 to 10:59, every five
        minutes on Mondays) unless it happens to come soon."""
        times = sorted(hour * 3600 + minute * 60 for hour in self.hours for minute in self.minutes)
        within = max((b - a for a, b in itertools.pairwise(times)), default=0)
        days = _most_days_between(
            self.days, self.months, self.weekdays, self.any_day, self.any_weekday
        )
        pattern = float(max(within, days * 86400 - (times[-1] - times[0])))
        longest = pattern
        for change in _offset_changes(self.tz, after, after + GAP_YEARS * 366 * 86400):
            # Away from a change the offset is constant, so real gaps are the pattern's;
            # only the gap across the change (a skipped or repeated hour) and the one after
            # it (walls of a repeated hour stepped over) can differ. The last occurrence at
            # or before the change is found by bisection, not by walking a pattern's gap of
            # occurrences up to it (a week of minutes for ``* * * * 1``).
            t = self._last_at_or_before(change, pattern + _MOST_OFFSET_CHANGE)
            for _ in range(2):
                following = self.next_after(t)
                longest = max(longest, following - t)
                t = following
        return longest

    def _last_at_or_before(self, instant: float, reach: float) -> float:
        """The last occurrence at or before ``instant``, given one lies within ``reach``
        seconds before it. Occurrences are at least a minute apart, so once the bracket is
        under a second, the first occurrence after its low end is the one."""
        low, high = instant - reach, instant  # next_after(low) <= instant < next_after(high)
        while high - low > 1.0:
            middle = (low + high) / 2
            if self.next_after(middle) <= instant:
                low = middle
            else:
                high = middle
        return self.next_after(low)

    def _instant(self, wall: datetime) -> float | None:
        """Seconds since the epoch of a wall-clock time of ``tz`` (its first instant), or
        None where the zone skips it."""
        aware = wall.replace(tzinfo=self.tz)
        instant = aware.astimezone(UTC)
        if instant.astimezone(self.tz).replace(tzinfo=None) != wall:
            return None  # in a gap: zoneinfo maps it to a wall an offset change away
        return instant.timestamp()

    def _next_wall(self, wall: datetime, limit: int) -> datetime:
        """The earliest matching wall-clock minute at or after ``wall`` (naive)."""
        while wall.year <= limit:
            if wall.month not in self.months:
                at = bisect.bisect_left(self.months, wall.month)
                if at < len(self.months):
                    wall = datetime(wall.year, self.months[at], 1)
                else:
                    wall = datetime(wall.year + 1, self.months[0], 1)
                continue
            if not self.day_matches(wall.date()):
                wall = datetime(wall.year, wall.month, wall.day) + timedelta(days=1)
                continue
            if wall.hour not in self.hours:
                at = bisect.bisect_left(self.hours, wall.hour)
                if at < len(self.hours):
                    wall = wall.replace(hour=self.hours[at], minute=0)
                else:
                    wall = datetime(wall.year, wall.month, wall.day) + timedelta(days=1)
                continue
            if wall.minute not in self.minutes:
                at = bisect.bisect_left(self.minutes, wall.minute)
                if at < len(self.minutes):
                    wall = wall.replace(minute=self.minutes[at])
                else:
                    wall = wall.replace(minute=0) + timedelta(hours=1)
                continue
            return wall
        # parse_cron refuses expressions no date satisfies, so only one whose every wall
        # time is skipped by the zone (02:00 on the last Sunday of March in the European
        # Union's zones) gets here, from next_after, after _SEARCH_YEARS of them
        raise InvalidInputError(
            f"cron expression {self.expression!r} matches no time that exists in"
            f" {self.tz.key or self.tz}: each wall-clock time it names is one the zone skips"
            " when its clocks go forward, so it would never fire"
        )


Schedule = Every | Cron

GAP_YEARS = 4
"""Years after now whose offset changes :meth:`Cron.longest_gap` walks through."""
_MOST_OFFSET_CHANGE = 2 * 3600.0
"""The largest change of UTC offset a zone makes, daylight saving or not (Antarctica/Troll:
two hours); larger one-off ones (Pacific/Apia's skipped day in 2011) lie in the past."""


@functools.lru_cache(maxsize=256)
def _most_days_between(
    days: frozenset[int],
    months: tuple[int, ...],
    weekdays: frozenset[int],
    any_day: bool,
    any_weekday: bool,
) -> int:
    """The most days from one matching day to the next, over two 400-year cycles of the
    Gregorian calendar (its weekdays and leap years repeat every 400 years). A year's
    matching days depend only on whether it is a leap year and on its first weekday."""
    rule = Cron("", (0,), (0,), days, months, weekdays, any_day, any_weekday, ZoneInfo("UTC"))
    kinds: dict[tuple[bool, int], tuple[list[int], int]] = {}  # matching days, longest gap
    longest = 0
    last: int | None = None
    for year in range(2000, 2801):
        first = date(year, 1, 1)
        kind = (calendar.isleap(year), first.weekday())
        if kind not in kinds:
            found = [
                offset
                for offset in range(366 if kind[0] else 365)
                if (day := first + timedelta(days=offset)).month in months and rule.day_matches(day)
            ]
            kinds[kind] = found, max((b - a for a, b in itertools.pairwise(found)), default=0)
        matching, within = kinds[kind]
        if not matching:
            continue
        ordinal = first.toordinal()
        if last is not None:
            longest = max(longest, ordinal + matching[0] - last)
        longest = max(longest, within)
        last = ordinal + matching[-1]
    return longest


def _offset_changes(tz: ZoneInfo, start: float, end: float) -> list[float]:
    """The instants in [start, end] where ``tz``'s UTC offset changes (to the second)."""
    changes: list[float] = []
    step = 86400.0

    def offset(t: float) -> timedelta | None:
        return datetime.fromtimestamp(t, tz).utcoffset()

    t = start
    while t < end:
        following = min(t + step, end)
        if offset(t) != offset(following):
            low, high = t, following
            while high - low > 1:
                middle = (low + high) / 2
                if offset(middle) == offset(low):
                    low = middle
                else:
                    high = middle
            changes.append(high)
        t = following
    return changes


HOST_ZONE = "localtime"
"""The name under which a system's zone directory holds the host's own zone (a link to
``/etc/localtime``), which ``ZoneInfo`` loads like any IANA key."""


def zone(tz: object) -> ZoneInfo:
    """The IANA zone named ``tz`` (or ``tz`` itself, a ``ZoneInfo``). The host's own zone is
    refused in both forms: ``ZoneInfo("localtime")`` is as much each machine's own as the
    name is (``zoneinfo`` loads it from the zone directory like any key)."""
    if isinstance(tz, ZoneInfo):
        if tz.key == HOST_ZONE:
            raise InvalidInputError(
                f"tz ZoneInfo({HOST_ZONE!r}) is each machine's own zone, so processes on"
                " different machines would compute different instants (and message ids):"
                " name the IANA zone"
            )
        return tz
    if not isinstance(tz, str) or not tz:
        raise InvalidInputError(f"tz must be an IANA time zone name (str), not {brief(tz)}")
    if tz == HOST_ZONE:
        raise InvalidInputError(
            f"tz {tz!r} is each machine's own zone, so processes on different machines would"
            " compute different instants (and message ids): name the IANA zone"
        )
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise InvalidInputError(f"tz {tz!r} is not a known IANA time zone") from exc


def every(seconds: object) -> Every:
    """An interval schedule, checked: a number of seconds in [0.001, 1e9] (not a bool)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise InvalidDelayError(f"every must be a number of seconds, not {brief(seconds)}")
    if not MIN_EVERY <= seconds <= MAX_SECONDS:  # NaN fails it too
        raise InvalidDelayError(
            f"every must be a number of seconds in [{MIN_EVERY}, {MAX_SECONDS:,.0f}],"
            f" not {brief(seconds)}"
        )
    return Every(float(seconds))


def parse_cron(expression: object, tz: object = "UTC") -> Cron:
    """Parse a five-field cron expression (see the module's docstring for the dialect);
    :class:`InvalidInputError` names the field at fault and why."""
    if not isinstance(expression, str):
        raise InvalidInputError(f"cron must be a str, not {brief(expression)}")
    zone_info = zone(tz)
    text = expression.strip()
    if text.startswith("@"):
        nickname = _NICKNAMES.get(text.lower())
        if nickname is None:
            raise InvalidInputError(
                f"cron expression {expression!r}: unknown nickname; known: {', '.join(_NICKNAMES)}"
            )
        text = nickname
    parts = text.split()
    if len(parts) != 5:
        raise InvalidInputError(
            f"cron expression {expression!r} has {len(parts)} fields; it needs 5:"
            " minute hour day-of-month month day-of-week"
        )
    values = [_field(expression, index, part) for index, part in enumerate(parts)]
    minutes, hours, days, months, weekdays = values
    any_day, any_weekday = parts[2].startswith("*"), parts[4].startswith("*")
    if (any_day or any_weekday) and not any(
        day <= _LONGEST_MONTH[month] for month in months for day in days
    ):
        raise InvalidInputError(
            f"cron expression {expression!r}: day-of-month field {parts[2]!r}: no month of"
            f" the month field {parts[3]!r} has such a day, so it would never fire"
        )
    return Cron(
        expression=expression,
        minutes=tuple(sorted(minutes)),
        hours=tuple(sorted(hours)),
        days=frozenset(days),
        months=tuple(sorted(months)),
        weekdays=frozenset(day % 7 for day in weekdays),
        any_day=any_day,
        any_weekday=any_weekday,
        tz=zone_info,
    )


def _field(expression: str, index: int, text: str) -> set[int]:
    name, low, high = _FIELDS[index]

    def fail(why: str) -> InvalidInputError:
        return InvalidInputError(f"cron expression {expression!r}: {name} field {text!r}: {why}")

    def value(item: str) -> int:
        if item.isascii() and item.isdigit():
            number = _whole(item)
        elif item.lower() in _NAMES.get(index, {}):
            return _NAMES[index][item.lower()]
        elif index in _NAMES:
            kind = "month" if index == 3 else "weekday"
            raise fail(f"{item!r} is neither a number nor a {kind} name")
        else:
            raise fail(f"{item!r} is not a number")
        if not low <= number <= high:
            shown = number if number < _TOO_LONG else f"a {len(item)}-digit number"
            raise fail(f"{shown} is outside {low}-{high}")
        return number

    chosen: set[int] = set()
    for item in text.split(","):
        if not item:
            raise fail("an empty item in the list")
        span, slash, step_text = item.partition("/")
        step = 1
        if slash:
            if not (step_text.isascii() and step_text.isdigit()) or _whole(step_text) < 1:
                raise fail(f"the step {step_text!r} is not a whole number of at least 1")
            step = _whole(step_text)
        if span == "*":
            # a plain * of day-of-week is 0-6: 7 is another name for Sunday
            start, end = low, 6 if index == 4 else high
        elif "-" in span:
            first, _, last = span.partition("-")
            start, end = value(first), value(last)
            if start > end:
                raise fail(f"the range {span!r} runs backwards ({start} > {end})")
        elif slash:
            raise fail(f"a step needs a range or * before it, not {span!r}")
        else:
            start = end = value(span)
        chosen.update(range(start, end + 1, step))
    return chosen


_TOO_LONG = 1_000_000
"""A cron number with as many significant digits as this, or more, is read as this: it is
out of every field's range (and a step that long picks the range's start alone), and Python
refuses to convert decimal strings of more than 4300 digits with a ValueError of its own."""


def _whole(digits: str) -> int:
    """The value of a string of ASCII digits, capped at :data:`_TOO_LONG`."""
    significant = digits.lstrip("0")
    if len(significant) >= len(str(_TOO_LONG)):
        return _TOO_LONG
    return int(significant or "0")

"""The worker command's settings: from flags, environment variables and a TOML file.

Precedence is the usual one (as in pip, Docker and most twelve-factor tools): a flag beats
an ``AIO_KEUSS_*`` environment variable, which beats the file named by ``--config`` (or
``AIO_KEUSS_CONFIG``), which beats the defaults. Every value is checked here, so a typo
stops the command before it connects to anything.

Repeats are a list, like queues: the layer that gives any (the ``--repeat`` flags, the
lines of ``AIO_KEUSS_REPEAT``, the file's ``[[repeat]]`` tables) gives all of them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import ConfigError, InvalidInputError, InvalidQueueNameError
from ..loading import read_toml
from ..options import brief, check_queue_name
from ..repeat import Repeat

ENV_PREFIX = "AIO_KEUSS_"


@dataclass(frozen=True)
class WorkerSettings:
    """What ``aio-keuss worker`` runs. ``options`` are the backend's connect options other
    than ``url`` (``prefix``, ``schema``, ...)."""

    handler: str = ""
    pipeline: str = ""
    """``module:attr`` of a pipeline (or a function building one from the factory, or a
    topology dict), or the path of a ``.toml`` file describing one: run instead of
    ``handler`` and ``queues``."""
    replace_pipeline: bool = False
    """Start ``pipeline`` over another topology stored under its name, storing this one
    (``Pipeline.run(replace=True)``), instead of refusing to start: for the release that
    changes the pipeline."""
    backend: str = "memory"
    url: str | None = None
    queues: tuple[str, ...] = ()
    concurrency: int = 1
    timeout: float | None = None
    grace: float = 30.0
    prefetch: int = 0
    result_ttl: float = 0.0
    """Seconds the consumed queues keep what their handler returned (the queue option
    ``result_ttl``, for ``Queue.push_and_wait`` elsewhere); 0: none kept."""
    log_level: str = "info"
    health_port: int | None = None
    health_host: str = "127.0.0.1"
    repeats: tuple[Repeat, ...] = ()
    """Run beside the consumers; with neither ``handler`` nor ``queues``, the worker only
    schedules."""
    options: Mapping[str, Any] = field(default_factory=dict)

    def connect_options(self) -> dict[str, Any]:
        found = dict(self.options)
        if self.url is not None:
            found["url"] = self.url
        return found


def _int(value: Any, name: str, least: int, most: int) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ConfigError(f"{name} must be an int, not {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise ConfigError(f"{name} must be an int in [{least}, {most}], not {value!r}")
    return value


def _seconds(value: Any, name: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ConfigError(f"{name} must be a number of seconds, not {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1e9:
        raise ConfigError(f"{name} must be seconds in [0, 1e9], not {value!r}")
    return float(value)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _boolean(value: Any, name: str) -> bool:
    """A bool, or its spelling in an environment variable (``true``/``false``, ``1``/``0``,
    ``yes``/``no``, ``on``/``off``, any case; empty: false, as unset)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
    elif isinstance(value, bool):
        return value
    raise ConfigError(
        f"{name} must be true or false (in the environment also 1 / 0, yes / no, on / off),"
        f" not {value!r}"
    )


def _queues(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"queue must be a name or a list of names, not {value!r}")
    names = tuple(v.strip() for v in value)
    for name in names:  # before anything connects: a bad name is a bad setting
        try:
            check_queue_name(name)
        except InvalidQueueNameError as exc:
            raise ConfigError(str(exc)) from None
    twice = named_twice(names)
    if twice:
        raise ConfigError(twice)
    return names


def named_twice(names: Sequence[str]) -> str | None:
    """Why a list of queues naming one twice is refused, or None. Two consumers on one
    queue in one process only do what ``concurrency`` does, and would report the same
    metric series twice (a scrape Prometheus rejects)."""
    twice = sorted({name for name in names if names.count(name) > 1})
    if not twice:
        return None
    return (
        f"queue {', '.join(map(repr, twice))} given more than once: one consumer per queue"
        " (raise concurrency for more handlers)"
    )


REPEAT_FORM = "QUEUE KEY SCHEDULE [tz=ZONE] [PAYLOAD_JSON]"
"""A repeat on one line (``--repeat``, a line of ``AIO_KEUSS_REPEAT``). SCHEDULE is
``every=SECONDS``, a nickname (``@daily``) or the five fields of a crontab(5) expression, bare:
a cron field holds no space and no ``=`` and does not begin with ``@``, so the schedule's
first word tells its kind, a cron expression is the five words from there, and the value is
quoted once, for the shell, with no quotes of its own inside (as a crontab line has none).
The payload comes last, as the rest of the line, so its JSON may hold spaces."""


def parse_repeat(text: str) -> Repeat:
    """The repeat a ``--repeat`` value describes (see :data:`REPEAT_FORM`), checked."""

    def bad(why: str) -> ConfigError:
        return ConfigError(f"--repeat {text!r}: {why}; the form is {REPEAT_FORM!r}")

    words = text.split(None, 2)
    if len(words) < 3:
        raise bad("a queue, a key and a schedule are needed")
    queue, key, rest = words
    word, rest = _first_word(rest)
    every: float | None = None
    cron: str | None = None
    if word.startswith("every="):
        try:
            every = float(word.removeprefix("every="))
        except ValueError:
            raise bad(f"{word!r} is not a number of seconds") from None
    elif word.startswith("@"):
        cron = word
    else:
        cron_fields = [word]
        while len(cron_fields) < 5:
            word, rest = _first_word(rest)
            if not word:
                raise bad(f"a cron schedule has five fields, not {len(cron_fields)}")
            cron_fields.append(word)
        cron = " ".join(cron_fields)
    tz = "UTC"
    if rest.startswith("tz="):
        word, rest = _first_word(rest)
        tz = word.removeprefix("tz=")
    payload = None
    if rest:
        try:
            payload = json.loads(rest)
        except ValueError as exc:
            hint = "" if cron is None else " (a cron schedule is five fields, the payload after)"
            raise bad(f"the payload {rest!r} is not JSON: {exc}{hint}") from None
    spec = Repeat(queue, key, payload, every=every, cron=cron, tz=tz)
    return _checked_repeat(spec, f"--repeat {text!r}")


def _first_word(text: str) -> tuple[str, str]:
    """(the first word of ``text``, the rest with no leading space)."""
    parts = text.split(None, 1)
    if not parts:
        return "", ""
    return parts[0], parts[1] if len(parts) > 1 else ""


def _checked_repeat(spec: Repeat, where: str) -> Repeat:
    try:
        spec.check()
    except InvalidInputError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return spec


_REPEAT_FIELDS = tuple(f.name for f in fields(Repeat))


def _repeat_table(table: Any, number: int) -> Repeat:
    """A ``[[repeat]]`` table of the file: the fields of :class:`Repeat` by name."""
    where = f"repeat #{number}"
    if not isinstance(table, Mapping):
        raise ConfigError(
            f"{where} must be a table of {', '.join(_REPEAT_FIELDS)}, not {brief(table)}"
        )
    unknown = sorted(set(table) - set(_REPEAT_FIELDS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown setting(s) {unknown}; known: {', '.join(_REPEAT_FIELDS)}"
        )
    missing = [name for name in ("queue", "key") if name not in table]
    if missing:
        raise ConfigError(f"{where}: no {' and no '.join(missing)}")
    return _checked_repeat(Repeat(**table), f"{where} ({table['key']!r})")


def _repeats(value: Any) -> tuple[Repeat, ...]:
    if isinstance(value, str):  # AIO_KEUSS_REPEAT: one repeat per line
        value = [line for line in value.splitlines() if line.strip()]
    if not isinstance(value, list | tuple):
        raise ConfigError(f"repeat must be a list of repeats, not {brief(value)}")
    specs: list[Repeat] = []
    for number, item in enumerate(value, start=1):
        if isinstance(item, str):
            specs.append(parse_repeat(item))
        elif isinstance(item, Repeat):
            specs.append(_checked_repeat(item, f"repeat {item.key!r}"))
        else:
            specs.append(_repeat_table(item, number))
    twice = repeated_twice(specs)
    if twice:
        raise ConfigError(twice)
    return tuple(specs)


def repeated_twice(specs: Sequence[Repeat]) -> str | None:
    """Why a list of repeats naming one (queue, key) twice is refused, or None: the two would
    push the same ids, which the queue's dedup makes harmless, so it is surely a mistake
    (two schedules meant under one key, the second silently losing)."""
    seen: set[tuple[str, str]] = set()
    for spec in specs:
        if (spec.queue, spec.key) in seen:
            return f"repeat {spec.key!r} on queue {spec.queue!r} given twice"
        seen.add((spec.queue, spec.key))
    return None


_LEVELS = ("debug", "info", "warning", "error", "critical")


def _check(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Typed values of the names given; an unknown name or a bad value is a ConfigError."""
    checked: dict[str, Any] = {}
    known = {f.name for f in fields(WorkerSettings)}
    for name, value in raw.items():
        if name not in known:
            raise ConfigError(f"unknown worker setting {name!r}")
        if name in ("concurrency",):
            value = _int(value, name, 1, 10_000)
        elif name == "prefetch":
            value = _int(value, name, 0, 10_000)
        elif name == "health_port":
            value = _int(value, name, 0, 65_535)
        elif name in ("timeout", "grace", "result_ttl"):
            value = _seconds(value, name)
            if name == "timeout" and value == 0:
                raise ConfigError("timeout must be > 0 seconds")
        elif name == "queues":
            value = _queues(value)
        elif name == "repeats":
            value = _repeats(value)
        elif name == "replace_pipeline":
            value = _boolean(value, name)
        elif name == "log_level":
            if not isinstance(value, str) or value.lower() not in _LEVELS:
                raise ConfigError(f"log_level must be one of {', '.join(_LEVELS)}, not {value!r}")
            value = value.lower()
        elif name == "options":
            if not isinstance(value, Mapping):
                raise ConfigError("options must be a table of backend options")
            value = dict(value)
        elif not isinstance(value, str):
            raise ConfigError(f"{name} must be a str, not {value!r}")
        checked[name] = value
    return checked


def from_file(path: str) -> dict[str, Any]:
    """The settings of a TOML file: the names of :class:`WorkerSettings` (``queues`` a list,
    ``options`` a table), at the top or under ``[worker]``, and ``[[repeat]]`` tables. Those
    and ``[options]`` may follow a ``[worker]`` table at the top, where TOML puts them
    (``[[worker.repeat]]`` and ``[worker.options]`` are the same)."""
    data = read_toml(path, "config file")
    section = data.get("worker", data)
    if not isinstance(section, dict):
        raise ConfigError(f"config file {path!r}: [worker] must be a table")
    section = dict(section)
    if "queue" in section:
        if "queues" in section:
            raise ConfigError(f"config file {path!r}: give queue or queues, not both")
        section["queues"] = section.pop("queue")
    if "worker" in data:
        # TOML puts a table written after [worker] at the top, beside it: [[repeat]] and
        # [options] belong to the worker there too; anything else beside it would be
        # silently dropped (a backend above [worker], say), so it is refused
        for name, table in (("repeat", "[[{}]]"), ("options", "[{}]")):
            if name in data:
                if name in section:
                    top, nested = table.format(name), table.format("worker." + name)
                    raise ConfigError(f"config file {path!r}: both {top} and {nested}")
                section[name] = data[name]
        beside = sorted(set(data) - {"worker", "repeat", "options"})
        if beside:
            raise ConfigError(
                f"config file {path!r}: {', '.join(map(repr, beside))} outside [worker]:"
                " give the settings at the top or under [worker], not both"
            )
    if "repeat" in section:
        if "repeats" in section:
            raise ConfigError(f"config file {path!r}: give repeat or repeats, not both")
        section["repeats"] = section.pop("repeat")
    return section


_ENV_NAMES = {"queues": "QUEUE", "repeats": "REPEAT"}


def from_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """``AIO_KEUSS_<NAME>`` for each setting (``AIO_KEUSS_QUEUE`` comma-separated,
    ``AIO_KEUSS_REPEAT`` one repeat per line)."""
    found: dict[str, Any] = {}
    for f in fields(WorkerSettings):
        key = ENV_PREFIX + _ENV_NAMES.get(f.name, f.name.upper())
        if f.name != "options" and key in environ:
            found[f.name] = environ[key]
    return found


def option_value(text: str) -> Any:
    """A ``--option key=value`` value: JSON when it parses (numbers, true, lists...), else the
    text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def option_flags(items: Sequence[str]) -> dict[str, Any]:
    """The backend options of ``--option KEY=VALUE`` flags. A key of blanks is refused
    here, naming the flag: stripped, it became an option named '' that the backend
    refused without a name to show."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--option takes KEY=VALUE, not {item!r}")
        options[key.strip()] = option_value(value)
    return options


def resolve(flags: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> WorkerSettings:
    """Flags over environment over file over defaults."""
    config = flags.get("config") or environ.get(ENV_PREFIX + "CONFIG")
    layers = [
        (from_file(config) if config else {}, f"replace_pipeline = true in {config!r}"),
        (from_environment(environ), f"{ENV_PREFIX}REPLACE_PIPELINE={{}}"),
        (
            {k: v for k, v in flags.items() if k != "config" and v is not None},
            "--replace-pipeline",
        ),
    ]
    merged: dict[str, Any] = {}
    options: dict[str, Any] = {}
    replacing = ""  # where replace_pipeline was turned on, for the refusal below
    for layer, where in layers:
        checked = _check(layer)
        options.update(checked.pop("options", {}))
        merged.update(checked)
        if "replace_pipeline" in layer:
            replacing = where.format(layer["replace_pipeline"])
    settings = WorkerSettings(**merged, options=options)
    if settings.replace_pipeline and not settings.pipeline:
        # Refused rather than ignored, as --queue beside --pipeline is: a setting that would
        # do nothing is a mistake worth a word (given to the wrong unit, the pipeline's
        # worker that needed it goes without); --no-replace-pipeline turns it off for a
        # worker sharing the environment of a pipeline's.
        raise ConfigError(
            f"{replacing} is for a --pipeline worker, and this one runs no pipeline: it"
            " replaces the topology stored under the pipeline's name, which a handler's (or"
            " repeats') worker never stores. Unset it for this worker, or give"
            " --no-replace-pipeline"
        )
    if settings.pipeline:
        if settings.handler or settings.queues:
            raise ConfigError("give --pipeline, or a handler and --queue, not both")
        return settings
    if not settings.handler and not settings.queues and settings.repeats:
        return settings  # only scheduling, for consumers that run elsewhere
    if not settings.handler:
        raise ConfigError(
            "no handler: give module:function (or AIO_KEUSS_HANDLER), or --pipeline"
            " (or only --repeat, to schedule without consuming)"
        )
    if not settings.queues:
        raise ConfigError("no queue: give --queue NAME (or AIO_KEUSS_QUEUE)")
    return settings


def connection_settings(
    flags: Mapping[str, Any],
    option_items: Sequence[str],
    environ: Mapping[str, str] = os.environ,
) -> tuple[str, dict[str, Any]]:
    """(backend, connect options) of the admin commands: the worker's connection settings
    (``backend``, ``url``, ``options``) with the same precedence, the rest ignored."""
    config = flags.get("config") or environ.get(ENV_PREFIX + "CONFIG")
    wanted = {"backend", "url", "options"}
    layers = [(config and from_file(config)) or {}, from_environment(environ), dict(flags)]
    layers.append({"options": option_flags(option_items)})
    merged: dict[str, Any] = {}
    for layer in layers:
        picked = {k: v for k, v in layer.items() if k in wanted and v is not None}
        checked = _check(picked)
        options_layer = checked.pop("options", {})
        merged.update(checked)
        merged.setdefault("options", {}).update(options_layer)
    settings = WorkerSettings(
        backend=merged.get("backend", "memory"),
        url=merged.get("url"),
        options=merged.get("options", {}),
    )
    return settings.backend, settings.connect_options()

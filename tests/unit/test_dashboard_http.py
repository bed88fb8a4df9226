"""The dashboard's HTTP rules, request by request: the token, the Host check without one, the
same-origin and CSRF checks on POSTs, the security headers, and payloads kept out of markup.

A real server on a free loopback port over the memory backend, and a plain HTTP client that
sets every header itself (a browser would not let a test forge Origin or Sec-Fetch-Site).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

import aio_keuss
from aio_keuss.errors import ConfigError

aiohttp = pytest.importorskip("aiohttp", reason="the dashboard extra (aiohttp) is not installed")

from aio_keuss.dashboard import Dashboard, security  # noqa: E402
from aio_keuss.dashboard.board import payload_text  # noqa: E402
from aio_keuss.worker.cli import main as cli_main  # noqa: E402

TOKEN = "a-token-long-enough-0123456789"


@pytest.fixture
async def factory() -> AsyncIterator[aio_keuss.Factory]:
    async with aio_keuss.connect("memory", deadletter={"max_ko": 0}) as opened:
        await (await opened.queue("jobs")).push({"n": 1})
        yield opened


@pytest.fixture
async def client() -> AsyncIterator[Any]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _started(factory: aio_keuss.Factory, **options: Any) -> Dashboard:
    dashboard = Dashboard(factory, port=0, sample_every=60, **options)
    await dashboard.start()
    return dashboard


def _post_headers(dashboard: Dashboard, **extra: str) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        security.CSRF_HEADER: dashboard.csrf,
        "Origin": dashboard.url.rstrip("/"),
        "Sec-Fetch-Site": "same-origin",
        **extra,
    }


async def _requeue_all_dead(dashboard: Dashboard, client: Any) -> Any:
    """POST a requeue of every message of the deadletter queue; its answer's ``result``."""
    async with client.post(
        dashboard.url + "api/requeue",
        data=b'{"queue": "__deadletter__", "ids": null}',
        headers=_post_headers(dashboard),
    ) as response:
        assert response.status == 200
        return (await response.json())["result"]


# binding ------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost", "[::1]"])
def test_loopback_addresses_need_no_token(host: str) -> None:
    assert security.is_loopback(host)
    security.check_bind(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.168.1.10", "example.com"])
def test_other_addresses_need_a_token(host: str) -> None:
    assert not security.is_loopback(host)
    with pytest.raises(ConfigError, match="token"):
        security.check_bind(host, None)
    security.check_bind(host, TOKEN)


def test_a_short_token_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least"):
        security.check_bind("127.0.0.1", "short")


@pytest.mark.parametrize("seconds", [0, -1, 0.001, float("nan"), float("inf"), 3601])
async def test_a_sample_interval_the_command_refuses_is_refused_in_a_program_too(
    factory: aio_keuss.Factory, seconds: float
) -> None:
    """0 failed with a ZeroDivisionError, NaN with a ValueError, and a negative or tiny one
    made the sampler a busy loop reading every queue's counters and sizes."""
    with pytest.raises(ConfigError, match="sample"):
        Dashboard(factory, port=0, sample_every=seconds)


def test_the_command_refuses_a_public_address_without_a_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(security.TOKEN_ENV, raising=False)
    assert cli_main(["dashboard", "--host", "0.0.0.0"]) == 2
    assert "--token" in capsys.readouterr().err


def test_the_command_exits_2_for_a_bad_deadletter_queue_name() -> None:
    """Bad settings exit 2 (the name was refused by a non-config error: exit 1)."""
    assert cli_main(["dashboard", "--backend", "memory", "--deadletter-queue", "bad name"]) == 2


@pytest.mark.parametrize("level", ["bogus", "10", ""])
def test_the_command_exits_2_for_an_unknown_log_level(level: str) -> None:
    """Refused as a usage error before anything is served, as the worker's --log-level is
    (it was logging's ValueError, a traceback and exit 1). A process of its own: under
    pytest the root logger has handlers already, and logging.basicConfig does nothing."""
    argv = ["dashboard", "--backend", "memory", "--port", "0", "--log-level", level]
    done = subprocess.run(
        [sys.executable, "-m", "aio_keuss", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 2, done.stderr
    assert "--log-level" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_command_names_the_extra_when_aiohttp_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # what an absent package looks like
    assert cli_main(["dashboard", "--port", "0"]) == 2
    assert "aio-keuss[dashboard]" in capsys.readouterr().err


async def test_a_taken_port_fails_the_start_and_leaves_nothing_running(
    factory: aio_keuss.Factory,
) -> None:
    first = await _started(factory)
    try:
        second = Dashboard(factory, port=first.port)
        with pytest.raises(OSError):
            await second.start()
        assert second.board._sampler is None and second._runner is None
    finally:
        await first.stop()


# without a token (loopback) -------------------------------------------------------------


async def test_every_answer_carries_the_security_headers(
    factory: aio_keuss.Factory, client: Any
) -> None:
    dashboard = await _started(factory)
    try:
        for path in ("/", "/static/app.js", "/api/state", "/nowhere"):
            async with client.get(dashboard.url.rstrip("/") + path) as response:
                for name, value in security.SECURITY_HEADERS.items():
                    assert response.headers[name] == value, (path, name)
        csp = security.SECURITY_HEADERS["Content-Security-Policy"]
        assert "default-src 'self'" in csp and "'unsafe-inline'" not in csp
    finally:
        await dashboard.stop()


async def test_without_a_token_only_loopback_host_names_are_answered(
    factory: aio_keuss.Factory, client: Any
) -> None:
    dashboard = await _started(factory)
    try:
        state = dashboard.url + "api/state"
        async with client.get(state, headers={"Host": "evil.example"}) as response:
            assert response.status == 421  # a rebound DNS name pointing here
        async with client.get(state, headers={"Host": f"localhost:{dashboard.port}"}) as response:
            assert response.status == 200
            names = [q["name"] for q in (await response.json())["result"]["queues"]]
            assert names == ["__deadletter__", "jobs"]
    finally:
        await dashboard.stop()


async def test_a_post_needs_the_csrf_token_the_same_origin_and_json(
    factory: aio_keuss.Factory, client: Any
) -> None:
    dashboard = await _started(factory)
    jobs = await factory.queue("jobs")
    pause = dashboard.url + "api/pause"
    refusals = [
        _post_headers(dashboard, **{security.CSRF_HEADER: "wrong"}),
        {k: v for k, v in _post_headers(dashboard).items() if k != security.CSRF_HEADER},
        _post_headers(dashboard, Origin="http://evil.example"),
        _post_headers(dashboard, Origin="null"),
        _post_headers(dashboard, **{"Sec-Fetch-Site": "cross-site"}),
        _post_headers(dashboard, **{"Sec-Fetch-Site": "same-site"}),
        _post_headers(dashboard, **{"Content-Type": "text/plain"}),
    ]
    try:
        for headers in refusals:
            async with client.post(pause, data=b'{"queue": "jobs"}', headers=headers) as response:
                assert response.status == 403, headers
            assert not await jobs.is_paused()
        async with client.get(pause) as response:
            assert response.status == 405  # never changed by a GET
        async with client.post(
            pause, data=b'{"queue": "jobs"}', headers=_post_headers(dashboard)
        ) as response:
            assert response.status == 200
            assert (await response.json())["result"] is True
        assert await jobs.is_paused()
        # a client that is not a browser sends neither Origin nor Sec-Fetch-Site
        plain = {"Content-Type": "application/json", security.CSRF_HEADER: dashboard.csrf}
        async with client.post(
            dashboard.url + "api/resume", data=b'{"queue": "jobs"}', headers=plain
        ) as response:
            assert response.status == 200
        assert not await jobs.is_paused()
    finally:
        await dashboard.stop()


async def test_the_csrf_token_is_in_the_page_only(factory: aio_keuss.Factory, client: Any) -> None:
    dashboard = await _started(factory)
    try:
        async with client.get(dashboard.url) as response:
            page = await response.text()
        assert f'<meta name="csrf-token" content="{dashboard.csrf}">' in page
        async with client.get(dashboard.url + "api/state") as response:
            assert dashboard.csrf not in await response.text()
    finally:
        await dashboard.stop()


async def test_bad_requests_get_typed_answers(factory: aio_keuss.Factory, client: Any) -> None:
    dashboard = await _started(factory)
    base = dashboard.url + "api/"
    try:
        async with client.get(base + "messages?queue=nowhere") as response:
            assert response.status == 404
        async with client.get(base + "messages?queue=jobs&state=gone") as response:
            assert response.status == 400
        async with client.get(base + "messages?queue=jobs&n=100000") as response:
            assert response.status == 400
        async with client.get(base + "messages?queue=..bad") as response:
            assert response.status == 400
        headers = _post_headers(dashboard)
        async with client.post(base + "pause", data=b"[1]", headers=headers) as response:
            assert response.status == 400
        async with client.post(
            base + "requeue", data=b'{"queue": "__deadletter__", "ids": "x"}', headers=headers
        ) as response:
            assert response.status == 400
        # nested deeper than JSON is read: a 400 (it was a RecursionError, a 500)
        async with client.post(base + "pause", data=b"[" * 50_000, headers=headers) as response:
            assert response.status == 400
    finally:
        await dashboard.stop()


async def test_a_body_in_an_unknown_charset_is_a_bad_request(
    factory: aio_keuss.Factory, client: Any
) -> None:
    """The charset of the Content-Type decodes the body: an unknown one raised LookupError,
    which is no ValueError, and the answer was aiohttp's untyped 500."""
    dashboard = await _started(factory)
    headers = _post_headers(dashboard, **{"Content-Type": "application/json; charset=no-such"})
    try:
        async with client.post(
            dashboard.url + "api/pause", data=b'{"queue": "jobs"}', headers=headers
        ) as response:
            assert response.status == 400
            assert "not JSON" in await response.text()
        assert not await (await factory.queue("jobs")).is_paused()
    finally:
        await dashboard.stop()


def test_a_secret_that_is_not_utf8_is_a_wrong_secret() -> None:
    """A header byte that is not UTF-8 reaches the comparison as a lone surrogate (aiohttp
    decodes headers with surrogateescape): a mismatch, not a UnicodeEncodeError (a 500 to
    anyone without the token)."""
    assert not security.same_secret(TOKEN, "\udcff")
    assert not security.same_secret(TOKEN, "\xff" + TOKEN)
    assert security.same_secret(TOKEN, TOKEN)


async def test_requeue_without_ids_takes_every_deadlettered_message_back(
    factory: aio_keuss.Factory, client: Any
) -> None:
    jobs = await factory.queue("jobs")
    await jobs.pop()
    for n in range(3):
        await jobs.push({"n": n})
        message = await jobs.reserve()
        assert message is not None
        await jobs.ko(message)
    dead = await factory.queue("__deadletter__")
    assert await dead.total_size() == 3
    dashboard = await _started(factory)
    try:
        answer = await _requeue_all_dead(dashboard, client)
        assert (len(answer["moved"]), answer["unmovable"], answer["left"]) == (3, 0, 0)
        assert await dead.total_size() == 0
        assert await jobs.total_size() == 3
    finally:
        await dashboard.stop()


async def test_requeue_to_a_queue_nobody_opened_creates_it_there(
    factory: aio_keuss.Factory, client: Any
) -> None:
    """What docs/dashboard.md says of an origin the backend does not know: a valid queue
    name is opened (recorded with the dashboard factory's defaults, listed from then on)
    and the message moved into it; no header, or one that is no queue name, stays put."""
    dead = await factory.queue("__deadletter__")
    ghost_id = await dead.push("to ghost", headers={"x-dl-from-queue": "ghost"})
    bad_id = await dead.push("bad name", headers={"x-dl-from-queue": "bad name!"})
    bare_id = await dead.push("no header")
    assert "ghost" not in await factory.list()
    dashboard = await _started(factory)
    try:
        answer = await _requeue_all_dead(dashboard, client)
        assert answer == {"moved": {ghost_id: ghost_id}, "unmovable": 2, "left": 2}
    finally:
        await dashboard.stop()
    listed = await factory.list()
    assert listed["ghost"] == factory.defaults.as_dict()
    assert (await (await factory.queue("ghost")).find(ghost_id)) is not None
    assert {v.message.id for v in await dead.peek(10, state="all")} == {bad_id, bare_id}


# with a token --------------------------------------------------------------------------


async def test_with_a_token_every_request_needs_it(factory: aio_keuss.Factory, client: Any) -> None:
    dashboard = await _started(factory, token=TOKEN)
    base = dashboard.url.rstrip("/")
    try:
        for path in ("/", "/static/app.js", "/static/app.css", "/api/state", "/nowhere"):
            async with client.get(base + path) as response:
                assert response.status == 401, path
                assert response.headers["X-Frame-Options"] == "DENY"
            async with client.get(
                base + path, headers={"Authorization": "Bearer " + TOKEN[:-1] + "x"}
            ) as response:
                assert response.status == 401, path
        async with client.get(
            base + "/api/state", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as response:
            assert response.status == 200
        async with client.post(
            base + "/api/pause",
            data=b'{"queue": "jobs"}',
            headers=_post_headers(dashboard),  # the CSRF token is not the access token
        ) as response:
            assert response.status == 401
        async with client.get(f"{base}/?token=wrong-token-0123456789") as response:
            assert response.status == 401
    finally:
        await dashboard.stop()


async def test_a_login_sets_a_strict_cookie_and_drops_the_token_from_the_address(
    factory: aio_keuss.Factory,
) -> None:
    dashboard = await _started(factory, token=TOKEN)
    base = dashboard.url.rstrip("/")
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
            async with session.get(f"{base}/?token={TOKEN}", allow_redirects=False) as response:
                assert response.status == 303
                assert response.headers["Location"] == "/"
                cookie = response.headers["Set-Cookie"]
                assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
            async with session.get(base + "/api/state") as response:
                assert response.status == 200
            async with session.post(
                base + "/api/pause", data=b'{"queue": "jobs"}', headers=_post_headers(dashboard)
            ) as response:
                assert response.status == 200
        assert await (await factory.queue("jobs")).is_paused()
    finally:
        await dashboard.stop()


# payloads ------------------------------------------------------------------------------


async def test_payloads_travel_as_json_text_never_as_markup(
    factory: aio_keuss.Factory, client: Any
) -> None:
    hostile = "<script>alert(1)</script>"
    jobs = await factory.queue("jobs")
    await jobs.push({"html": hostile}, headers={"x-note": hostile})
    dashboard = await _started(factory)
    try:
        async with client.get(dashboard.url + "api/messages?queue=jobs&state=all") as response:
            assert response.content_type == "application/json"
            assert response.headers["X-Content-Type-Options"] == "nosniff"
            found = (await response.json())["result"]
        assert any(hostile in m["payload"] and m["headers"]["x-note"] == hostile for m in found)
        async with client.get(dashboard.url) as response:
            assert hostile not in await response.text()  # the page is static; data comes as JSON
        async with client.get(dashboard.url + "static/app.js") as response:
            script = await response.text()
        assert "innerHTML" not in script and "insertAdjacentHTML" not in script
    finally:
        await dashboard.stop()


async def test_headers_and_payloads_show_line_breaks_and_bidi_controls_as_escapes(
    factory: aio_keuss.Factory, client: Any
) -> None:
    """Header values went to the page as stored: a line break forged a header line of its
    own (here a deadletter origin), a right-to-left override (U+202E) showed what follows
    reversed, so an operator read something else than what the message holds. Payload
    text kept such characters too (JSON escapes only those below U+0020)."""
    jobs = await factory.queue("jobs")
    forged = "1\nx-dl-from-queue: payments"
    reversed_ = "invoice \u202efdp.exe"
    await jobs.push(
        "a\u202eb\u2028c\x85d\u200fe",
        headers={"x-note": forged, "x-file": reversed_, "x-\u202ekey": "v"},
    )
    dashboard = await _started(factory)
    try:
        async with client.get(dashboard.url + "api/messages?queue=jobs&state=all") as response:
            found = (await response.json())["result"]
    finally:
        await dashboard.stop()
    shown = next(m for m in found if "x-note" in m["headers"])
    assert shown["headers"] == {
        "x-note": "1\\nx-dl-from-queue: payments",
        "x-file": "invoice \\u202efdp.exe",
        "x-\\u202ekey": "v",
    }
    assert shown["payload"] == '"a\\u202eb\\u2028c\\x85d\\u200fe"'
    assert payload_text({"a": 1}) == '{\n  "a": 1\n}'  # its own line breaks stay


def test_payload_text() -> None:
    assert payload_text(b"\x00\xff") == "(2 bytes) 00 ff"
    assert payload_text({"a": [1]}) == '{\n  "a": [\n    1\n  ]\n}'
    long = payload_text("x" * 10_000)
    assert len(long) < 4100 and long.endswith("more characters)")


async def test_rates_come_from_samples_of_the_counters(factory: aio_keuss.Factory) -> None:
    dashboard = Dashboard(factory, port=0, sample_every=60)
    board = dashboard.board
    await board.sample()
    await (await factory.queue("jobs")).push_many([{"n": i} for i in range(5)])
    await board.sample()
    series = board.rates()["jobs"]
    assert len(series) == 1
    _, pushed, done, total = series[0]
    assert pushed > 0 and done == 0 and total == 6


async def test_promote_makes_a_scheduled_message_ready_once(
    factory: aio_keuss.Factory, client: Any
) -> None:
    jobs = await factory.queue("jobs")
    later = await jobs.push("later", delay=3600)
    dashboard = await _started(factory)

    async def promote(body: bytes) -> tuple[int, Any]:
        url = dashboard.url + "api/promote"
        async with client.post(url, data=body, headers=_post_headers(dashboard)) as response:
            return response.status, await response.json()

    try:
        assert (await dashboard.board.state())["capabilities"]["promote"]
        assert await promote(b'{"queue": "jobs", "id": "%s"}' % later.encode()) == (
            200,
            {"result": True},
        )
        assert (await jobs.sizes()).scheduled == 0
        assert await promote(b'{"queue": "jobs", "id": "%s"}' % later.encode()) == (
            200,
            {"result": False},
        )
        assert (await promote(b'{"queue": "jobs", "id": 7}'))[0] == 400
        assert (await promote(b'{"queue": "nope", "id": "x"}'))[0] == 404
    finally:
        await dashboard.stop()


@pytest.mark.parametrize("backend", ["memory", "redis-oq"])
async def test_the_deadletter_view_shows_the_factorys_own_deadletter_queue(
    backend: str, client: Any
) -> None:
    """A factory connected with ``deadletter={"queue": "failed"}`` sends failed messages
    there; ``Dashboard(factory)`` showed ``__deadletter__`` instead ("no deadletter queue on
    this backend yet") while they piled up in ``failed``, and Requeue all named the wrong
    queue. It now takes the factory's deadletter queue unless told another."""
    pytest.importorskip("redis", reason="the redis extra is not installed")
    from backends import REDIS_URL, _drop_redis_prefix, new_token

    options: dict[str, Any] = {}
    if backend == "redis-oq":
        options = {"url": REDIS_URL, "prefix": f"akdashdl{new_token()}"}
    try:
        async with aio_keuss.connect(
            backend, deadletter={"max_ko": 0, "queue": "failed"}, **options
        ) as factory:
            jobs = await factory.queue("jobs")
            await jobs.push({"n": 1})
            message = await jobs.reserve(timeout=5)
            assert message is not None
            await jobs.ko(message)
            dashboard = await _started(factory)
            try:
                async with client.get(dashboard.url + "api/state") as response:
                    state = (await response.json())["result"]
                assert state["deadletter"] == "failed"
                assert [q["name"] for q in state["queues"] if q["deadletter"]] == ["failed"]
                async with client.post(
                    dashboard.url + "api/requeue",
                    data=b'{"queue": "failed", "ids": null}',
                    headers=_post_headers(dashboard),
                ) as response:
                    assert response.status == 200
                    answer = (await response.json())["result"]
                    assert answer["moved"] == {message.id: message.id}
            finally:
                await dashboard.stop()
            # told another, it shows that one
            other = Dashboard(factory, port=0, sample_every=60, deadletter="elsewhere")
            assert other.board.deadletter == "elsewhere"
    finally:
        if options:
            await _drop_redis_prefix(options)


async def test_requeue_all_reaches_movable_messages_behind_a_page_of_unmovable_ones(
    client: Any,
) -> None:
    """Requeue all took the first 1,000 ready messages of the deadletter queue and moved
    those it could: 1,000 with no ``x-dl-from-queue`` at the front hid every movable one
    behind them, click after click. It now walks past the unmovable ones (a bounded number
    per click) and answers with what moved, how many it left for want of a valid header, and
    how many ready messages the deadletter queue still has."""
    from aio_keuss.dashboard.board import REQUEUE_MAX

    async with aio_keuss.connect("memory") as factory:
        dead = await factory.queue("__deadletter__")
        await dead.push_many([{"n": n} for n in range(REQUEUE_MAX)])  # no header
        movable = [await dead.push({"n": n}, headers={"x-dl-from-queue": "jobs"}) for n in range(3)]
        dashboard = await _started(factory)
        try:
            answer = await _requeue_all_dead(dashboard, client)
        finally:
            await dashboard.stop()
        assert answer == {
            "moved": {i: i for i in movable},
            "unmovable": REQUEUE_MAX,
            "left": REQUEUE_MAX,
        }
        assert await (await factory.queue("jobs")).total_size() == 3

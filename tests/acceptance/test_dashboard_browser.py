"""The dashboard in a real browser: Debian's Chromium, headless, driven by Playwright.

The memory backend with the dashboard started in this process (the only way to see a memory
backend), and redis-oq, postgres and mongo with ``aio-keuss dashboard`` run as a command, the
test pushing through its own factory as another process would. The browser checks what a
user sees: the queue list, a push showing up in the sizes, pause and resume, requeue from
the deadletter view, a payload holding markup shown as text, and a refusal without the token
when the dashboard listens on a non-loopback address.

"A push shows up in the sizes within 2 s" is checked without a clock, which a busy machine
would break: the page refreshes every second (``POLL_MS``), and the test asserts the push is
shown by the second refresh that completes after it, the first one certain to have started
after the push; the time that took is printed.

The memory test takes the screenshots of docs/img: it writes them there when they are
missing or ``AIO_KEUSS_SCREENSHOTS=1`` is set (to refresh them after a change to the page),
else into the test's temporary directory, so a test run leaves the tree clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from backends import CASES, REDIS_URL, BackendCase, _drop_redis_prefix, new_token

import aio_keuss

pytest.importorskip("aiohttp", reason="the dashboard extra (aiohttp) is not installed")
playwright_api = pytest.importorskip(
    "playwright.async_api", reason="playwright (Python package) is not installed"
)

from aio_keuss.contract import Entry  # noqa: E402
from aio_keuss.dashboard import Dashboard  # noqa: E402
from aio_keuss.message import encode_headers, encode_payload  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):  # tests/services.sh installs it
    pytest.skip(
        f"{CHROMIUM} is missing: apt-get install chromium (make test does)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.timeout(180)
expect = playwright_api.expect

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "docs" / "img"
WAIT = 15000
"""ms for anything else to show: generous, nothing here is about speed."""
HOSTILE = "<script>window.pwned = 1</script><img src='x' onerror='window.pwned = 2'><b>not bold</b>"


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    async with playwright_api.async_playwright() as playwright:
        launched = await playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            yield launched
        finally:
            await launched.close()


async def _page(browser: Any) -> Any:
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    return await context.new_page()


def check_order(message: aio_keuss.Message) -> str:
    """A pipeline station's handler (the graphs name handlers; none runs here)."""
    return "shipped"


def notify(message: aio_keuss.Message) -> None:
    """Another station's handler."""


async def _refreshes(page: Any) -> int:
    return int(await page.locator("body").get_attribute("data-refreshes") or 0)


async def _check_push_shows(page: Any, queue: aio_keuss.Queue, expected: str) -> None:
    """Push one message; the refresh that began after it must show ``expected`` as ready."""
    started = time.monotonic()
    await queue.push({"pushed": "while watching"}, priority=4 if queue.capabilities.priority else 0)
    seen = await _refreshes(page)
    deadline = started + WAIT / 1000
    while await _refreshes(page) < seen + 2:  # a wait, not an assertion on time
        assert time.monotonic() < deadline, "the page stopped refreshing"
        await asyncio.sleep(0.05)
    assert await _row(page, queue.name).locator("td.ready").text_content() == expected
    print(f"push shown at the latest {time.monotonic() - started:.2f} s after it")


def test_the_page_refreshes_every_second() -> None:
    script = (ROOT / "aio_keuss" / "dashboard" / "static" / "app.js").read_text()
    assert "const POLL_MS = 1000;" in script


def _row(page: Any, queue: str) -> Any:
    return page.locator(f'#queues tr[data-queue="{queue}"]')


async def _ko_to_deadletter(queue: aio_keuss.Queue, payload: Any) -> str:
    """Push ``payload`` into an empty ``queue`` and ko it into the deadletter queue."""
    message_id = await queue.push(payload)
    message = await queue.reserve(timeout=5)
    assert message is not None and message.id == message_id
    await queue.ko(message)
    return message_id


async def _check_requeue_and_markup(page: Any, queue: aio_keuss.Queue, dead_id: str) -> None:
    dead_row = page.locator(f'#deadletter tr[data-id="{dead_id}"]')
    await expect(dead_row).to_be_visible(timeout=WAIT)
    await expect(dead_row.locator("td.from")).to_have_text(queue.name)
    # the markup in the payload is text: shown verbatim, nothing of it ran or rendered
    await expect(dead_row.locator("pre.payload")).to_contain_text(HOSTILE)
    assert await page.evaluate("window.pwned") is None
    assert await page.locator("#deadletter b").count() == 0
    assert await page.locator("#deadletter img").count() == 0
    assert await page.locator("script").count() == 1  # app.js only

    before = await queue.total_size()
    await dead_row.locator("button.requeue").click()
    await expect(dead_row).to_have_count(0, timeout=WAIT)
    found = await queue.find(dead_id)
    assert found is not None and found.queue == queue.name
    assert await queue.total_size() == before + 1


async def _check_pause_resume(page: Any, queue: aio_keuss.Queue) -> None:
    row = _row(page, queue.name)
    await row.locator("button.toggle").click()
    await expect(row.locator("td.state")).to_have_text("paused", timeout=WAIT)
    assert await queue.is_paused()
    await row.locator("button.toggle").click()
    await expect(row.locator("td.state")).to_have_text("running", timeout=WAIT)
    assert not await queue.is_paused()


# memory, in this process --------------------------------------------------------------


async def _traffic(queue: aio_keuss.Queue, stop: asyncio.Event) -> None:
    """Some pushes and takes so the rate charts of the screenshots have a shape."""
    n = 0
    while not stop.is_set():
        n += 1
        await queue.push_many([{"order": n, "item": i} for i in range(1 + n % 5)])
        for _ in range(n % 4):
            await queue.pop(timeout=0)
        await asyncio.sleep(0.1)


def _shots_dir(tmp_path: Path) -> Path:
    wanted = ("overview", "deadletter", "pipeline")
    missing = any(not (SHOTS / f"dashboard-{name}.png").exists() for name in wanted)
    if missing or os.environ.get("AIO_KEUSS_SCREENSHOTS") == "1":
        SHOTS.mkdir(parents=True, exist_ok=True)
        return SHOTS
    return tmp_path


async def test_dashboard_on_memory(browser: Any, tmp_path: Path) -> None:
    async with aio_keuss.connect("memory", deadletter={"max_ko": 0}) as factory:
        jobs = await factory.queue("jobs")
        orders = await factory.queue("orders")
        shipped = await factory.queue("shipped")
        await factory.queue("rejected")
        dead_id = await _ko_to_deadletter(jobs, {"note": HOSTILE})
        await jobs.push({"job": 1})
        scheduled_id = await shipped.push({"order": 0}, delay=3600)
        pipeline = factory.pipeline("orders-flow")
        pipeline.choice("orders", ["shipped", "rejected"], check_order)
        pipeline.sink("shipped", notify)
        pipeline.link("rejected", "orders", notify, name="retry")  # a cycle
        await pipeline.save()

        async with Dashboard(factory, port=0, sample_every=0.5) as dashboard:
            page = await _page(browser)
            await page.goto(dashboard.url)
            row = _row(page, "jobs")
            await expect(row.locator("td.ready")).to_have_text("1", timeout=WAIT)
            await expect(_row(page, "__deadletter__").locator("td.total")).to_have_text("1")
            for name in ("orders", "rejected", "shipped"):
                await expect(_row(page, name)).to_be_visible()

            await _check_push_shows(page, jobs, "2")

            await _check_pause_resume(page, jobs)

            await row.locator("button.peek").click()
            await expect(page.locator("#peek-queue")).to_have_text("jobs")
            await expect(page.locator("#peek tbody tr")).to_have_count(2, timeout=WAIT)
            priorities = page.locator("#peek tbody td.priority")
            await expect(priorities).to_have_text(["0", "4"])  # in (mature, push) order

            stop = asyncio.Event()
            traffic = asyncio.create_task(_traffic(orders, stop))
            try:
                await expect(
                    page.locator('#pipelines g.node[data-queue="orders"] text.size')
                ).to_contain_text("ready", timeout=WAIT)
                # a few samples of traffic for the charts: waited for in the page, not timed
                orders_row = _row(page, "orders")
                await expect(orders_row.locator("polyline").first).to_have_attribute(
                    "points", re.compile(r"^(\S+ ){9,}\S+$"), timeout=WAIT
                )
                await expect(orders_row.locator("span.figures")).to_have_text(
                    re.compile(r"^[1-9]"), timeout=WAIT
                )
                await _row(page, "shipped").locator("button.toggle").click()
                await expect(_row(page, "shipped").locator("td.state")).to_have_text(
                    "paused", timeout=WAIT
                )
                shots = _shots_dir(tmp_path)
                await page.screenshot(path=str(shots / "dashboard-overview.png"), full_page=True)
                await page.locator("#deadletter-section").screenshot(
                    path=str(shots / "dashboard-deadletter.png")
                )
                await page.locator("#pipelines-section").screenshot(
                    path=str(shots / "dashboard-pipeline.png")
                )
                assert (shots / "dashboard-overview.png").stat().st_size > 10_000
            finally:
                stop.set()
                await traffic

            await _check_requeue_and_markup(page, jobs, dead_id)
            await _check_promote(page, shipped, scheduled_id)


async def _check_promote(page: Any, queue: aio_keuss.Queue, scheduled_id: str) -> None:
    """A scheduled row of the peek has a Promote button (a ready one has none); clicked,
    the message is ready now and the row, redrawn by the refresh, says so."""
    await _row(page, queue.name).locator("button.peek").click()
    await expect(page.locator("#peek-queue")).to_have_text(queue.name)
    peeked = page.locator(f'#peek tbody tr[data-id="{scheduled_id}"]')
    await expect(peeked.locator("td").nth(1)).to_have_text("scheduled", timeout=WAIT)
    await peeked.locator("button.promote").click()
    await expect(peeked.locator("td").nth(1)).to_have_text("ready", timeout=WAIT)
    await expect(peeked.locator("button.promote")).to_have_count(0)
    assert (await queue.sizes()).scheduled == 0


async def test_queue_names_of_object_members_do_not_break_the_page(browser: Any) -> None:
    """Valid queue names such as ``constructor`` or ``__proto__`` are also names of members of
    every JavaScript object: looked up in the rates object before a series exists for them,
    they found a function or ``Object.prototype`` and the drawing stopped with a TypeError,
    leaving the queues after them, the deadletter view and the pipelines undrawn."""
    names = ["__proto__", "constructor", "hasOwnProperty", "jobs"]
    async with aio_keuss.connect("memory", deadletter={"max_ko": 0}) as factory:
        for name in names:
            await (await factory.queue(name)).push({"n": 1})
        # no second sample within the test: no queue has a rate series yet
        async with Dashboard(factory, port=0, sample_every=3600) as dashboard:
            page = await _page(browser)
            await page.goto(dashboard.url)
            await expect(page.locator("body")).to_have_attribute(
                "data-refreshes", re.compile(r"^[1-9]"), timeout=WAIT
            )
            for name in names:
                await expect(_row(page, name).locator("td.ready")).to_have_text("1")
                await expect(_row(page, name).locator("span.figures")).to_have_text("")
            await expect(page.locator("#status")).not_to_have_class("bad")


async def test_ids_and_headers_show_line_breaks_and_bidi_controls_as_escapes(
    browser: Any,
) -> None:
    """What an operator reads is what the message holds: an id (stored by another program:
    a push takes printable ids only) with a right-to-left override (U+202E) showed the rest
    reversed, and a header value's line break showed a forged header line; the page now
    shows them as escapes, while Requeue still names the message by its stored id."""
    odd_id = "invoice\u202efdp.exe"
    forged = "1\nx-dl-from-queue: payments"
    async with aio_keuss.connect("memory", deadletter={"max_ko": 0}) as factory:
        jobs = await factory.queue("jobs")
        dead = await factory.queue("__deadletter__")
        headers = {"x-dl-from-queue": "jobs", "x-note": forged}
        entry = Entry(odd_id, encode_payload("x"), encode_headers(headers))
        await dead._insert_entries([entry])  # as another program may have stored it
        async with Dashboard(factory, port=0, sample_every=3600) as dashboard:
            page = await _page(browser)
            await page.goto(dashboard.url)
            dead_row = page.locator("#deadletter tbody tr")
            await expect(dead_row).to_have_count(1, timeout=WAIT)
            assert await dead_row.locator("td.id").text_content() == "invoice\\u202efdp.exe"
            shown = await dead_row.locator("pre").first.text_content()
            assert shown == "x-dl-from-queue: jobs\nx-note: 1\\nx-dl-from-queue: payments"
            await _row(page, "__deadletter__").locator("button.peek").click()
            peeked = page.locator("#peek tbody tr")
            await expect(peeked).to_have_count(1, timeout=WAIT)
            assert await peeked.locator("td.id").text_content() == "invoice\\u202efdp.exe"
            await dead_row.locator("button.requeue").click()
            await expect(dead_row).to_have_count(0, timeout=WAIT)
            found = await jobs.find(odd_id)
            assert found is not None and found.queue == "jobs"


async def test_a_late_answer_for_another_queue_never_fills_the_peek(browser: Any) -> None:
    """Peek at alpha, then at beta before alpha's messages came back: alpha's late answer
    must not replace beta's rows under the heading "Messages in beta" (until a refresh
    drew beta's again). The page counts the answers it has read, so the test waits for
    alpha's to be read, and an observer records any alpha row ever drawn."""
    async with aio_keuss.connect("memory") as factory:
        await (await factory.queue("alpha")).push({"n": 1}, id="from-alpha")
        await (await factory.queue("beta")).push({"n": 2}, id="from-beta")
        async with Dashboard(factory, port=0, sample_every=3600) as dashboard:
            page = await _page(browser)
            await page.add_init_script(
                """
                window.alphaRead = 0;
                window.alphaDrawn = false;
                const json = Response.prototype.json;
                Response.prototype.json = async function () {
                  const value = await json.call(this);
                  if (this.url.includes("queue=alpha&")) window.alphaRead += 1;
                  return value;
                };
                new MutationObserver(() => {
                  if (document.querySelector('#peek tr[data-id="from-alpha"]')) {
                    window.alphaDrawn = true;
                  }
                }).observe(document, { subtree: true, childList: true });
                """
            )
            release = asyncio.Event()
            held: list[Any] = []

            async def hold_alpha(route: Any) -> None:
                held.append(route)
                await release.wait()
                await route.continue_()

            await page.route(re.compile(r"/api/messages\?queue=alpha&"), hold_alpha)
            await page.goto(dashboard.url)
            await expect(_row(page, "beta").locator("td.ready")).to_have_text("1", timeout=WAIT)
            await _row(page, "alpha").locator("button.peek").click()
            await _row(page, "beta").locator("button.peek").click()
            await expect(page.locator('#peek tr[data-id="from-beta"]')).to_be_visible(timeout=WAIT)
            assert held, "alpha's peek was asked for"
            asked = len(held)
            release.set()
            # a bound against a hang, longer than WAIT: once released, the answer goes
            # through the route's handler, the browser's network stack and the page's
            # reading, each of which a loaded machine (the full suite beside it) delays.
            # Polled from here: wait_for_function polls by evaluating a string in the page,
            # which the page's own policy (script-src 'self', no eval) refuses whenever the
            # first look finds the answer not read yet
            deadline = time.monotonic() + 4 * WAIT / 1000
            while await page.evaluate("window.alphaRead") < asked:
                assert time.monotonic() < deadline, "alpha's late answer was never read"
                await asyncio.sleep(0.05)
            assert not await page.evaluate("window.alphaDrawn")
            await expect(page.locator("#peek-queue")).to_have_text("beta")
            await expect(page.locator('#peek tr[data-id="from-beta"]')).to_be_visible()


# real servers, through the command --------------------------------------------------------


@contextlib.contextmanager
def _command(*args: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "aio_keuss", "dashboard", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def _served_url(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    line = await asyncio.to_thread(process.stdout.readline)
    assert "serving http://" in line, (line, process.stderr.read() if process.stderr else "")
    return line.rsplit(" ", 1)[1].strip()


@pytest.fixture
async def redis_options() -> AsyncIterator[dict[str, Any]]:
    pytest.importorskip("redis", reason="the redis extra is not installed")
    options = {"url": REDIS_URL, "prefix": f"akdash{new_token()}"}
    yield options
    await _drop_redis_prefix(options)


COMMAND_CASES = [case for case in CASES if case.id in ("redis-oq", "postgres", "mongo")]


@pytest.fixture(params=COMMAND_CASES, ids=lambda case: case.id)
async def served_case(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    case: BackendCase = request.param
    async with case.keys() as options:
        yield case.name, options


def _backend_flags(name: str, options: dict[str, Any]) -> list[str]:
    flags = ["--backend", name]
    for key, value in options.items():
        flags += ["--url", value] if key == "url" else ["--option", f"{key}={value}"]
    return flags


async def test_dashboard_command(browser: Any, served_case: tuple[str, dict[str, Any]]) -> None:
    name, options = served_case
    async with aio_keuss.connect(name, deadletter={"max_ko": 0}, **options) as factory:
        orders = await factory.queue("orders")
        dead_id = await _ko_to_deadletter(orders, {"note": HOSTILE})
        await orders.push({"order": 1})
        pipeline = factory.pipeline("flow")
        pipeline.link("orders", "shipped", notify)
        await pipeline.save()
        with _command(*_backend_flags(name, options), "--sample-seconds", "1") as process:
            url = await _served_url(process)
            assert url.startswith("http://127.0.0.1:")
            page = await _page(browser)
            await page.goto(url)
            row = _row(page, "orders")
            await expect(row.locator("td.ready")).to_have_text("1", timeout=WAIT)
            await _check_push_shows(page, orders, "2")
            graph = page.locator('#pipelines .pipeline[data-pipeline="flow"]')
            await expect(graph.locator('g.node[data-queue="orders"] text.size')).to_have_text(
                "2 ready, 2 total", timeout=WAIT
            )
            await expect(graph.locator('g.node[data-queue="shipped"]')).to_be_visible()
            await _check_pause_resume(page, orders)
            await _check_requeue_and_markup(page, orders, dead_id)


async def test_dashboard_refuses_requests_without_the_token(
    browser: Any, redis_options: dict[str, Any]
) -> None:
    with _command("--host", "0.0.0.0") as refused:  # a non-loopback address, no token
        assert await asyncio.to_thread(refused.wait, 60) == 2
        assert refused.stderr is not None and "--token" in refused.stderr.read()

    token = new_token() + new_token()
    async with aio_keuss.connect("redis-oq", **redis_options) as factory:
        await (await factory.queue("visible")).push({"n": 1})
        with _command(
            "--host",
            "0.0.0.0",
            "--backend",
            "redis-oq",
            "--url",
            redis_options["url"],
            "--option",
            f"prefix={redis_options['prefix']}",
            env={"AIO_KEUSS_DASHBOARD_TOKEN": token},
        ) as process:
            port = (await _served_url(process)).rstrip("/").rsplit(":", 1)[1]
            base = f"http://127.0.0.1:{port}"

            page = await _page(browser)
            response = await page.goto(base + "/")
            assert response.status == 401
            await expect(page.locator("body")).to_contain_text("token")
            assert await page.locator("#queues").count() == 0

            for path in ("/api/state", "/static/app.js"):
                with pytest.raises(urllib.error.HTTPError) as refused_http:
                    await asyncio.to_thread(urllib.request.urlopen, base + path)
                assert refused_http.value.code == 401

            response = await page.goto(f"{base}/?token={token}")
            assert response.status == 200
            assert "token" not in page.url  # the cookie carries it from now on
            await expect(_row(page, "visible").locator("td.ready")).to_have_text("1", timeout=WAIT)


async def test_a_deadlettered_row_shows_what_the_message_holds_now(
    browser: Any, redis_options: dict[str, Any]
) -> None:
    """The deadletter view kept each row as first drawn, by id: a message requeued (here to
    another queue) and deadlettered again between two refreshes kept its old row, "Failed
    in" naming the queue it failed in before and its old tries and headers. Rows are drawn
    again when what the server sends for them changes. The page's peeks of the deadletter
    queue are held while the message goes round, so it is there at every refresh."""
    async with aio_keuss.connect("redis-oq", deadletter={"max_ko": 0}, **redis_options) as factory:
        jobs = await factory.queue("jobs")
        other = await factory.queue("other")
        dead = await factory.queue("__deadletter__")
        dead_id = await _ko_to_deadletter(jobs, {"n": 1})
        async with Dashboard(factory, port=0, sample_every=3600) as dashboard:
            page = await _page(browser)
            await page.goto(dashboard.url)
            dead_row = page.locator(f'#deadletter tr[data-id="{dead_id}"]')
            await expect(dead_row.locator("td.from")).to_have_text("jobs", timeout=WAIT)

            release = asyncio.Event()

            async def hold(route: Any) -> None:
                await release.wait()
                await route.continue_()

            pattern = re.compile(r"/api/messages\?queue=__deadletter__&")
            await page.route(pattern, hold)
            assert await dead.requeue([dead_id], origin="other") == {dead_id: dead_id}
            message = await other.reserve(timeout=5)
            assert message is not None and message.id == dead_id
            await other.ko(message)
            found = await dead.find(dead_id)
            assert found is not None and found.queue == "__deadletter__"
            await page.unroute(pattern)
            release.set()
            await expect(dead_row.locator("td.from")).to_have_text("other", timeout=WAIT)
            await expect(dead_row.locator("pre").first).to_contain_text("x-dl-from-queue: other")


async def test_the_command_shows_the_deadletter_queue_its_connection_names(
    redis_options: dict[str, Any],
) -> None:
    """``aio-keuss dashboard`` reads the connection as the worker does (flags, environment,
    --config), ``deadletter`` option included: connected with a deadletter queue named
    ``failed``, it still showed ``__deadletter__`` unless --deadletter-queue said otherwise
    as well. It now shows the one the connection names; the flag still wins."""
    dead = '{"max_ko": 0, "queue": "failed"}'
    async with aio_keuss.connect(
        "redis-oq", deadletter={"max_ko": 0, "queue": "failed"}, **redis_options
    ) as factory:
        await _ko_to_deadletter(await factory.queue("jobs"), {"n": 1})
    flags = ["--backend", "redis-oq", "--url", redis_options["url"]]
    flags += ["--option", f"prefix={redis_options['prefix']}", "--option", f"deadletter={dead}"]
    for extra, shown in (([], "failed"), (["--deadletter-queue", "jobs"], "jobs")):
        with _command(*flags, *extra) as process:
            url = await _served_url(process)
            with await asyncio.to_thread(urllib.request.urlopen, url + "api/state") as answer:
                state = orjson.loads(answer.read())["result"]
            assert state["deadletter"] == shown


async def test_a_requeue_that_moved_nothing_says_so(
    browser: Any, redis_options: dict[str, Any]
) -> None:
    """Requeue leaves alone a message whose ``x-dl-from-queue`` names no queue (anyone may
    push into a deadletter queue), one under an active reservation and one gone meanwhile,
    and answers with what it moved: nothing. The page said "done" all the same, the row
    still there, as if it had worked. It now says the message was not requeued, as
    Promote does for a message no longer scheduled."""
    async with aio_keuss.connect("redis-oq", deadletter={"max_ko": 0}, **redis_options) as factory:
        dead = await factory.queue("__deadletter__")
        stray = await dead.push({"n": 1}, headers={"x-dl-from-queue": "not a queue!"})
        async with Dashboard(factory, port=0, sample_every=3600) as dashboard:
            page = await _page(browser)
            await page.goto(dashboard.url)
            row = page.locator(f'#deadletter tr[data-id="{stray}"]')
            await expect(row.locator("td.from")).to_have_text("not a queue!", timeout=WAIT)
            await row.locator("button.requeue").click()
            await expect(page.locator("#status")).to_have_class("bad", timeout=WAIT)
            await expect(page.locator("#status")).to_contain_text("not requeued")
            found = await dead.find(stray)
            assert found is not None and found.queue == "__deadletter__"


STATUSES = """() => {
    window.statuses = [];
    new MutationObserver(() => {
        window.statuses.push(document.getElementById("status").textContent);
    }).observe(document.body, { attributes: true, attributeFilter: ["data-refreshes"] });
}"""
"""Records the status each completed refresh leaves, read as it completes (the observer runs
before any other refresh can): which refreshes showed an outcome, without timing any."""


async def test_requeue_all_says_how_many_moved_and_keeps_a_shortfall_shown(
    browser: Any, redis_options: dict[str, Any]
) -> None:
    """Requeue all said "done" whatever moved, the count the server answers never shown:
    with one message of two whose x-dl-from-queue names no queue, half stayed in the
    deadletter queue unsaid. It now says how many moved of how many, and a shortfall is
    a failure shown over the refreshes that follow, as for a single Requeue."""
    async with aio_keuss.connect("redis-oq", deadletter={"max_ko": 0}, **redis_options) as factory:
        dead = await factory.queue("__deadletter__")
        stray = await dead.push({"n": 1}, headers={"x-dl-from-queue": "not a queue!"})
        failed = await _ko_to_deadletter(await factory.queue("orders"), {"n": 2})
        async with Dashboard(factory, port=0, sample_every=3600) as dashboard:
            page = await _page(browser)
            await page.goto(dashboard.url)
            for message_id in (stray, failed):
                row = page.locator(f'#deadletter tr[data-id="{message_id}"]')
                await expect(row).to_be_visible(timeout=WAIT)
            await page.evaluate(STATUSES)
            await page.locator("#dl-requeue-all").click()
            status = page.locator("#status")
            await expect(status).to_contain_text("requeued 1 of 2", timeout=WAIT)
            await expect(status).to_have_class("bad")
            await page.wait_for_function(  # until a refresh after the outcome's says "updated"
                """() => {
                    const first = window.statuses.findIndex((s) => s.includes("requeued 1 of 2"));
                    return first >= 0 && window.statuses.slice(first).some(
                        (s) => s.startsWith("updated"));
                }""",
                timeout=WAIT * 2,
            )
            statuses = await page.evaluate("window.statuses")
            shown = [s for s in statuses if "requeued 1 of 2" in s]
            assert len(shown) == 5, statuses  # the failure stays over five refreshes
            found = await dead.find(stray)
            assert found is not None and found.queue == "__deadletter__"
            assert await (await factory.queue("orders")).find(failed) is not None

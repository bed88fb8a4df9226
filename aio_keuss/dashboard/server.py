"""The dashboard's HTTP server, on aiohttp.

aiohttp because it is both the server and the framework in one dependency that runs in the
caller's event loop: the dashboard can be started next to an application's own factory
(the memory backend is only visible that way) or by ``aio-keuss dashboard``, with no ASGI
server to choose and configure. The page is three static files shipped in the package and
a JSON API it polls; nothing is loaded from another site, so it works offline.

Routes (see :mod:`aio_keuss.dashboard.security` for what every request must show)::

    GET  /                      the page (with this process's CSRF token in a meta tag)
    GET  /static/app.js|app.css
    GET  /api/state             queues, sizes, paused, counters, rates, pipelines
    GET  /api/messages?queue=&state=&n=   a peek, without taking anything
    POST /api/pause | /api/resume         {"queue": name}
    POST /api/requeue           {"queue": deadletter queue, "ids": [...] or null for all}
                                (null: answered with moved, unmovable and left)
    POST /api/promote           {"queue": name, "id": a scheduled message's id}
"""

from __future__ import annotations

import html
import json
import logging
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

import orjson
from aiohttp import web

from ..errors import InvalidInputError, KeussConnectionError, KeussError, NotSupportedError
from ..factory import Factory
from . import security
from .board import Board, UnknownQueueError

log = logging.getLogger("aio_keuss.dashboard")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_STATIC = {"app.js": "text/javascript", "app.css": "text/css"}
_MAX_BODY = 256 * 1024


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text("utf-8")


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=orjson.dumps(data),
        status=status,
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


def _refused(status: int, reason: str) -> web.Response:
    return web.Response(
        text=f"{status}: {reason}\n",
        status=status,
        content_type="text/plain",
        headers={"Cache-Control": "no-store"},
    )


class Dashboard:
    """The dashboard of one factory: ``await start()`` (or ``async with``), then ``stop()``.

    ``host`` defaults to loopback; any other address needs ``token``. ``port=0`` takes a
    free port (read it back from :attr:`port`). ``deadletter`` defaults to the factory's
    deadletter queue (see :class:`~aio_keuss.dashboard.board.Board`). The factory stays the
    caller's to close.
    """

    def __init__(
        self,
        factory: Factory,
        *,
        host: str = "127.0.0.1",
        port: int = 8080,
        token: str | None = None,
        deadletter: str | None = None,
        sample_every: float = 5.0,
    ) -> None:
        security.check_bind(host, token)
        self.host = host
        self.port = port
        self.token = token
        self.csrf = security.new_csrf_token()
        self.board = Board(factory, deadletter=deadletter, sample_every=sample_every)
        self._runner: web.AppRunner | None = None
        index = _asset("index.html")
        self._index = index.replace("{{csrf}}", html.escape(self.csrf, quote=True))

    @property
    def cookie(self) -> str:
        """The login cookie's name: one per port, as cookies are shared by every port of a
        host and two dashboards on one machine would otherwise log each other out."""
        return f"{security.COOKIE}_{self.port}"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=_MAX_BODY)
        app.on_response_prepare.append(_secure_headers)
        app.router.add_get("/", self._page)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/state", self._state)
        app.router.add_get("/api/messages", self._messages)
        app.router.add_post("/api/pause", self._pause)
        app.router.add_post("/api/resume", self._resume)
        app.router.add_post("/api/requeue", self._requeue)
        app.router.add_post("/api/promote", self._promote)
        return app

    async def start(self) -> None:
        await self.board.start()
        self._runner = web.AppRunner(self.app(), access_log=None)
        try:
            await self._runner.setup()
            await web.TCPSite(self._runner, self.host, self.port).start()
        except BaseException:  # e.g. the port is taken: leave nothing running
            await self.stop()
            raise
        if self.port == 0:
            self.port = int(self._runner.addresses[0][1])
        log.info("dashboard on %s", self.url)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        await self.board.stop()

    async def __aenter__(self) -> Dashboard:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    # the checks every request goes through ----------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.token is None:
            if not security.loopback_host_header(request.host):
                return _refused(421, "this dashboard answers to localhost only")
        else:
            login = request.query.get("token")
            if login is not None and request.method == "GET":
                return self._login(login)
            given = security.bearer(request.headers.get("Authorization")) or request.cookies.get(
                self.cookie
            )
            if not security.same_secret(self.token, given):
                return _refused(401, "a token is needed: open /?token=<token>")
        if request.method == "POST":
            refusal = self._post_refusal(request)
            if refusal is not None:
                return _refused(403, refusal)
        return await handler(request)

    def _login(self, given: str) -> web.StreamResponse:
        assert self.token is not None
        if not security.same_secret(self.token, given):
            return _refused(401, "wrong token")
        # always to the page itself: a path from the request ("//elsewhere") could send the
        # browser to another site
        response = web.Response(status=303, headers={"Location": "/"})
        response.set_cookie(self.cookie, self.token, httponly=True, samesite="Strict", path="/")
        return response

    def _post_refusal(self, request: web.Request) -> str | None:
        if not security.same_origin(
            request.headers.get("Origin"),
            request.headers.get("Sec-Fetch-Site"),
            request.host,
        ):
            return "cross-site request refused"
        if not security.same_secret(self.csrf, request.headers.get(security.CSRF_HEADER)):
            return "missing or wrong CSRF token"
        if request.content_type != "application/json":
            return "a JSON body is required"
        return None

    # pages and API -----------------------------------------------------------------------

    async def _page(self, _: web.Request) -> web.Response:
        return web.Response(
            text=self._index, content_type="text/html", headers={"Cache-Control": "no-store"}
        )

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        kind = _STATIC.get(name)
        if kind is None:
            raise web.HTTPNotFound()
        return web.Response(text=_asset(name), content_type=kind)

    async def _state(self, _: web.Request) -> web.Response:
        return await _answer(self.board.state())

    async def _messages(self, request: web.Request) -> web.Response:
        try:
            n = int(request.query.get("n", "50"))
        except ValueError:
            return _json({"error": "n must be an int"}, 400)
        state = request.query.get("state", "all")
        return await _answer(self.board.peek(request.query.get("queue"), state, n))

    async def _pause(self, request: web.Request) -> web.Response:
        body = await _body(request)
        return await _answer(self.board.pause(body.get("queue"), True))

    async def _resume(self, request: web.Request) -> web.Response:
        body = await _body(request)
        return await _answer(self.board.pause(body.get("queue"), False))

    async def _requeue(self, request: web.Request) -> web.Response:
        body = await _body(request)
        return await _answer(self.board.requeue(body.get("queue"), body.get("ids")))

    async def _promote(self, request: web.Request) -> web.Response:
        body = await _body(request)
        return await _answer(self.board.promote(body.get("queue"), body.get("id")))


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json(loads=json.loads)
    # RecursionError: nested deeper than json reads; LookupError: a charset Python lacks
    except (ValueError, RecursionError, LookupError):
        raise web.HTTPBadRequest(text="the body is not JSON") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="the body must be a JSON object")
    return body


async def _answer(work: Awaitable[Any]) -> web.Response:
    """The result as JSON, or the library's error as a status a page can show."""
    try:
        return _json({"result": await work})
    except UnknownQueueError as exc:
        return _json({"error": str(exc)}, 404)
    except InvalidInputError as exc:
        return _json({"error": str(exc)}, 400)
    except NotSupportedError as exc:
        return _json({"error": str(exc)}, 409)
    except KeussConnectionError as exc:
        return _json({"error": f"backend unreachable: {exc}"}, 503)
    except KeussError as exc:
        log.warning("dashboard request failed: %r", exc)
        return _json({"error": str(exc)}, 500)


async def _secure_headers(_: web.Request, response: web.StreamResponse) -> None:
    response.headers.update(security.SECURITY_HEADERS)


async def serve(factory: Factory, **options: Any) -> Dashboard:
    """Start a :class:`Dashboard` of ``factory``; stop it with ``await dashboard.stop()``."""
    dashboard = Dashboard(factory, **options)
    await dashboard.start()
    return dashboard

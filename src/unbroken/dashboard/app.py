"""``unbroken dashboard``: a read-only web page over a cluster, live (server-sent events).

Pages: ``/`` (nodes, jobs, checkpoints, events), ``/jobs/{name}`` (progress and the step-over-time
plot with its faults, detections, resumes and lost steps), ``/nodes/{name}``. Their data comes
from ``/api/...`` and, live, from ``/api/stream``, which pushes a new snapshot whenever one
changes (checked twice a second). Assets ship in the package; nothing is fetched from the
internet.

Access: on loopback it is open, like the CLI; bound anywhere else every request needs the
token (``Authorization: Bearer ...``, or ``?token=...`` once, which leaves a cookie), else 401.
An unknown job or node is a 404 page, never a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from unbroken.dashboard import views
from unbroken.errors import NotFoundError
from unbroken.runtime import Runtime

COOKIE = "unbroken_token"
PUSH_SECONDS = 0.5
"""How often the stream looks for a change: a node turning faulty shows within this (plus its own detection)."""


def create_app(runtime: Runtime, *, token: str | None = None) -> FastAPI:
    """The dashboard for ``runtime``; with a ``token``, every request must carry it."""
    app = FastAPI(title="unbroken dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    static = resources.files("unbroken.dashboard").joinpath("static")
    app.mount("/static", StaticFiles(directory=str(static)), name="static")

    def page(name: str, status_code: int = 200, **fill: str) -> HTMLResponse:
        text = static.joinpath(name).read_text()
        for key, value in fill.items():
            text = text.replace("{{" + key + "}}", _escape(value))
        return HTMLResponse(text, status_code=status_code)

    def not_found(what: str) -> HTMLResponse:
        return page("404.html", 404, what=what)

    if token is not None:
        @app.middleware("http")
        async def require_token(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            given = _presented(request)
            if given is None or not hmac.compare_digest(given, token):
                if request.url.path.startswith("/api/"):
                    return JSONResponse({"error": "a token is needed: Authorization: Bearer <token>"}, status_code=401)
                return page("401.html", 401)
            response = await call_next(request)
            if request.query_params.get("token"):
                response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
            return response

    @app.get("/", response_class=HTMLResponse)
    def overview() -> HTMLResponse:
        return page("index.html")

    @app.get("/jobs/{name}", response_class=HTMLResponse)
    def job_page(name: str) -> HTMLResponse:
        if not _exists(lambda: runtime.cluster.get_job(name)):
            return not_found(f"job {name}")
        return page("job.html")

    @app.get("/nodes/{name}", response_class=HTMLResponse)
    def node_page(name: str) -> HTMLResponse:
        if not _exists(lambda: runtime.cluster.get_node(name)):
            return not_found(f"node {name}")
        return page("node.html")

    @app.get("/api/snapshot")
    def snapshot() -> dict[str, Any]:
        return views.snapshot(runtime, runtime.clock())

    @app.get("/api/jobs/{name}/timeline")
    def timeline(name: str) -> Response:
        try:
            return JSONResponse(views.timeline(runtime, name, runtime.clock()))
        except NotFoundError as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)

    @app.get("/api/nodes/{name}")
    def node(name: str) -> Response:
        try:
            detail = views.node_detail(runtime, name, runtime.clock())
        except NotFoundError as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)
        events = [views.event_row(e) for e in runtime.cluster.list_events(object_kind="Node", object_name=name)]
        return JSONResponse({"node": detail, "events": events})

    @app.get("/api/stream")
    async def stream(request: Request, job: str | None = None, node: str | None = None) -> StreamingResponse:
        return StreamingResponse(_changes(request, runtime, job, node), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    return app


async def _changes(request: Request, runtime: Runtime, job: str | None, node: str | None) -> AsyncIterator[str]:
    """A ``data:`` event each time the snapshot (and the job's timeline, or the node) differs from the last one sent."""
    last = ""
    while not await request.is_disconnected():
        data = await asyncio.to_thread(_state, runtime, job, node)
        encoded = json.dumps(data, sort_keys=True, default=str)
        if encoded != last:
            last = encoded
            yield f"data: {encoded}\n\n"
        await asyncio.sleep(PUSH_SECONDS)


def _state(runtime: Runtime, job: str | None, node: str | None) -> dict[str, Any]:
    now = runtime.clock()
    data: dict[str, Any] = {"snapshot": views.snapshot(runtime, now)}
    if job:
        try:
            data["timeline"] = views.timeline(runtime, job, now)
        except NotFoundError:
            data["timeline"] = None
    if node:
        try:
            data["node"] = views.node_detail(runtime, node, now)
        except NotFoundError:
            data["node"] = None
    # ages tick every second; send them rounded so an idle cluster is not a change twice a second
    for row in [*data["snapshot"]["nodes"], *([data["node"]] if data.get("node") else [])]:
        if row["heartbeat_age_s"] is not None:
            row["heartbeat_age_s"] = int(row["heartbeat_age_s"])
    for row in data["snapshot"]["checkpoints"]:
        if row["age_s"] is not None:
            row["age_s"] = int(row["age_s"])
    if data.get("timeline"):
        data["timeline"]["now"] = int(data["timeline"]["now"])
    return data


def _presented(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.query_params.get("token") or request.cookies.get(COOKIE)


def _exists(get: Callable[[], object]) -> bool:
    try:
        get()
    except NotFoundError:
        return False
    return True


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")

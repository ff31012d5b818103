"""`/ui`: the dashboard, server-rendered with Jinja2 (no front-end build, no CDN).

- `/ui`: the rollouts table (filters, sort, search, pages; live updates by polling a fragment)
- `/ui/rollouts/{id}`: one rollout, its calls in order with logprobs and sample decisions
- `/ui/runs`, `/ui/runs/{name}`: training runs and their curves (inline SVG)
- `/ui/runs/{name}/fidelity`: `reins doctor`'s report of a run's recorded rollouts

Auth is the admin key: as `Authorization: Bearer KEY` (scripts, AI agents), or once through
`/ui/login`, which sets an HttpOnly cookie derived from the key (browsers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import hashlib
import hmac
import inspect
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, cast, get_args
from urllib.parse import parse_qs, quote, urlencode, urlsplit

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.routing import APIRoute
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup, escape

from reins.doctor.report import format_boundary
from reins.gateway.settings import GatewaySettings
from reins.gateway.store import NotFound, RolloutQuery, RolloutSort, Store
from reins.monitor import fidelity, svg, tokens
from reins.monitor.panels import charts
from reins.monitor.prometheus import CONTENT_TYPE
from reins.monitor.rollout import LOW_P, AttemptView, Token, attempt_view
from reins.monitor.runs import (
    Run,
    list_runs,
    load_run,
    number,
    run_names,
    run_path,
    runs_dir_problem,
)
from reins.monitor.tokens import TokenText
from reins.packed import unpack_events
from reins.schemas import Mode, PackedEvent, RolloutState

log = logging.getLogger(__name__)

COOKIE = "reins_ui"
PAGE_SIZE = 50
MAX_PAGE = 10**9
"""Page numbers past this are read as the last page (a larger offset overflows the database)."""
MAX_SEQ = 2**62
"""Event seqs past this exist in no store (they overflow its 64-bit integers)."""
MAX_LOGIN_BODY = 16 * 1024
"""The login form is read before anyone is authenticated: keep it small."""
MAX_FILTER = 1000
"""Characters of a run, group or search filter read from the URL."""
POLL_S = 3
STATES: tuple[str, ...] = get_args(RolloutState)
SORTS: tuple[str, ...] = get_args(RolloutSort)

templates = Environment(
    loader=FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=select_autoescape(["html"]),
    trim_blocks=True,
    lstrip_blocks=True,
)


def session_cookie(api_key: str) -> str:
    """The cookie value that stands for the admin key: an HMAC of it, never the key itself."""
    return hmac.new(api_key.encode(), b"reins-ui-session-v1", hashlib.sha256).hexdigest()


def require_viewer(request: Request) -> None:
    """The admin key as a bearer header, or the login cookie; a browser without either is sent
    to the login page."""
    if "authorization" in request.headers:
        request.app.state.auth.admin(request)
        return
    settings: GatewaySettings = request.app.state.settings
    cookie = request.cookies.get(COOKIE, "")
    if cookie and hmac.compare_digest(cookie, session_cookie(settings.api_key)):
        return
    # The path as the browser sent it, still percent-encoded: `request.url.path` is decoded, so a
    # run folder named `%41` came back after the login as `/ui/runs/%41`, which is run `A`.
    raw_path = request.scope.get("raw_path") or quote(request.url.path).encode()
    target = raw_path.decode("latin-1") + (f"?{request.url.query}" if request.url.query else "")
    raise HTTPException(
        303, "log in first", headers={"Location": f"/ui/login?next={quote(target)}"}
    )


# -- formatting for the templates ---------------------------------------------------------------


def _when(value: Any) -> str:
    """A datetime or Unix time as local time. A run's `time` comes from metrics.jsonl, which any
    tool may write: what is not a Unix time a clock can show is shown as written."""
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.astimezone().strftime("%Y-%m-%d %H:%M:%S")
    seconds = number(value)
    if seconds is None:
        return str(value)
    try:
        return datetime.fromtimestamp(seconds, UTC).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):  # past the platform's time_t
        return str(value)


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return ""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} m {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} m"


def _count(value: float | None) -> str:
    if value is None:
        return ""
    if abs(value) >= 1e6:
        return f"{value / 1e6:.1f}M"
    if abs(value) >= 1e4:
        return f"{value / 1e3:.1f}k"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:.4g}"


def _number(value: Any, digits: int = 3) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "" if value is None else str(value)
    return f"{value:.{digits}f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)


def _token_class(token: Token) -> str:
    p = token.p
    if p is None:
        return "tn"
    for level, bound in enumerate((0.01, LOW_P, 0.3, 0.6, 0.9)):
        if p < bound:
            return f"t{level}"
    return "t5"


def _token_text(token: Token) -> str:
    text = token.text.replace("\n", "↵").replace("\t", "⇥")
    return text if text else "∅"


def _token_strip(tokens: list[Token]) -> Markup:
    """A call's response tokens as spans (class: probability level; title: id, logprob, p).
    Built here rather than in the template: Jinja's loop took ~3 s for a long rollout's 90k
    tokens."""
    spans = []
    for token in tokens:
        title = f"id {token.token_id}"
        if token.logprob is not None:
            title += f" · logprob {_number(token.logprob, 3)} · p {_number(token.p, 3)}"
        kind = _token_class(token) + (" id" if token.is_id else "")
        spans.append(
            f'<span class="{kind}" title="{escape(title)}">{escape(_token_text(token))}</span>'
        )
    return Markup("".join(spans))


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=1, default=str)


def _url_part(value: Any) -> str:
    """A value as a URL's path segment or query value, in place of Jinja's `urlencode`, which
    reads a list or a dict as key/value pairs: a rollout whose `metadata.run` was a list made
    the rollouts table a 500 for everyone. Any other value is its JSON text."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return quote(text, safe="/")


templates.filters.update(
    when=_when,
    duration=_duration,
    count=_count,
    num=_number,
    token_strip=_token_strip,
    pretty=_json,
    urlencode=_url_part,
)


def _html(name: str, **context: Any) -> HTMLResponse:
    return HTMLResponse(templates.get_template(name).render(**context))


# -- the rollouts table -------------------------------------------------------------------------


def _query(request: Request) -> tuple[RolloutQuery, dict[str, Any]]:
    """The table's query from the URL, and the parameters to rebuild its links."""
    params = request.query_params
    states = [s for s in params.getlist("status") if s in STATES]
    mode = params.get("mode") if params.get("mode") in ("train", "val") else None
    sort = params.get("sort", "created")
    sort = sort if sort in SORTS else "created"
    descending = params.get("dir", "desc") != "asc"
    raw_page = params.get("page", "1").strip()
    try:
        page = int(raw_page) if len(raw_page) < 12 else -1 if raw_page[0] == "-" else MAX_PAGE
    except ValueError:
        page = 1
    page = min(max(1, page), MAX_PAGE)
    # A run or group is matched exactly, as named: " lead" is not "lead", and a run's name may
    # have up to 255 bytes (`run_path`). Only the search text is trimmed.
    text = {key: (params.get(key) or "")[:MAX_FILTER] for key in ("run", "group")}
    text["q"] = (params.get("q") or "").strip()[:MAX_FILTER]
    query = RolloutQuery(
        states=cast(list[RolloutState], states),
        mode=cast(Mode | None, mode),
        group_id=text["group"] or None,
        run=text["run"] or None,
        search=text["q"] or None,
        sort=cast(RolloutSort, sort),
        descending=descending,
        offset=(page - 1) * PAGE_SIZE,
        limit=PAGE_SIZE,
    )
    shown = {
        "status": states,
        "mode": mode or "",
        "sort": sort,
        "dir": "desc" if descending else "asc",
        "page": page,
        **text,
    }
    return query, shown


def _link(shown: dict[str, Any], **changes: Any) -> str:
    merged = {**shown, **changes}
    pairs = [
        (key, item)
        for key, value in merged.items()
        for item in (value if isinstance(value, list) else [value])
        if item not in ("", None)
    ]
    return "?" + urlencode(pairs)


async def _table(store: Store, request: Request) -> dict[str, Any]:
    query, shown = _query(request)
    items, total = await store.query_rollouts(query)
    last = max(1, math.ceil(total / PAGE_SIZE))
    if shown["page"] > last:
        shown["page"] = last
        query = dataclasses.replace(query, offset=(last - 1) * PAGE_SIZE)
        items, total = await store.query_rollouts(query)
    stats = await store.rollout_stats([r.rollout_id for r in items])
    now = time.time()
    rows = []
    for rollout in items:
        stat = stats.get(rollout.rollout_id)
        started = stat.started_at if stat else None
        ended = stat.ended_at if stat else None
        if started is not None and ended is None and rollout.status.state == "running":
            ended = now
        rows.append(
            {
                "rollout": rollout,
                "stats": stat,
                "duration": None if started is None or ended is None else ended - started,
                "run": rollout.metadata.get("run"),
                "step": rollout.metadata.get("step"),
            }
        )
    pages = max(1, math.ceil(total / PAGE_SIZE))
    return {
        "rows": rows,
        "total": total,
        "page": shown["page"],
        "pages": pages,
        "shown": shown,
        "link": lambda **changes: _link(shown, **changes),
        "sort_link": lambda key: _link(
            shown,
            sort=key,
            dir="asc" if shown["sort"] == key and shown["dir"] == "desc" else "desc",
            page=1,
        ),
    }


PAGE_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    # Not a script policy: the pages' one script and style are inline (base.html), and each
    # harness string is escaped where it lands (tests/monitor); no page may be framed.
    "Content-Security-Policy": "frame-ancestors 'none'; base-uri 'none'; form-action 'self'; "
    "object-src 'none'",
}
"""On every answer of the dashboard's routes: it shows what harnesses and models wrote."""


class _PageRoute(APIRoute):
    """A dashboard route: its answers carry `PAGE_HEADERS`, its errors' answers too (the
    gateway's other routes, the proxy's among them, pay nothing for it)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def with_headers(request: Request) -> Response:
            try:
                response = await handler(request)
            except Exception as error:
                response = await _error_answer(request, error)
            response.headers.update(PAGE_HEADERS)
            return await _gzipped(request, response)

        return with_headers


GZIP_MIN_BYTES = 1024
"""Smaller answers go as they are: gzip would save next to nothing on them."""
_GZIP_ON_THREAD_BYTES = 64 * 1024
"""Larger answers are compressed off the event loop, which also serves the proxy's calls (a run
page of 600 metric keys is ~13 MB of SVG)."""
_GZIP_LEVEL = 1
"""The fastest: 600 metric keys' charts (12.9 MB) took 0.16 s to 2.3 MB, against 0.6-0.8 s to
1.9 MB at level 6, on the gateway's CPU."""


async def _gzipped(request: Request, response: Response) -> Response:
    """`response` gzipped when the client's `Accept-Encoding` takes gzip: the run page and its
    polled charts are SVG text of up to ~13 MB, which were sent whole on every change."""
    body = getattr(response, "body", None)
    if (
        not isinstance(body, bytes)
        or len(body) < GZIP_MIN_BYTES
        or "content-encoding" in response.headers
    ):
        return response
    response.headers.append("Vary", "Accept-Encoding")  # what a cache must key it by
    if not accepts_gzip(request.headers.get("accept-encoding", "")):
        return response
    if len(body) < _GZIP_ON_THREAD_BYTES:
        packed = gzip.compress(body, _GZIP_LEVEL, mtime=0)
    else:
        packed = await asyncio.to_thread(gzip.compress, body, _GZIP_LEVEL, mtime=0)
    response.body = packed
    response.headers["Content-Encoding"] = "gzip"
    response.headers["Content-Length"] = str(len(packed))
    return response


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an `Accept-Encoding` header takes gzip (RFC 9110 12.5.3): named with a q above
    0, or matched by `*` with one when gzip is not named; `gzip;q=0` refuses it."""
    wildcard = False
    for item in accept_encoding.split(","):
        name, *parameters = (part.strip() for part in item.split(";"))
        weight = 1.0
        for parameter in parameters:
            key, _, value = parameter.partition("=")
            if key.strip().lower() == "q":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 0.0  # an unreadable weight is no consent
        if name.lower() in ("gzip", "x-gzip"):
            return weight > 0
        if name == "*":
            wildcard = weight > 0
    return wildcard


async def _error_answer(request: Request, error: Exception) -> Response:
    """The gateway's answer to an error of a dashboard route (the login redirect, a 404, a 500),
    given here by the app's own exception handlers: raised on, it was answered outside the
    route, without `PAGE_HEADERS`. A defect is logged with its traceback, as Starlette logs
    the 500s it answers."""
    handlers = request.app.exception_handlers
    kind = next((k for k in type(error).__mro__ if k in handlers and k is not Exception), None)
    if kind is not None:
        try:
            return await _called(handlers[kind], request, error)
        except Exception as declined:  # a handler re-raises what it does not answer
            error = declined
    fallback = handlers.get(Exception) or handlers.get(500)
    if fallback is None:
        raise error
    log.error("the dashboard failed on %s %s", request.method, request.url.path, exc_info=error)
    return await _called(fallback, request, error)


async def _called(handler: Callable[..., Any], request: Request, error: Exception) -> Response:
    answer = handler(request, error)
    return cast(Response, await answer if inspect.isawaitable(answer) else answer)


router = APIRouter(prefix="/ui", include_in_schema=False, route_class=_PageRoute)


async def _monitor_text(request: Request) -> tuple[TokenText | None, str | None]:
    """The monitor tokenizer's text for token IDs (`monitor_tokenizer`), or None and why not."""
    settings: GatewaySettings = request.app.state.settings
    if not settings.monitor_tokenizer:
        return None, None
    try:
        return await asyncio.to_thread(tokens.load, settings.monitor_tokenizer), None
    except tokens.TokenizerError as error:
        return None, str(error)


@router.get("/login")
async def login_page(request: Request, next: str = "/ui") -> HTMLResponse:
    return _html("login.html", next=_safe_next(next), error=None)


def _safe_next(target: str) -> str:
    """Only paths of the dashboard, never another site."""
    return target if target.startswith("/ui") and not target.startswith("//") else "/ui"


@router.post("/login")
async def login(request: Request) -> Response:
    declared = request.headers.get("content-length", "")
    if not declared.isdigit() or int(declared) > MAX_LOGIN_BODY:
        raise HTTPException(
            413, f"send the login form with a Content-Length of at most {MAX_LOGIN_BODY} bytes"
        )
    form = parse_qs((await request.body()).decode(errors="replace"))
    key = (form.get("key") or [""])[0].strip()
    target = _safe_next((form.get("next") or ["/ui"])[0])
    settings: GatewaySettings = request.app.state.settings
    if not hmac.compare_digest(key.encode(), settings.api_key.encode()):
        page = templates.get_template("login.html").render(
            next=target, error="That is not the gateway's admin key."
        )
        return HTMLResponse(page, status_code=401)
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(
        COOKIE,
        session_cookie(settings.api_key),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/ui",
    )
    return response


@router.get("/logout")
async def logout_page() -> HTMLResponse:
    """A button that logs out, and nothing more: a GET that logged out let any link or image
    (on any page the viewer opened) sign the viewer out."""
    return _html("logout.html")


@router.post("/logout")
async def logout(request: Request) -> Response:
    """Forgets the login cookie; the form of every page's header posts here. Refused from
    another site's page: the browser's `Sec-Fetch-Site`, or where a browser sends none, the
    host in its `Origin` (not the scheme: a TLS proxy in front changes it)."""
    fetched_from = request.headers.get("sec-fetch-site")
    origin = request.headers.get("origin")
    if fetched_from is not None:
        foreign = fetched_from not in ("same-origin", "none")
    else:
        foreign = origin is not None and urlsplit(origin).netloc != request.headers.get("host")
    if foreign:
        raise HTTPException(403, "log out from the dashboard's own pages")
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/ui")
    return response


@router.get("")
async def rollouts_page(request: Request) -> HTMLResponse:
    require_viewer(request)
    store: Store = request.app.state.store
    table = await _table(store, request)
    counts = await store.count_rollouts()
    by_state = {s: sum(n for (state, _), n in counts.items() if state == s) for s in STATES}
    runs = await asyncio.to_thread(run_names, request.app.state.settings.runs_dir)
    return _html(
        "rollouts.html", states=STATES, by_state=by_state, runs=runs, poll_s=POLL_S, **table
    )


@router.get("/rows")
async def rollouts_rows(request: Request) -> Response:
    """The table's body alone, for live updates."""
    require_viewer(request)
    body = templates.get_template("rows.html").render(
        **await _table(request.app.state.store, request)
    )
    return _fragment(request, _tag_of([body]), lambda: body)


def _tag_of(parts: list[str]) -> str:
    """An entity tag for text made of `parts`: a hash of them."""
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(part.encode("utf-8", errors="surrogatepass"))
        digest.update(b"\x00")
    return f'"{digest.hexdigest()}"'


def _fragment(request: Request, tag: str, render: Callable[[], str]) -> Response:
    """A polled fragment: 304 with no body when the poll's `If-None-Match` names `tag` (the
    page's script sends the tag of what it shows), else the fragment with its tag. The whole
    fragment was sent on every poll: a run of 600 metric keys of 200 steps, ~12 MB every 10 s
    per open page, with nothing changed."""
    headers = {"ETag": tag, "Cache-Control": "private, no-cache"}
    asked = request.headers.get("if-none-match", "")
    if tag in (part.strip().removeprefix("W/") for part in asked.split(",")):
        return Response(status_code=304, headers=headers)
    return HTMLResponse(render(), headers=headers)


@router.get("/rollouts/{rollout_id}")
async def rollout_page(
    request: Request, rollout_id: str, attempt: Annotated[int | None, Query(ge=1)] = None
) -> HTMLResponse:
    require_viewer(request)
    store: Store = request.app.state.store
    try:
        detail = await store.get_rollout(rollout_id)
    except NotFound as error:
        raise HTTPException(404, str(error)) from None
    latest = detail.rollout.attempt_count
    chosen = min(attempt or latest, latest) if latest else None
    view = None
    version = await _version(store, rollout_id, detail.rollout.change_seq)
    text, notice = await _monitor_text(request)
    if chosen is not None:
        # As stored, restored in the thread below with each prompt an array: restored as
        # lists, a 200-call rollout of 128k tokens was 13 M Python ints (~2.5 s for its page).
        stored = await store.get_packed_events(rollout_id, attempt_id=chosen, limit=1_000_000)
        view = await asyncio.to_thread(
            _attempt_view,
            rollout_id,
            chosen,
            stored,
            text,
        )
    # Rendered in a thread: a long rollout's page is megabytes of token spans, seconds of
    # rendering that held up every request of the gateway on the event loop.
    return await asyncio.to_thread(
        _html,
        "rollout.html",
        detail=detail,
        rollout=detail.rollout,
        view=view,
        chosen=chosen,
        version=version,
        poll_s=POLL_S,
        live=detail.rollout.status.state in ("queuing", "running"),
        low_p=LOW_P,
        tokenizer=text is not None,
        notice=notice,
    )


def _attempt_view(
    rollout_id: str, attempt_id: int, stored: list[PackedEvent], text: TokenText | None
) -> AttemptView:
    return attempt_view(
        rollout_id,
        attempt_id,
        unpack_events(stored, token_arrays=True),
        decode=text.decode if text else None,
        token_texts=text.texts if text else None,
    )


@router.get("/rollouts/{rollout_id}/version")
async def rollout_version(request: Request, rollout_id: str) -> JSONResponse:
    """Changes whenever the rollout or its latest attempt's events change (the page polls it)."""
    require_viewer(request)
    store: Store = request.app.state.store
    try:
        detail = await store.get_rollout(rollout_id)
    except NotFound as error:
        raise HTTPException(404, str(error)) from None
    return JSONResponse(
        {"version": await _version(store, detail.rollout.rollout_id, detail.rollout.change_seq)}
    )


async def _version(store: Store, rollout_id: str, change_seq: int) -> str:
    stats = await store.rollout_stats([rollout_id])
    return f"{change_seq}:{stats[rollout_id].last_seq if rollout_id in stats else 0}"


@router.get("/rollouts/{rollout_id}/events/{seq}")
async def raw_event(request: Request, rollout_id: str, seq: int) -> JSONResponse:
    """One event as stored, all of it."""
    require_viewer(request)
    store: Store = request.app.state.store
    if not 1 <= seq <= MAX_SEQ:
        raise HTTPException(404, f"rollout {rollout_id} has no event with seq {seq}")
    try:
        found = await store.get_events(rollout_id, all_attempts=True, after=seq - 1, limit=1)
    except NotFound as error:
        raise HTTPException(404, str(error)) from None
    if not found or found[0].seq != seq:
        raise HTTPException(404, f"rollout {rollout_id} has no event with seq {seq}")
    return JSONResponse(found[0].model_dump(mode="json"))


@router.get("/openapi.json")
async def api_schema(request: Request) -> JSONResponse:
    """The gateway's OpenAPI schema for a logged-in browser (the API's own `/openapi.json` needs
    the key as a header). No interactive docs page: FastAPI's loads its scripts from a CDN."""
    require_viewer(request)
    return JSONResponse(request.app.openapi())


# -- runs ---------------------------------------------------------------------------------------


@router.get("/runs")
async def runs_page(request: Request) -> HTMLResponse:
    require_viewer(request)
    settings: GatewaySettings = request.app.state.settings
    # Runs are read in a thread, here and below: a run's metrics.jsonl grows to megabytes, and
    # reading it on the event loop held up every request of the gateway, the proxy's included.
    runs = await asyncio.to_thread(list_runs, settings.runs_dir)
    problem = await asyncio.to_thread(runs_dir_problem, settings.runs_dir)
    return _html("runs.html", runs=runs, runs_dir=settings.runs_dir, problem=problem)


def _run_context(request: Request, name: str) -> dict[str, Any]:
    settings: GatewaySettings = request.app.state.settings
    try:
        run = load_run(run_path(settings.runs_dir, name))
    except (ValueError, OSError) as error:  # no such run, or a name no folder can have
        raise HTTPException(404, str(error)) from None
    drawn, tag = _drawn(run)
    return {
        "run": run,
        "charts": drawn,
        "charts_tag": tag,
        "last": run.steps[-1] if run.steps else {},
    }


_DRAWN_RUNS = 8
"""Runs whose drawn charts are kept (those of the run pages open)."""
_drawn_charts: dict[Path, tuple[object, object, list[str], str]] = {}
_drawn_lock = threading.Lock()


def _drawn(run: Run) -> tuple[list[str], str]:
    """The run's charts as SVG and their entity tag, drawn again only when its metrics changed:
    `read_metrics` hands back the same lists while no line was appended, and each open run page
    polls every 10 s (600 metric keys of 200 steps took 4.7 s of the gateway's CPU to draw, on
    every poll)."""
    with _drawn_lock:
        known = _drawn_charts.pop(run.path, None)
    if known is not None and known[0] is run.steps and known[1] is run.columns:
        drawn, tag = known[2], known[3]
    else:
        drawn = [svg.render(chart) for chart in charts(run)]
        tag = _tag_of(drawn)
    with _drawn_lock:
        _drawn_charts[run.path] = (run.steps, run.columns, drawn, tag)
        while len(_drawn_charts) > _DRAWN_RUNS:
            del _drawn_charts[next(iter(_drawn_charts))]  # the least recently drawn
    return drawn, tag


@router.get("/runs/{name}")
async def run_page(request: Request, name: str) -> HTMLResponse:
    require_viewer(request)
    return _html("run.html", poll_s=10, **await asyncio.to_thread(_run_context, request, name))


@router.get("/runs/{name}/fidelity")
async def run_fidelity(request: Request, name: str) -> HTMLResponse:
    """`reins doctor`'s report of the run's recorded rollouts (monitor/fidelity.py)."""
    require_viewer(request)
    text, notice = await _monitor_text(request)
    stored, finished, cut = await fidelity.stored_runs(request.app.state.store, name)
    view = await asyncio.to_thread(fidelity.fidelity_view, name, stored, finished, cut, text)
    return _html(
        "fidelity.html",
        view=view,
        max_calls=fidelity.MAX_CALLS,
        tokenizer=text is not None,
        notice=notice,
        boundary=format_boundary,
    )


@router.get("/runs/{name}/charts")
async def run_charts(request: Request, name: str) -> Response:
    """The run page's charts alone, for live updates: 304 while they are those the page shows
    (its `If-None-Match`), as they are until a line is appended to the run's metrics."""
    require_viewer(request)
    context = await asyncio.to_thread(_run_context, request, name)
    template = templates.get_template("charts.html")
    return _fragment(request, context["charts_tag"], lambda: template.render(**context))


@router.get("/{path:path}")
async def no_such_page(request: Request, path: str) -> Response:
    """Any other GET under /ui, answered as the router answers it (a path with a trailing slash
    is sent to the one without, any other is a 404), but with `PAGE_HEADERS`. Declared last."""
    if not path or path.endswith("/"):
        target = request.url.replace(path=request.url.path.rstrip("/") or "/ui")
        return RedirectResponse(str(target), status_code=307)
    raise HTTPException(404)


# -- Prometheus ---------------------------------------------------------------------------------

metrics_router = APIRouter(include_in_schema=False)


@metrics_router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text; needs the admin key (Prometheus: `authorization: {credentials: KEY}`)."""
    request.app.state.auth.admin(request)
    body = await request.app.state.metrics.scrape(request.app.state.store)
    return Response(body, media_type=CONTENT_TYPE)

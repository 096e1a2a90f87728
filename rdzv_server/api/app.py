"""The aiohttp application: the route table, thin handlers, metrics, the dashboard.

Handlers decode, call the service, encode; nothing else. Every ``/v1`` request is
authenticated first (:func:`auth_middleware`): a bearer token, or for GETs only the
dashboard's cookie, whose grant travels with the request. ``/``, ``/jobs/{rdzv_id}``,
``/static/*``, ``/healthz``, ``/livez``, ``/readyz`` and ``/metrics`` are open: the pages
hold no data (their script fetches ``/v1`` with the cookie) and the metrics name no job,
node or address. Every operation of ``wire.REQUESTS`` is ``POST /v1/jobs/{rdzv_id}/{op}``,
served by :func:`.operation.run_operation` exactly as the stream protocol serves it. A
body that does not decode is answered by the error middleware (and, as an undecodable
stream frame, is not counted under an operation). Limits are explicit settings of
:class:`ServerConfig`.

Browsers (README "Security"; :func:`site_middleware` runs before authentication):
- Host (DNS rebinding): with ``--allowed-hosts NAME,...`` a request whose ``Host`` names
  another host (compared without its port, lowercase, an IPv6 literal without brackets),
  or has no usable ``Host``, is refused ``421 host_not_allowed`` (Misdirected Request: this
  server does not answer for that name), nothing else read. A rebinding page is served
  from the attacker's name, so its requests carry that name. :data:`HOST_EXEMPT_PATHS`
  (``/livez``, ``/healthz``, ``/readyz``, ``/metrics``) answer whatever the ``Host``: the
  kubelet and Prometheus reach a pod by its IP, and none of them holds a job, node or address.
  The stream protocol has no Host and needs no check: no browser can open one.
- Origin (cross-site writes): a request with a method other than GET, HEAD or OPTIONS
  that carries an ``Origin`` other than the server's own is refused ``403 forbidden``.
  The own origin is the one whose host and port (the scheme's default port when none is
  written) are the request's ``Host`` and port: whatever is served at our host and port
  is this server, so the scheme need not match. ``Origin: null`` (sandboxed frames,
  ``file:``) is foreign. Requests without ``Origin`` (our clients, curl) are not browsers'
  cross-site requests and pass. Together with the 415 of non-JSON bodies (codec.py), the
  GET-only cookie and the token, no other site's page can change anything here.
- Headers (one definition: ``header.py``): every response the app prepares (answers, errors,
  redirects, the pages) carries ``X-Content-Type-Options: nosniff``, ``X-Frame-Options:
  DENY``, ``Referrer-Policy: no-referrer`` (a ``?token=`` address never leaves in a Referer)
  and ``Cross-Origin-Resource-Policy: same-origin``; the pages carry ``header.PAGE_POLICY``
  (``default-src 'self'``, no inline script or style: the page's script and style are
  ``/static`` files), everything else ``header.DATA_POLICY`` (``default-src 'none'``); both
  say ``frame-ancestors 'none'``. The answers written below the app (parser refusals, shed
  and refused connections: ``connection.py``, ``aiohttp_seam.py``) carry the same headers.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from importlib import resources
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import generate_latest

from rdzv_client import wire

from ..core import command as c
from ..core.error import Forbidden
from ..core.event import Cause
from ..role import single_view
from ..service import Service
from . import page
from .auth import OPEN, Grant, TokenTable, bearer_token
from .codec import decode, encode
from .document import cordon_entry, event_entry, events_document, job_document, job_summary, policy_entry
from .error import error_middleware
from .header import security_headers
from .metric import Metrics
from .operation import run_operation

SERVICE = web.AppKey("service", Service)
METRICS = web.AppKey("metrics", Metrics)
TOKENS = web.AppKey("tokens", TokenTable)
GRANT = "rdzv_grant"  # the request's Grant, set by auth_middleware
#: The dashboard's credential: set by ``/?token=...``, sent by the browser with its own GETs
#: only (HttpOnly: no script reads it; SameSite=Strict: no other site's page sends it), and
#: honoured for GETs only, so it can never change anything.
COOKIE = "rdzv_token"
UNAUTHORIZED_MESSAGE = (
    "this server requires a token: put it in ~/.config/rdzv-server/token (the server's own file, on "
    "its host), or set RDZV_TOKEN / RDZV_TOKEN_FILE, or pass --rdzv-conf token_file=PATH (rdzvctl: --token-file)"
)


#: Methods that change nothing (RFC 9110's safe methods): never refused for their Origin.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: Answered whatever the Host (see the module docstring): probes and Prometheus use the pod IP.
HOST_EXEMPT_PATHS = frozenset({"/livez", "/healthz", "/readyz", "/metrics"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
# host[:port] as a browser writes it in Host and Origin: a name or IPv4 address, or an
# IPv6 literal in brackets; nothing that could hide a second host (no @, /, spaces).
_AUTHORITY = re.compile(r"^(?:\[([0-9a-f:.]+)\]|([^\[\]:/@\s]+))(?::([0-9]{1,5}))?$", re.IGNORECASE)
#: The dashboard's files (``static/``), by name: their content types. Nothing else is served.
STATIC_FILES = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}


def _grant(request: web.Request) -> Grant:
    grant: Grant = request.get(GRANT, OPEN)
    return grant


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Authenticate ``/v1`` requests: 401 ``unauthorized`` (counted, nothing changes) without
    a valid token; otherwise the request carries its grant to the handler."""
    if not request.path.startswith("/v1/") and request.path != "/v1":
        return await handler(request)
    presented = bearer_token(request.headers.get("Authorization"))
    if presented is None and request.method in ("GET", "HEAD"):
        presented = request.cookies.get(COOKIE)
    grant = request.app[TOKENS].grant(presented)
    if grant is None:
        request.app[METRICS].auth_failed("missing" if presented is None else "wrong")
        answer = encode(request, wire.error_body(wire.ErrorCode.UNAUTHORIZED, UNAUTHORIZED_MESSAGE), status=401)
        answer.headers["WWW-Authenticate"] = 'Bearer realm="rdzv-server"'
        return answer
    request[GRANT] = grant
    return await handler(request)


def authority(value: str, scheme: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``Host`` value or an origin's ``host[:port]``: the host lowercase
    (an IPv6 literal without brackets), the port the scheme's default when none is written.
    None when malformed, or when no port is written and the scheme has no default."""
    match = _AUTHORITY.match(value)
    if match is None:
        return None
    literal, name, port = match.groups()
    number = int(port) if port is not None else _DEFAULT_PORTS.get(scheme.lower())
    if number is None or not 0 < number <= 65535:
        return None
    return (literal or name).lower(), number


def _foreign_origin(request: web.Request) -> str | None:
    """The request's ``Origin`` when it is another site's (see the module docstring), else None."""
    origin = request.headers.get("Origin")
    if origin is None:
        return None
    scheme, sep, rest = origin.strip().partition("://")
    theirs = authority(rest, scheme) if sep and scheme.lower() in _DEFAULT_PORTS else None
    ours = authority(request.headers.get("Host", ""), request.scheme)
    return None if theirs is not None and theirs == ours else origin


@web.middleware
async def site_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse what only a hostile web page would send: a ``Host`` not in ``--allowed-hosts``
    (421 ``host_not_allowed``) and a write from a foreign ``Origin`` (403 ``forbidden``)."""
    allowed = request.app[SERVICE].config.allowed_hosts
    if allowed and request.path not in HOST_EXEMPT_PATHS:
        host = request.headers.get("Host", "")
        ours = authority(host, request.scheme)
        if ours is None or ours[0] not in allowed:
            message = (
                f"this server answers for {', '.join(allowed)} only (--allowed-hosts), not for Host {host[:100]!r}: "
                "use one of those names in the address"
            )
            return encode(request, wire.error_body(wire.ErrorCode.HOST_NOT_ALLOWED, message), status=421)
    if request.method not in SAFE_METHODS:
        origin = _foreign_origin(request)
        if origin is not None:
            message = (
                f"cross-site request refused: a page from origin {origin[:100]!r} may not change anything on this "
                "server; send requests from a program (no Origin header) or from this server's own pages"
            )
            return encode(request, wire.error_body(wire.ErrorCode.FORBIDDEN, message), status=403)
    return await handler(request)


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Add the browser hardening headers (``header.py``) to every response the app prepares."""
    for name, value in security_headers(response.content_type == "text/html").items():
        response.headers.setdefault(name, value)


async def operation(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    fields = await decode(request, svc.config.max_body_bytes)
    op, rdzv_id = request.match_info["op"], request.match_info["rdzv_id"]
    status, body = await run_operation(svc, request.app[METRICS], _grant(request), op, rdzv_id, fields)
    return encode(request, body, status=status)


async def list_jobs(request: web.Request) -> web.Response:
    svc, grant = request.app[SERVICE], _grant(request)
    jobs = await svc.job_summaries(lambda rdzv_id: grant.allows(False, rdzv_id))
    return encode(request, {"jobs": [job_summary(s) for s in jobs]})


T = TypeVar("T", int, float)
# Events per answer of GET /v1/jobs/{rdzv_id}/events: a job keeps about this many.
EVENTS_PAGE = 1000
# A ?wait= beyond any sane long-poll is a mistake, not a wish; within it, --max-hold caps it.
MAX_QUERY_WAIT = 3600.0
# Past any job's node count (at most 1,000,000, plus the lanes the timeline adds): a page there is empty.
MAX_QUERY_OFFSET = 2**31 - 1


def _readable_job(request: web.Request) -> str:
    """The route's job id, if valid and covered by the request's grant (else a 400 / 403 error)."""
    rdzv_id = wire.check_id("rdzv_id", request.match_info["rdzv_id"])
    if not _grant(request).allows(False, rdzv_id):
        request.app[METRICS].auth_failed("forbidden")
        raise Forbidden(f"this token does not cover job {rdzv_id}")
    return rdzv_id


async def show_job(request: web.Request) -> web.Response:
    """The membership document; ``?offset=O&limit=L`` (either) cuts its node lists to one page
    (``page.document_page``: ``limit`` 0..1000, default 100; ``limit=0``: no nodes, the counts)."""
    svc = request.app[SERVICE]
    rdzv_id = _readable_job(request)
    document = job_document(await svc.job_view(rdzv_id))
    if "offset" not in request.query and "limit" not in request.query:
        return encode(request, document)
    offset, limit = _page_params(request, 0)
    return encode(request, page.document_page(document, offset, limit))


async def job_lanes(request: web.Request) -> web.Response:
    """The job over time for its page (``page.lanes``): ``?offset=O&limit=L`` pick the lanes
    (``limit`` 1..1000, default 100); the rounds and their summary cover every node."""
    svc = request.app[SERVICE]
    rdzv_id = _readable_job(request)
    offset, limit = _page_params(request, 1)
    # The document first: whatever happens before the timeline is read is in the timeline, whose
    # deaths and refusals win over the document's older word (page.py).
    document = job_document(await svc.job_view(rdzv_id))
    kept = await svc.job_timeline(rdzv_id)
    events = [event_entry(e) for e in kept.events]
    return encode(request, page.lanes(document, events, kept.first_seq, kept.now, offset, limit))


def _page_params(request: web.Request, least_limit: int) -> tuple[int, int]:
    offset = _query_number(request, "offset", 0, int, 0, MAX_QUERY_OFFSET)
    return offset, _query_number(request, "limit", page.DEFAULT_PAGE, int, least_limit, page.MAX_PAGE)


async def job_events(request: web.Request) -> web.Response:
    """``?since=SEQ`` (default 0: every event kept), ``wait=S`` (hold up to S s, capped by
    --max-hold, while there is nothing newer; default 0), ``limit=N`` (default 1000)."""
    svc = request.app[SERVICE]
    rdzv_id = _readable_job(request)
    since = _query_number(request, "since", 0, int, 0, 2**63 - 1)
    wait = min(_query_number(request, "wait", 0.0, float, 0.0, MAX_QUERY_WAIT), svc.config.max_hold)
    limit = _query_number(request, "limit", EVENTS_PAGE, int, 1, EVENTS_PAGE)
    return encode(request, events_document(rdzv_id, await svc.events(rdzv_id, since, wait, limit)))


async def list_cordons(request: web.Request) -> web.Response:
    """``GET /v1/cordons``: the cordons in effect (any token may read them)."""
    svc = request.app[SERVICE]
    cordons, now = await svc.cordons()
    return encode(request, {"cordons": [cordon_entry(one, now) for one in cordons], "now": now})


def _fleet_writer(request: web.Request, what: str, tables: str = "cordons") -> None:
    """A cordon (or a policy: ``tables``) concerns every job: only a write token for every job
    may change one (403)."""
    grant = _grant(request)
    if not grant.allows(True) or grant.job_prefix:
        request.app[METRICS].auth_failed("forbidden")
        raise Forbidden(f"this token may not {what}: {tables} need a write token for every job")


async def cordon_host(request: web.Request) -> web.Response:
    """``POST /v1/cordons`` ``{"host", "reason"?, "duration"?}``: cordon a host (an operator's)."""
    _fleet_writer(request, "cordon a host")
    svc = request.app[SERVICE]
    body = await decode(request, svc.config.max_body_bytes)
    req = wire.from_mapping(wire.CordonRequest, body, rdzv_id="")
    if req.by != Cause.OPERATOR.value:
        raise wire.WireError("by: only the server quarantines hosts for flapping; an operator's cordon is by operator")
    await svc.write(req, req.rid)
    cordon, now = await svc.cordon_of(req.host)
    return encode(request, {"cordon": None if cordon is None else cordon_entry(cordon, now)})


async def uncordon_host(request: web.Request) -> web.Response:
    """``DELETE /v1/cordons/{host}``: lift a host's cordon; ``{"uncordoned": false}`` if it had none."""
    _fleet_writer(request, "uncordon a host")
    req = wire.from_mapping(wire.UncordonRequest, {"host": request.match_info["host"]}, rdzv_id="")
    return encode(request, await request.app[SERVICE].write(c.Uncordon("", host=req.host)))


async def list_policies(request: web.Request) -> web.Response:
    """``GET /v1/policies``: every policy, most specific first (any token may read them)."""
    found, now = await request.app[SERVICE].policies()
    return encode(request, {"policies": [policy_entry(p, now) for p in found], "now": now})


async def show_policy(request: web.Request) -> web.Response:
    """``GET /v1/policies/{pattern}``: one policy (404 ``no_such_policy``)."""
    pattern = wire.pattern_ok(request.match_info["pattern"])
    policy, now = await request.app[SERVICE].policy(pattern)
    return encode(request, {**policy_entry(policy, now), "now": now})


async def set_policy(request: web.Request) -> web.Response:
    """``PUT /v1/policies/{pattern}`` ``{"settings": {KEY: VALUE}}``: merge them into the policy
    (made if new); answers the policy. A bad key or value: 400 ``bad_policy`` naming it."""
    _fleet_writer(request, "set a policy", "policies")
    svc = request.app[SERVICE]
    pattern = wire.pattern_ok(request.match_info["pattern"])
    body = await decode(request, svc.config.max_body_bytes)
    if not isinstance(body, dict) or set(body) != {"settings"}:
        raise wire.bad_policy('a policy is set by {"settings": {KEY: VALUE, ...}} and nothing else')
    settings = wire.policy_settings(body["settings"])
    return encode(request, {**await svc.write(c.SetPolicy("", pattern=pattern, settings=settings)), "age_s": 0.0})


async def unset_policy(request: web.Request) -> web.Response:
    """``DELETE /v1/policies/{pattern}`` (optional ``{"keys": [KEY...]}``): remove those keys, or
    the whole policy; answers ``{"pattern", "removed"}`` (404 ``no_such_policy``)."""
    _fleet_writer(request, "unset a policy", "policies")
    svc = request.app[SERVICE]
    pattern = wire.pattern_ok(request.match_info["pattern"])
    body = await decode(request, svc.config.max_body_bytes) if request.body_exists else {}
    keys = body.get("keys", []) if isinstance(body, dict) and set(body) <= {"keys"} else None
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise wire.bad_policy('a policy\'s keys are unset by {"keys": [KEY, ...]} (or no body: the whole policy)')
    req = c.UnsetPolicy("", pattern=pattern, keys=tuple(keys))
    req.validate()  # an unknown key: 400 bad_policy naming it
    return encode(request, await svc.write(req))


async def effective_policy(request: web.Request) -> web.Response:
    """``GET /v1/policy?job=ID``: the keys the policies set for job ID (which need not exist
    yet), each with its source, and the policy version (it moves at every change)."""
    svc = request.app[SERVICE]
    rdzv_id = wire.check_id("job", request.query.get("job"))
    return encode(request, await svc.effective_policy(rdzv_id))


def _query_number(request: web.Request, name: str, default: T, kind: Callable[[str], T], low: T, high: T) -> T:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise wire.WireError(f"query parameter {name}={raw[:32]!r} is not a number") from None
    if not low <= value <= high:
        raise wire.WireError(f"query parameter {name} must be {low}..{high}, got {raw[:32]}")
    return value


async def healthz(request: web.Request) -> web.Response:
    """``/healthz`` and ``/livez``: the process is up (answers while the log recovers)."""
    return encode(request, {"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready: the leader, the one server, or a follower whose state is hot (it redirects);
    ``?role=leader`` asks for the leader only (a load balancer that sends traffic there)."""
    svc = request.app[SERVICE]
    # A candidate between terms (etcd unreachable, a lost lease) has no state it keeps current.
    following = svc.recovered and not svc.stopping and svc.role == "follower"
    if svc.role == "leader" and not svc.lease_valid():
        # Paused past its lease, say, or etcd electing its own leader: another replica may lead
        # by now, unless etcd confirms the lease at the next keepalive.
        message = "this replica's election lease may have expired: it serves nothing until etcd confirms it"
        return encode(request, wire.error_body(wire.ErrorCode.NOT_READY, message), status=503)
    if not (svc.ready or following):
        why = "this replica neither leads nor follows (etcd?)" if svc.replicated else "recovering the log"
        return encode(request, wire.error_body(wire.ErrorCode.NOT_READY, why), status=503)
    body: dict[str, Any] = {"status": "ready", "role": svc.role, "recovery_seconds": round(svc.recovery_seconds, 3)}
    if svc.replicated:
        body["leader"] = svc.leader_url()
        body["applied_index"] = svc.applied_index()
        if request.query.get("role") == "leader" and svc.role != "leader":
            return encode(request, wire.error_body(wire.ErrorCode.NOT_LEADER, "this replica follows", leader=body["leader"]), status=503)
    return encode(request, body)


async def cluster(request: web.Request) -> web.Response:
    """``GET /v1/cluster``: the replicas, which one leads and since when, and etcd's members."""
    svc = request.app[SERVICE]
    view = await svc.cluster_view()  # etcd silent: NotReady, a 503
    if view is None:  # the one server
        server_id = f"{socket.gethostname()}:{svc.bound_port or svc.config.port}"
        view = single_view(server_id, f"{request.scheme}://{request.host}", svc.started_at, svc.log_index())
    return encode(request, view)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def dashboard(request: web.Request) -> web.Response:
    """The page, at ``/`` and at ``/jobs/{rdzv_id}`` (one job's nodes shown). ``?token=TOKEN``
    (a link an operator opens once) trades the token for the dashboard's cookie and redirects
    to the same page without it, so the token leaves the address bar and history."""
    rdzv_id = request.match_info.get("rdzv_id")
    page = "/" if rdzv_id is None else "/jobs/" + wire.check_id("rdzv_id", rdzv_id)
    token = request.query.get("token")
    if token is not None:
        tokens = request.app[TOKENS]
        if tokens.grant(token) is None:
            request.app[METRICS].auth_failed("wrong")
            return encode(request, wire.error_body(wire.ErrorCode.UNAUTHORIZED, "wrong token in ?token="), status=401)
        answer = web.HTTPSeeOther(page)
        if tokens.enabled:
            answer.set_cookie(COOKIE, token, httponly=True, samesite="Strict", secure=request.secure, path="/")
        raise answer
    body = resources.files("rdzv_server.api").joinpath("static/dashboard.html").read_bytes()
    return web.Response(body=body, content_type="text/html", headers={"Cache-Control": "no-cache"})


async def static_file(request: web.Request) -> web.Response:
    """One of :data:`STATIC_FILES` (the page's script and style); any other name is a 404."""
    name = request.match_info["name"]
    content_type = STATIC_FILES.get(name)
    if content_type is None:
        raise web.HTTPNotFound(text=f"no static file {name[:100]!r}")
    body = resources.files("rdzv_server.api").joinpath("static").joinpath(name).read_bytes()
    return web.Response(body=body, content_type=content_type, charset="utf-8", headers={"Cache-Control": "no-cache"})


def create_app(svc: Service, tokens: TokenTable) -> web.Application:
    """The application over a started (or starting) service; ``tokens`` says who may do what."""
    app = web.Application(
        client_max_size=svc.config.max_body_bytes,
        middlewares=[error_middleware, site_middleware, auth_middleware],
    )
    app.on_response_prepare.append(_security_headers)
    app[SERVICE] = svc
    app[METRICS] = Metrics(svc)
    app[TOKENS] = tokens
    # The API's table of contents.
    app.add_routes(
        [
            web.get("/", dashboard),
            web.get("/jobs/{rdzv_id}", dashboard),
            web.get("/static/{name}", static_file),
            web.get("/livez", healthz),
            web.get("/healthz", healthz),
            web.get("/readyz", readyz),
            web.get("/metrics", metrics),
            web.get("/v1/cluster", cluster),
            web.get("/v1/cordons", list_cordons),
            web.post("/v1/cordons", cordon_host),
            web.delete("/v1/cordons/{host}", uncordon_host),
            web.get("/v1/policies", list_policies),
            web.get("/v1/policies/{pattern}", show_policy),
            web.put("/v1/policies/{pattern}", set_policy),
            web.delete("/v1/policies/{pattern}", unset_policy),
            web.get("/v1/policy", effective_policy),
            web.get("/v1/jobs", list_jobs),
            web.get("/v1/jobs/{rdzv_id}", show_job),
            web.get("/v1/jobs/{rdzv_id}/events", job_events),
            web.get("/v1/jobs/{rdzv_id}/lanes", job_lanes),
            web.post("/v1/jobs/{rdzv_id}/{op:" + "|".join(sorted(wire.REQUESTS)) + "}", operation),
        ]
    )
    return app

"""The browser hardening headers every HTTP answer of the server carries, whoever writes it.

What it owns: the one definition of those headers. The app adds them to every response it
prepares (``app.py``); the answers written below the app (aiohttp's parser refusals, shed
and refused connections: ``connection.py``, ``aiohttp_seam.py``) carry the same set, so no
answer, not even a refusal of a malformed request, can be framed, sniffed or leak an address
in a Referer.

What it must not know: which answer it is, beyond whether it is one of the pages.
"""

from __future__ import annotations

#: Every answer: no MIME sniffing, no framing, no Referer (a ``?token=`` address never leaves
#: in one), no use by another site's page.
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Resource-Policy": "same-origin",
}
#: The pages' policy: their own script, style and API only; no inline code, no framing.
PAGE_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
#: Every other answer (JSON, msgpack, metrics, scripts, refusals) is data: it may load nothing.
DATA_POLICY = "default-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"


def security_headers(page: bool) -> dict[str, str]:
    """The headers of an answer: :data:`SECURITY_HEADERS` and the page's or data's policy."""
    return {**SECURITY_HEADERS, "Content-Security-Policy": PAGE_POLICY if page else DATA_POLICY}

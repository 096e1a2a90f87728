"""TLS for the clients, and the TLS helpers the server shares with them: the one
``ssl.SSLContext`` both client transports use, and what a TLS failure means.

It lives in the client package because the client must not import the server; the server
(``rdzv_server/server.py``, ``rdzv_server/storage/etcd_client.py``) imports
:func:`no_key_password` and :func:`ssl_reason` from here rather than keep a second copy.

What it owns:
- :func:`client_context`: the client's context from its options (``ca_file``: the CA bundle
  to trust instead of the system store; ``cert_file``/``key_file``: a client certificate for
  servers that require one, ``--tls-client-ca``). TLS 1.2 at least, the server's certificate
  verified and its hostname checked, always;
- :func:`is_tls_misconfiguration` and :func:`tls_failure`: which TLS errors retrying cannot
  fix (an untrusted certificate, a refused client certificate, a port that does not speak
  TLS), and the sentence that says so;
- shared with the server: :func:`no_key_password` (an encrypted key fails to load instead
  of prompting on the terminal) and :func:`ssl_reason` (OpenSSL's message in one line).

What it must not know: HTTP, the stream protocol, retries, torch.
"""

from __future__ import annotations

import os
import re
import ssl

# TLS 1.0 and 1.1 are deprecated (RFC 8996); the server accepts 1.2 and 1.3 only.
TLS_MINIMUM_VERSION = ssl.TLSVersion.TLSv1_2


class TLSConfigError(ValueError):
    """A CA bundle, certificate or key file given to the client cannot be used."""


def client_context(
    *,
    ca_file: str | os.PathLike[str] | None = None,
    cert_file: str | os.PathLike[str] | None = None,
    key_file: str | os.PathLike[str] | None = None,
) -> ssl.SSLContext:
    """The client's TLS context. ``key_file`` defaults to ``cert_file`` (one PEM with both).

    Raises :class:`TLSConfigError` naming the file that cannot be read or used.
    """
    if key_file is not None and cert_file is None:
        raise TLSConfigError("a client key file needs its certificate: give cert_file too")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the certificate and checks the hostname
    context.minimum_version = TLS_MINIMUM_VERSION
    if ca_file is not None:
        try:
            context.load_verify_locations(cafile=os.fspath(ca_file))
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise TLSConfigError(f"cannot use the CA bundle {os.fspath(ca_file)}: {ssl_reason(exc)}") from exc
    else:
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if cert_file is not None:
        try:
            key = os.fspath(key_file) if key_file is not None else None
            context.load_cert_chain(os.fspath(cert_file), key, password=no_key_password)
        except (OSError, ValueError) as exc:
            where = os.fspath(cert_file) + (f" and key {os.fspath(key_file)}" if key_file is not None else "")
            raise TLSConfigError(f"cannot use the client certificate {where}: {ssl_reason(exc)}") from exc
    return context


def no_key_password() -> str:
    """The ``password`` callback of ``load_cert_chain``: refuse an encrypted key.

    Without a callback OpenSSL would prompt on the terminal for the key's password (and a
    server under systemd would hang there); raising makes the load fail with a reason.
    """
    raise ValueError("the private key is encrypted; give an unencrypted key file")


def ssl_reason(exc: BaseException) -> str:
    """A one-line reason, without the ``(_ssl.c:LINE)`` OpenSSL's messages end with."""
    text = (exc.strerror if isinstance(exc, OSError) else None) or str(exc) or type(exc).__name__
    text = re.sub(r"\s*\(_ssl\.c:\d+\)$", "", text)
    if text == "[SSL] PEM lib":  # OpenSSL's words for "no PEM block I could use"
        return "it holds no PEM data of the right kind ([SSL] PEM lib)"
    return text


def is_tls_misconfiguration(exc: BaseException) -> bool:
    """Whether ``exc`` is a TLS failure that retrying cannot fix.

    That is a certificate the client does not trust, or a handshake either side rejected
    (an alert: no or unknown client certificate, no common protocol version, a server that
    answered in plain text). Not: an EOF or reset mid-handshake (a server restarting, or
    shedding connections at its limit), which the client retries like any lost connection.
    """
    if isinstance(exc, ssl.SSLCertVerificationError):
        return True
    return type(exc) is ssl.SSLError  # the subclasses are EOFs and want-read/write states


def tls_failure(endpoint: object, exc: BaseException) -> str:
    """What went wrong with TLS to ``endpoint``, and what to check."""
    reason = ssl_reason(exc)
    if isinstance(exc, ssl.SSLCertVerificationError):
        hint = (
            "the server's certificate is not trusted by this client: give the CA that signed it "
            "(ca_file, rdzvctl --ca-file, torchrun --rdzv-conf ca_file=PATH) and connect by a name "
            "or address the certificate lists"
        )
    elif "WRONG_VERSION_NUMBER" in reason or "wrong version number" in reason:
        hint = "the server at this port does not speak TLS: drop https:// and tls, or start the server with --tls-cert"
    elif "CERTIFICATE_REQUIRED" in reason or "ALERT_BAD_CERTIFICATE" in reason or "UNKNOWN_CA" in reason:
        hint = (
            "the server requires a client certificate signed by its --tls-client-ca: give one "
            "(cert_file/key_file, rdzvctl --cert-file/--key-file, torchrun --rdzv-conf cert_file=...,key_file=...)"
        )
    else:
        hint = "check the server's --tls-* flags and this client's TLS options"
    return f"{endpoint}: TLS handshake failed ({reason}); {hint}"

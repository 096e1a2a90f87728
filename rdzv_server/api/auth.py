"""Who may do what: the server's bearer tokens and what each one grants.

What it owns: the token table (:class:`TokenTable`), loading it from the token files, and
creating the default token file on a first start (random, 256 bits, mode 0600), so that a
server and its clients on one host work with no configuration.

Rules:
- A request presents at most one token (``Authorization: Bearer TOKEN`` over HTTP, the
  ``token`` of the stream protocol's hello). It is compared with every token of the table
  in constant time (``hmac.compare_digest``, all entries, no early exit), so timing tells
  nothing about which prefix matched.
- A token grants a :class:`Grant`: an access level (``write`` may do everything, ``read``
  only what changes nothing) and a job-id prefix (``""``: every job). Today the command
  line makes one write token and, optionally, one read token, both for every job; the
  prefix is there so that a token can later be limited to one team's jobs without
  changing any caller.
- With auth off (``--no-auth``) every request is granted write access to every job.
- A token never reaches a log line, an error message or a reply.

What it must not know: HTTP, frames (the app and the stream protocol ask it).
"""

from __future__ import annotations

import enum
import hmac
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("rdzv_server.auth")

# 32 random bytes (256 bits), URL-safe: fits a header and a file without quoting.
TOKEN_BYTES = 32


class Access(str, enum.Enum):
    READ = "read"
    WRITE = "write"


@dataclass(frozen=True)
class Grant:
    """What one token may do: ``access`` on the jobs whose id starts with ``job_prefix``."""

    access: Access
    job_prefix: str = ""

    def allows(self, writes: bool, rdzv_id: str | None = None) -> bool:
        """Whether this grant covers a request that ``writes`` (or not) to job ``rdzv_id``
        (None: a request about no one job, such as the job list)."""
        if writes and self.access is not Access.WRITE:
            return False
        return rdzv_id is None or rdzv_id.startswith(self.job_prefix)


#: Everything, to everyone: the grant of every request when auth is off.
OPEN = Grant(Access.WRITE)


class TokenError(ValueError):
    """A token file cannot be read or created; the message names the file and what to do."""


class TokenTable:
    """The server's tokens. ``TokenTable(None)`` is auth off: every request gets :data:`OPEN`."""

    def __init__(self, grants: dict[str, Grant] | None) -> None:
        self._entries = None if grants is None else [(t.encode(), g) for t, g in grants.items()]

    @property
    def enabled(self) -> bool:
        return self._entries is not None

    def grant(self, presented: str | None) -> Grant | None:
        """The grant of ``presented`` (None: no or a wrong token; auth off: :data:`OPEN`)."""
        if self._entries is None:
            return OPEN
        if not presented:
            return None
        candidate = presented.encode("utf-8", "surrogateescape")
        found: Grant | None = None
        for token, grant in self._entries:  # all of them, always: constant time in the match
            if hmac.compare_digest(candidate, token) and found is None:
                found = grant
        return found


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header (None if absent or another scheme)."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


def read_token(path: Path) -> str:
    """The token stored in ``path``. Raises :class:`TokenError`."""
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenError(f"cannot read the token file {path}: {exc}") from exc
    if len(token) < 16 or any(ch.isspace() for ch in token):
        raise TokenError(
            f"the token file {path} must hold one token of at least 16 characters with no spaces "
            "(delete it to have the server make a new one)"
        )
    info = path.stat()
    # Group bits are how Kubernetes lets a non-root server read a Secret (fsGroup, 0440): only
    # a group this process is not in, or any other user, is someone else.
    foreign_group = info.st_mode & stat.S_IRWXG and info.st_gid not in {os.getegid(), *os.getgroups()}
    if info.st_mode & stat.S_IRWXO or foreign_group:
        log.warning("The token file %s is readable by other users (mode %o): chmod 600 it.", path, info.st_mode & 0o777)
    return token


def ensure_token_file(path: Path) -> tuple[str, bool]:
    """The token in ``path``, creating the file (mode 0600, its folder 0700) if it does not
    exist. Returns ``(token, created)``. Raises :class:`TokenError`."""
    if path.exists():
        return read_token(path), False
    token = secrets.token_urlsafe(TOKEN_BYTES)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another server made it meanwhile: use theirs
        return read_token(path), False
    except OSError as exc:
        raise TokenError(f"cannot create the token file {path}: {exc} (give --token-file a writable path)") from exc
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(token + "\n")
        out.flush()
        os.fsync(out.fileno())
    return token, True


def load_tokens(token_file: Path, read_token_file: Path | None) -> TokenTable:
    """The table of a server with auth on: the write token (its file created if missing) and,
    if given, the read-only token (that file must exist). Raises :class:`TokenError`."""
    token, created = ensure_token_file(token_file)
    if created:
        log.info("Created a new token in %s (mode 0600); clients on this host read it from there.", token_file)
    else:
        log.info("Clients must present the token in %s.", token_file)
    grants = {token: Grant(Access.WRITE)}
    if read_token_file is not None:
        read_only = read_token(read_token_file)
        if read_only == token:
            raise TokenError(f"the read-only token in {read_token_file} is the same as the write token")
        grants[read_only] = Grant(Access.READ)
    return TokenTable(grants)

"""Where a client finds its bearer token, and the default token file both sides share.

What it owns: the one lookup order every client uses (the library, ``rdzvctl``, the torchrun
handler), first match wins:

1. an explicit token (an argument);
2. an explicit token file (torchrun ``--rdzv-conf token_file=PATH``, ``rdzvctl --token-file``);
3. the environment variable ``RDZV_TOKEN`` (the token itself);
4. the environment variable ``RDZV_TOKEN_FILE`` (a path);
5. the default file, ``$XDG_CONFIG_HOME/rdzv-server/token`` (``~/.config/rdzv-server/token``),
   which the server creates on its first start: a server and its clients on one host need
   no configuration at all.

No token found is not an error here: a server started with ``--no-auth`` needs none, and
one that needs it answers ``401 unauthorized`` with a message saying where to put it.

What it must not know: HTTP, torch. It never logs or prints a token.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .wire import TOKEN_ENV, TOKEN_FILE_ENV, default_token_file


class CredentialError(ValueError):
    """A token file that was named explicitly cannot be read, or holds no token."""


def read_token_file(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace removed). Raises :class:`CredentialError`."""
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CredentialError(f"cannot read the token file {path}: {exc}") from exc
    if not token or any(ch.isspace() for ch in token):
        raise CredentialError(f"the token file {path} must hold one token (no spaces), and it is empty or has several")
    return token


def find_token(
    token: str | None = None, token_file: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> str | None:
    """The bearer token this client sends, by the module's lookup order; None if there is none.

    Raises :class:`CredentialError` when the token file that wins the lookup (given, from
    ``RDZV_TOKEN_FILE``, or the default one when it exists) cannot be read or is empty.
    """
    env = os.environ if env is None else env
    if token:
        return token.strip()
    if token_file:
        return read_token_file(Path(token_file).expanduser())
    if env.get(TOKEN_ENV, "").strip():
        return env[TOKEN_ENV].strip()
    if env.get(TOKEN_FILE_ENV, "").strip():
        return read_token_file(Path(env[TOKEN_FILE_ENV].strip()).expanduser())
    default = default_token_file(env)
    if default.exists():
        return read_token_file(default)
    return None

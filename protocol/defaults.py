"""Where a client finds the daemon: the socket's default path and the variable that overrides it.

Both sides of the socket read these: the daemon's configuration (``daemon/config.py``) takes
its default from here, and every client command resolves ``--socket`` with
:func:`socket_path`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

SOCKET_ENV: Final = "SCRATCHD_SOCKET"
DEFAULT_SOCKET: Final = "/run/scratchd/scratchd.sock"


def socket_path(flag: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The socket a client command talks to: ``--socket``, else ``SCRATCHD_SOCKET``, else
    the default."""
    env = os.environ if environ is None else environ
    return flag or env.get(SOCKET_ENV) or DEFAULT_SOCKET

"""The daemon's socket file: a file left by a dead daemon is removed, a live one's never."""

from __future__ import annotations

import contextlib
import os
import socket


def clear_stale_socket(path: str) -> None:
    """Remove a socket file left by a dead daemon; refuse to steal a live one's."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    except OSError as exc:
        raise OSError(f"socket {path} exists and cannot be probed: {exc}") from None
    finally:
        probe.close()
    raise OSError(f"socket {path} is in use by a running daemon")

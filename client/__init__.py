"""What a PLC gateway imports to talk to scratchd: the client (``api.py``) and the user's
commands (``commands.py``: ``infer``, ``status``, ``reload``; ``status_view.py`` renders status).

This package depends on :mod:`scratchd.protocol` and third-party packages only, so a gateway
can vendor ``protocol/`` and ``client/`` without the daemon.
"""

from scratchd.client.api import (
    AsyncClient,
    Client,
    ImageInput,
    Reply,
    StatusReply,
    build_request,
    request_frame,
    unpack_mask,
)

__all__ = [
    "AsyncClient",
    "Client",
    "ImageInput",
    "Reply",
    "StatusReply",
    "build_request",
    "request_frame",
    "unpack_mask",
]

"""FerryError: what every failed call of the Python client raises.

The C++ client returns absl::Status with the daemon's message prefixed by
what it was doing (proto/grpc_status.h); the Python client raises the same
as an exception: ``str(e)`` is "what: CODE: details", ``e.code`` the
grpc.StatusCode (FAILED_PRECONDITION, NOT_FOUND, ...), ``e.details`` the
daemon's message.
"""

from __future__ import annotations

from typing import Optional

import grpc


class FerryError(RuntimeError):
    """An RPC failed, or the client refused a call; ``code`` is the
    grpc.StatusCode, ``details`` the message."""

    def __init__(self, what: str, code: Optional[grpc.StatusCode],
                 details: str) -> None:
        super().__init__("%s: %s: %s" % (what, code.name if code else "?", details))
        self.code = code
        self.details = details

"""LeaseKeeper: renews a participant's lease on a background thread
(client/lease_keeper.h).

A registration returns a lease (docs/api.md, "Leases"); a lease that runs
out is a Deregister done by the daemon. SourceClient and DestinationClient
each own one LeaseKeeper, which sends Heartbeat every lease / 3 (the
daemon's answer may change the lease; the period follows it). A failed
heartbeat is retried at the next tick; NOT_FOUND (the lease already ran
out) or PERMISSION_DENIED stop the thread for good, are kept in
``error``, and call ``on_lost`` (if given) from the thread, once.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable, Optional

import grpc

from ferry.errors import FerryError
from ferry.v1 import registration_pb2, types_pb2

if TYPE_CHECKING:
    from ferry.connection import Connection

log = logging.getLogger("ferry")

DEREGISTER_TIMEOUT_S = 5.0


class LeaseKeeper:
    """Heartbeats every lease / 3 on a daemon thread, from construction
    until ``stop()``. ``who`` names the participant in logs ("source policy
    rank 3")."""

    def __init__(self, conn: "Connection", handle: types_pb2.ParticipantHandle,
                 lease_ms: int, who: str,
                 on_lost: Optional[Callable[[], None]] = None) -> None:
        self._conn, self._handle, self._who = conn, handle, who
        self._on_lost = on_lost
        self._period = max(lease_ms / 3000.0, 0.05)
        self._stop = threading.Event()
        self.error: Optional[FerryError] = None
        self._thread = threading.Thread(target=self._run, name="ferry-lease " + who,
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                resp = self._conn.registry.Heartbeat(
                    registration_pb2.HeartbeatRequest(handle=self._handle),
                    timeout=self._conn.rpc_timeout_s)
                if resp.lease_duration_ms > 0:
                    self._period = max(resp.lease_duration_ms / 3000.0, 0.05)
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.NOT_FOUND,
                                grpc.StatusCode.PERMISSION_DENIED):
                    self.error = FerryError("Heartbeat(%s)" % self._who, e.code(),
                                            e.details())
                    log.error("%s", self.error)
                    if self._on_lost is not None:
                        self._on_lost()
                    return
                log.warning("Heartbeat(%s): %s", self._who, e.details())

    def stop(self) -> None:
        """Stops the thread and joins it, waiting at most one RPC deadline."""
        self._stop.set()
        self._thread.join(timeout=self._conn.rpc_timeout_s)


def deregister(conn: "Connection", handle: types_pb2.ParticipantHandle,
               who: str) -> None:
    """Registry.Deregister with a short deadline; a failure is logged, not
    raised (the lease runs out by itself)."""
    try:
        conn.registry.Deregister(registration_pb2.DeregisterRequest(handle=handle),
                                 timeout=DEREGISTER_TIMEOUT_S)
    except grpc.RpcError as e:
        log.warning("Deregister(%s): %s", who, e.details())

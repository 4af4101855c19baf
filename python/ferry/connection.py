"""Connection: the gRPC channel from a client process to a ferryd
(client/connection.h).

Participants (trainer and engine ranks) talk to the ferryd on their own node
over its unix socket; operators may use any daemon's TCP port, which ferryd
serves only with mutual TLS. A Connection holds the channel and the stubs of
the services the client calls; any number of clients share one. Creating it
does no I/O (gRPC connects lazily); ``connect()`` also waits until the
daemon answers.

Threading: gRPC channels and stubs are thread-safe; so is a Connection.
"""

from __future__ import annotations

import os
import time
from typing import (Any, Callable, Dict, Iterable, List, Mapping, Optional,
                    Sequence)

import grpc

from ferry import lifecycle
from ferry.errors import FerryError
from ferry.v1 import (inspection_pb2, inspection_pb2_grpc, lifecycle_pb2_grpc,
                      registration_pb2_grpc, types_pb2, version_pb2,
                      version_pb2_grpc)

# Largest message the client accepts: a large model's ExplainPlan runs to
# tens of MB (docs/api.md, "Message size"); gRPC's default is 4 MiB.
MAX_MESSAGE_BYTES = 256 << 20


def default_socket_path() -> str:
    """The daemon's unix socket: $FERRY_SOCKET, else
    $XDG_RUNTIME_DIR/ferry/ferryd.sock, else /tmp/ferry-$UID/ferryd.sock.
    The rule is common/socket_path.h's, which ferryd and the C++ clients
    use; python/tests/client_test.py checks that a ferryd started without
    --socket and this function meet."""
    explicit = os.environ.get("FERRY_SOCKET")
    if explicit:
        return explicit
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "ferry", "ferryd.sock")
    return "/tmp/ferry-%d/ferryd.sock" % os.getuid()


def normalize_address(address: Optional[str]) -> str:
    """A gRPC target from what a user typed: None or "" -> the default
    socket; a path starting with '/' or '.' -> "unix:PATH"; "unix:PATH" and
    "host:port" unchanged."""
    if not address:
        return "unix:" + default_socket_path()
    if address.startswith("/") or address.startswith("."):
        return "unix:" + address
    return address


class Connection:
    """A gRPC channel to one ferryd with its stubs (``registry``,
    ``versions``, ``inspection``, ``lifecycle``). Usable as a context
    manager: the channel is closed on exit."""

    def __init__(self, address: Optional[str] = None, rpc_timeout_s: float = 30.0,
                 tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
                 tls_ca: Optional[str] = None) -> None:
        """Creates the channel; does not wait for the daemon (see
        ``wait_for_ready`` and ``connect``). A daemon at host:port serves
        only mutual TLS (docs/api.md, "Authentication"): tls_cert, tls_key
        and tls_ca are PEM files of a certificate signed by the cluster CA
        (FerryError INVALID_ARGUMENT without them). A unix socket needs
        none."""
        self.address = normalize_address(address)
        self.rpc_timeout_s = rpc_timeout_s
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        if self.address.startswith("unix:"):
            self.channel = grpc.insecure_channel(self.address, options=options)
        else:
            if not (tls_cert and tls_key and tls_ca):
                raise FerryError(
                    "connect", grpc.StatusCode.INVALID_ARGUMENT,
                    "ferryd at %s is reached over TCP, which it serves only with "
                    "mutual TLS: pass tls_cert, tls_key and tls_ca, or use its "
                    "unix socket" % self.address)

            def read(path: str) -> bytes:
                with open(path, "rb") as f:
                    return f.read()
            credentials = grpc.ssl_channel_credentials(
                root_certificates=read(tls_ca), private_key=read(tls_key),
                certificate_chain=read(tls_cert))
            self.channel = grpc.secure_channel(self.address, credentials,
                                               options=options)
        self.registry = registration_pb2_grpc.RegistryStub(self.channel)
        self.versions = version_pb2_grpc.VersionsStub(self.channel)
        self.inspection = inspection_pb2_grpc.InspectionStub(self.channel)
        self.lifecycle = lifecycle_pb2_grpc.LifecycleStub(self.channel)

    # -- the channel -------------------------------------------------------
    def wait_for_ready(self, timeout_s: float = 20.0) -> "Connection":
        """Waits until the channel is connected, at most ``timeout_s``;
        FerryError UNAVAILABLE naming the address otherwise."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise FerryError("connect", grpc.StatusCode.UNAVAILABLE,
                             "no ferryd answers at %s within %.0f s" % (
                                 self.address, timeout_s)) from None
        return self

    def call(self, what: str, method: Callable[..., Any], request: Any,
             timeout_s: Optional[float] = None) -> Any:
        """One unary RPC with a deadline (``rpc_timeout_s`` unless given);
        a failure is a FerryError prefixed with ``what``."""
        try:
            return method(request, timeout=timeout_s or self.rpc_timeout_s)
        except grpc.RpcError as e:
            raise FerryError(what, e.code(), e.details()) from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inspection and waiting -------------------------------------------
    def list_streams(self) -> Sequence[inspection_pb2.StreamInfo]:
        return self.call("ListStreams", self.inspection.ListStreams,
                         inspection_pb2.ListStreamsRequest()).streams

    def wait_for_version(self, stream: str, version: int, instance_id: str = "",
                         timeout_s: float = 60.0) -> List[types_pb2.InstanceStatus]:
        """Versions.WaitForVersion: the instances' statuses for ``version``."""
        req = version_pb2.WaitForVersionRequest(
            stream=stream, version=version, instance_id=instance_id,
            timeout_ms=int(timeout_s * 1000))
        return list(self.call("WaitForVersion(%s, %d)" % (stream, version),
                              self.versions.WaitForVersion, req,
                              timeout_s=timeout_s + 10).instances)

    def explain_plan(self, instance_id: str,
                     tp_rank: Optional[int] = None) -> inspection_pb2.ExplainPlanResponse:
        """Inspection.ExplainPlan: per engine parameter and rank, how it
        resolved (direct, fused, fallback) and why; totals; coverage gaps."""
        req = inspection_pb2.ExplainPlanRequest(instance_id=instance_id)
        if tp_rank is not None:
            req.tp_rank = tp_rank
        return self.call("ExplainPlan(%s)" % instance_id, self.inspection.ExplainPlan, req)

    def wait_instances(self, stream: str, instance_ids: Sequence[str],
                       timeout_s: float = 60.0, poll_s: float = 0.05,
                       sources: bool = False) -> List[inspection_pb2.InstanceInfo]:
        """Waits until every named instance follows ``stream`` with all its TP
        ranks registered (it then takes part in the next version) and, with
        ``sources``, every source rank of the stream too; returns the
        instances' InstanceInfos."""
        deadline = time.monotonic() + timeout_s
        while True:
            infos: Dict[str, inspection_pb2.InstanceInfo] = {}
            try:
                streams = self.call("ListStreams", self.inspection.ListStreams,
                                    inspection_pb2.ListStreamsRequest(stream=stream)).streams
            except FerryError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:  # no source registered yet
                    raise
                streams = []
            sources_missing = sources
            for s in streams:
                if s.name == stream:
                    infos = {i.instance_id: i for i in s.instances}
                    sources_missing = sources and (
                        s.world_size == 0 or len(s.registered_ranks) < s.world_size)
            missing = [i for i in instance_ids
                       if i not in infos
                       or len(infos[i].registered_tp_ranks) < infos[i].tp_size]
            if not missing and not sources_missing:
                return [infos[i] for i in instance_ids]
            if time.monotonic() > deadline:
                raise FerryError("wait_instances(%s)" % stream,
                                 grpc.StatusCode.DEADLINE_EXCEEDED,
                                 "instances not complete within %.0f s: %s" % (
                                     timeout_s, ", ".join(
                                         "%s (%s of %s ranks)" % (
                                             i, list(infos[i].registered_tp_ranks)
                                             if i in infos else "none",
                                             infos[i].tp_size if i in infos else "?")
                                         for i in missing if i in instance_ids)
                                     + (" and the source ranks" if sources_missing else "")))
            time.sleep(poll_s)

    # -- lifecycle (ferry.lifecycle's functions, as methods) ---------------
    def reload_in_place(self, instance_id: str,
                        timeout_s: float = 120.0) -> types_pb2.InstanceStatus:
        """ferry.lifecycle.reload_in_place."""
        return lifecycle.reload_in_place(self, instance_id, timeout_s)

    def offload(self, instance_id: str, keep_host_copy: bool = False,
                timeout_s: float = 600.0) -> types_pb2.InstanceStatus:
        """ferry.lifecycle.offload."""
        return lifecycle.offload(self, instance_id, keep_host_copy, timeout_s)

    def onload(self, instance_id: str,
               timeout_s: float = 600.0) -> types_pb2.InstanceStatus:
        """ferry.lifecycle.onload."""
        return lifecycle.onload(self, instance_id, timeout_s)

    def load_adapter(self, instance_id: str, adapter_name: str, adapter_stream: str,
                     adapter_config_json: str,
                     timeout_s: float = 120.0) -> types_pb2.InstanceStatus:
        """ferry.lifecycle.load_adapter."""
        return lifecycle.load_adapter(self, instance_id, adapter_name,
                                      adapter_stream, adapter_config_json, timeout_s)

    def update_adapter(self, instance_id: str, adapter_name: str,
                       adapter_stream: str = "", adapter_config_json: str = "",
                       timeout_s: float = 120.0) -> types_pb2.InstanceStatus:
        """ferry.lifecycle.update_adapter."""
        return lifecycle.update_adapter(self, instance_id, adapter_name,
                                        adapter_stream, adapter_config_json,
                                        timeout_s)

    def unload_adapter(self, instance_id: str, adapter_name: str,
                       timeout_s: float = 120.0) -> None:
        """ferry.lifecycle.unload_adapter."""
        lifecycle.unload_adapter(self, instance_id, adapter_name, timeout_s)

    def update_config(self, instance_id: str,
                      set_options: Optional[Mapping[str, str]] = None,
                      clear_options: Iterable[str] = ()) -> Dict[str, str]:
        """ferry.lifecycle.update_config."""
        return lifecycle.update_config(self, instance_id, set_options, clear_options)

    def get_config(self, instance_id: str) -> Dict[str, str]:
        """ferry.lifecycle.get_config."""
        return lifecycle.get_config(self, instance_id)


def connect(address: Optional[str] = None, timeout_s: float = 20.0,
            tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
            tls_ca: Optional[str] = None) -> Connection:
    """Opens a Connection to ferryd (unix:PATH, a path, or host:port; default:
    $FERRY_SOCKET, $XDG_RUNTIME_DIR/ferry/ferryd.sock, /tmp/ferry-$UID/...)
    and waits until it answers. host:port needs tls_cert, tls_key, tls_ca."""
    return Connection(address, tls_cert=tls_cert, tls_key=tls_key,
                      tls_ca=tls_ca).wait_for_ready(timeout_s)

"""The ferry Python client: sources (trainer ranks) and destinations (engine
ranks) of ferryd, mirroring client/source_client.h and
client/destination_client.h.

Sources register pieces of tensors that live in a SharedTensorArena and call
``publish(v)`` once their memory holds version v. Destinations register an
engine parameter table and follow their Subscribe stream on a thread of
their own, calling the user's callbacks:

    on_prepare(v)            get ready to pause (stop admitting requests)
    on_pause(v)              return at a safe point: no forward pass reads the
                             weights; ferry then writes the live tensors
    on_apply(v, fallback)    direct bytes are in place; ``fallback`` is a list
                             of (checkpoint name, tensor in daemon staging)
                             for the engine's own loader, valid during the call
    on_commit(v)             resume serving at v
    on_abort(v, reason, dirty)  resume the previous version (clean) or stay
                             paused (dirty: a retry or the next version follows)
    on_offload(region_ids, host_copy_kept)
                             Lifecycle.Offload: drop every tensor viewing the
                             arenas (the client then releases them: unmapped,
                             unlinked); serve nothing until onloaded
    on_onload(region_ids)    Lifecycle.Onload: the client has made the arenas
                             anew (same sizes; registered with UpdateRegions);
                             rebuild the tensors at their offsets
                             (``arena.view``). Stay paused until COMMIT (the
                             instance was refilled) or a dirty ABORT (the
                             stream's next version fills it)

LoRA adapters (``conn.load_adapter``; docs/api.md, "LoRA adapters") come
as events with an adapter name, a sequence of their own per adapter,
interleaved with the base model's:

    on_adapter_pause(name, v)   stop using the adapter (the base model and
                                the other adapters keep serving)
    on_adapter_apply(name, v, config_json, shares)
                                load the adapter under ``name``, replacing
                                what it held; ``shares`` is a list of
                                (tensor name, tensor, share): this rank's
                                part of each lora_A / lora_B (``share`` is
                                (offsets, extents) of the global tensor, or
                                None for the whole tensor), in daemon
                                staging, valid during the call
    on_adapter_commit(name, v)  serve the adapter at v
    on_adapter_abort(name, v, reason, dirty)
    on_adapter_unload(name)     drop it; return once no request uses it

A callback that raises acks FAILED with the exception's text, which aborts
the instance's version. A missing callback acks OK, except
on_adapter_apply and on_adapter_unload: an engine without them does not
serve adapters, and their events are acked FAILED.

Both clients register again by themselves when the daemon no longer knows
them (it restarted, or the lease ran out), as the C++ clients do: a source
at its next ``begin()``, a destination when its event stream ends (holding
the latest version it committed or applied; ``reregister=False`` turns it
off). Neither takes over a rank someone else registered meanwhile.
"""

import logging
import mmap
import os
import threading
import time

import grpc

from ferry.v1 import (inspection_pb2, inspection_pb2_grpc, lifecycle_pb2,
                          lifecycle_pb2_grpc, registration_pb2,
                          registration_pb2_grpc, types_pb2, version_pb2,
                          version_pb2_grpc)
from ferry import dtypes
from ferry.layout import pieces_for_tensor

log = logging.getLogger("ferry")

_MAX_MESSAGE = 256 << 20
_DEREGISTER_TIMEOUT_S = 5.0


class FerryError(RuntimeError):
    """An RPC failed; ``code`` is the grpc.StatusCode."""

    def __init__(self, what, code, details):
        super().__init__("%s: %s: %s" % (what, code.name if code else "?", details))
        self.code = code
        self.details = details


def default_socket_path():
    explicit = os.environ.get("FERRY_SOCKET")
    if explicit:
        return explicit
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "ferry", "ferryd.sock")
    return "/tmp/ferry-%d/ferryd.sock" % os.getuid()


def normalize_address(address):
    if not address:
        return "unix:" + default_socket_path()
    if address.startswith("/") or address.startswith("."):
        return "unix:" + address
    return address


class Connection:
    """A gRPC channel to one ferryd with its stubs."""

    def __init__(self, address=None, rpc_timeout_s=30.0, tls_cert=None,
                 tls_key=None, tls_ca=None):
        """A daemon at host:port serves only mutual TLS (docs/api.md,
        "Authentication"): tls_cert, tls_key and tls_ca are PEM files of a
        certificate signed by the cluster CA. A unix socket needs none."""
        self.address = normalize_address(address)
        self.rpc_timeout_s = rpc_timeout_s
        options = [
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            ("grpc.max_send_message_length", _MAX_MESSAGE),
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
            def read(path):
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

    def wait_for_ready(self, timeout_s=20.0):
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise FerryError("connect", grpc.StatusCode.UNAVAILABLE,
                             "no ferryd answers at %s within %.0f s" % (
                                 self.address, timeout_s))
        return self

    def call(self, what, method, request, timeout_s=None):
        try:
            return method(request, timeout=timeout_s or self.rpc_timeout_s)
        except grpc.RpcError as e:
            raise FerryError(what, e.code(), e.details()) from None

    def list_streams(self):
        return self.call("ListStreams", self.inspection.ListStreams,
                         inspection_pb2.ListStreamsRequest()).streams

    def wait_for_version(self, stream, version, instance_id="", timeout_s=60.0):
        """Versions.WaitForVersion: the instances' statuses for ``version``."""
        req = version_pb2.WaitForVersionRequest(
            stream=stream, version=version, instance_id=instance_id,
            timeout_ms=int(timeout_s * 1000))
        return list(self.call("WaitForVersion(%s, %d)" % (stream, version),
                              self.versions.WaitForVersion, req,
                              timeout_s=timeout_s + 10).instances)

    def explain_plan(self, instance_id, tp_rank=None):
        """Inspection.ExplainPlan: per engine parameter and rank, how it
        resolved (direct, fused, fallback) and why; totals; coverage gaps."""
        req = inspection_pb2.ExplainPlanRequest(instance_id=instance_id)
        if tp_rank is not None:
            req.tp_rank = tp_rank
        return self.call("ExplainPlan(%s)" % instance_id, self.inspection.ExplainPlan, req)

    def reload_in_place(self, instance_id, timeout_s=120.0):
        """Lifecycle.ReloadInPlace: the stream's latest committed version
        written into the instance again, from a peer instance; returns its
        InstanceStatus once settled (COMMITTED, or ABORTED with the reason)."""
        req = lifecycle_pb2.ReloadInPlaceRequest(instance_id=instance_id)
        return self.call("ReloadInPlace(%s)" % instance_id,
                         self.lifecycle.ReloadInPlace, req,
                         timeout_s=timeout_s).status

    def offload(self, instance_id, keep_host_copy=False, timeout_s=600.0):
        """Lifecycle.Offload: the instance's ranks release their memory,
        after ferryd copied it if ``keep_host_copy``; returns its
        InstanceStatus once settled (OFFLOADED, or ABORTED with the reason)."""
        req = lifecycle_pb2.OffloadRequest(instance_id=instance_id,
                                           keep_host_copy=keep_host_copy)
        return self.call("Offload(%s)" % instance_id, self.lifecycle.Offload,
                         req, timeout_s=timeout_s).status

    def onload(self, instance_id, timeout_s=600.0):
        """Lifecycle.Onload: the ranks allocate again and are refilled (host
        copy, else a peer); returns COMMITTED, or ABORTED with dirty set when
        the instance waits for the stream's next version."""
        req = lifecycle_pb2.OnloadRequest(instance_id=instance_id)
        return self.call("Onload(%s)" % instance_id, self.lifecycle.Onload,
                         req, timeout_s=timeout_s).status

    def load_adapter(self, instance_id, adapter_name, adapter_stream,
                     adapter_config_json, timeout_s=120.0):
        """Lifecycle.LoadAdapter: attaches the LoRA adapter whose tensors are
        the stream ``adapter_stream`` to the instance under ``adapter_name``;
        returns its InstanceStatus on that stream: COMMITTED when delivered
        now (from a peer instance), IDLE (``waiting_reason``) when it waits
        for the stream's next version."""
        req = lifecycle_pb2.LoadAdapterRequest(
            instance_id=instance_id, adapter_name=adapter_name,
            adapter_stream=adapter_stream,
            adapter_config_json=adapter_config_json)
        return self.call("LoadAdapter(%s, %s)" % (instance_id, adapter_name),
                         self.lifecycle.LoadAdapter, req,
                         timeout_s=timeout_s).status

    def update_adapter(self, instance_id, adapter_name, adapter_stream="",
                       adapter_config_json="", timeout_s=120.0):
        """Lifecycle.UpdateAdapter: the name follows another stream and/or
        configuration ("" keeps the current one)."""
        req = lifecycle_pb2.UpdateAdapterRequest(
            instance_id=instance_id, adapter_name=adapter_name,
            adapter_stream=adapter_stream,
            adapter_config_json=adapter_config_json)
        return self.call("UpdateAdapter(%s, %s)" % (instance_id, adapter_name),
                         self.lifecycle.UpdateAdapter, req,
                         timeout_s=timeout_s).status

    def unload_adapter(self, instance_id, adapter_name, timeout_s=120.0):
        """Lifecycle.UnloadAdapter: the ranks drop the adapter; its staging
        is released."""
        req = lifecycle_pb2.UnloadAdapterRequest(instance_id=instance_id,
                                                 adapter_name=adapter_name)
        self.call("UnloadAdapter(%s, %s)" % (instance_id, adapter_name),
                  self.lifecycle.UnloadAdapter, req, timeout_s=timeout_s)

    def update_config(self, instance_id, set_options=None, clear_options=()):
        """Lifecycle.UpdateConfig: sets and clears load options (docs/api.md,
        "Load options"); returns every option now in effect, as a dict."""
        req = lifecycle_pb2.UpdateConfigRequest(
            instance_id=instance_id, set_options=dict(set_options or {}),
            clear_options=list(clear_options))
        return dict(self.call("UpdateConfig(%s)" % instance_id,
                              self.lifecycle.UpdateConfig, req).options)

    def get_config(self, instance_id):
        """The instance's load options in effect, defaults included."""
        return self.update_config(instance_id)

    def wait_instances(self, stream, instance_ids, timeout_s=60.0, poll_s=0.05,
                       sources=False):
        """Waits until every named instance follows ``stream`` with all its TP
        ranks registered (it then takes part in the next version) and, with
        ``sources``, every source rank of the stream too; returns the
        instances' InstanceInfos."""
        deadline = time.monotonic() + timeout_s
        while True:
            infos = {}
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

    def close(self):
        self.channel.close()


def connect(address=None, timeout_s=20.0, tls_cert=None, tls_key=None,
            tls_ca=None):
    """Opens a Connection to ferryd (unix:PATH, a path, or host:port; default:
    $FERRY_SOCKET, $XDG_RUNTIME_DIR/ferry/ferryd.sock, /tmp/ferry-$UID/...)
    and waits until it answers. host:port needs tls_cert, tls_key, tls_ca."""
    return Connection(address, tls_cert=tls_cert, tls_key=tls_key,
                      tls_ca=tls_ca).wait_for_ready(timeout_s)


class _LeaseKeeper:
    """Heartbeats every lease / 3 on a daemon thread (client/lease_keeper.h)."""

    def __init__(self, conn, handle, lease_ms, who):
        self._conn, self._handle, self._who = conn, handle, who
        self._period = max(lease_ms / 3000.0, 0.05)
        self._stop = threading.Event()
        self.error = None
        self._thread = threading.Thread(target=self._run, name="ferry-lease " + who,
                                        daemon=True)
        self._thread.start()

    def _run(self):
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
                    return
                log.warning("Heartbeat(%s): %s", self._who, e.details())

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=self._conn.rpc_timeout_s)


def _as_regions(arenas):
    if arenas is None:
        return []
    if not isinstance(arenas, (list, tuple)):
        arenas = [arenas]
    return list(arenas)


def _locate(tensor, arenas, what):
    for a in arenas:
        off = a.offset_of(tensor)
        if off is not None:
            return a, off
    raise ValueError("%s: the tensor is not inside any registered arena "
                     "(allocate it with SharedTensorArena.tensor or "
                     "ferry.torch_utils.move_to_arena)" % what)


def _deregister(conn, handle, who):
    try:
        conn.registry.Deregister(registration_pb2.DeregisterRequest(handle=handle),
                                 timeout=_DEREGISTER_TIMEOUT_S)
    except grpc.RpcError as e:
        log.warning("Deregister(%s): %s", who, e.details())


# ---------------------------------------------------------------------------
# Sources


class PublishOutcome:
    """One version's outcome: an InstanceStatus per instance."""

    def __init__(self, version, instances):
        self.version = version
        self.instances = list(instances)

    def all_committed(self):
        return all(s.state == types_pb2.INSTANCE_STATE_COMMITTED
                   for s in self.instances)

    def by_instance(self):
        return {s.instance_id: s for s in self.instances}

    def summary(self):
        done = [s for s in self.instances if s.state == types_pb2.INSTANCE_STATE_COMMITTED]
        bad = [s for s in self.instances if s.state != types_pb2.INSTANCE_STATE_COMMITTED]
        text = "%d committed, %d aborted" % (len(done), len(bad))
        if bad:
            text += " (" + "; ".join("%s: %s%s" % (s.instance_id, s.abort_reason,
                                                   " [dirty]" if s.dirty else "")
                                     for s in bad) + ")"
        return text


class SourceClient:
    """One trainer rank of a stream. ``params`` is a list of (tensor, shard or
    list of shards); every tensor lives in one of ``arenas``. ``parameters``
    (optional) declares extra ParameterSpecs (PP, EP: declared, not held)."""

    def __init__(self, conn, stream, rank, world_size, arenas, params,
                 replace_existing=False, node="", extra_parameters=(),
                 commit_timeout_s=600.0):
        self.conn = conn
        self.stream = stream
        self.rank = rank
        self.who = "source %s rank %d" % (stream, rank)
        self.commit_timeout_s = commit_timeout_s
        self.arenas = _as_regions(arenas)
        reg = registration_pb2.SourceRegistration(
            stream=stream, rank=rank, world_size=world_size, node=node, pid=os.getpid())
        reg.device.kind = types_pb2.DEVICE_KIND_HOST
        for a in self.arenas:
            reg.regions.append(a.describe())
        declared = {}
        for tensor, shards in params:
            shard_list = shards if isinstance(shards, (list, tuple)) else [shards]
            for s in shard_list:
                spec = (s.shape, tensor.dtype)
                if declared.setdefault(s.name, spec) != spec:
                    raise ValueError("%s: parameter %s declared twice differently"
                                     % (self.who, s.name))
            arena, off = _locate(tensor, self.arenas, "%s: %s" % (
                self.who, shard_list[0].name))
            reg.pieces.extend(pieces_for_tensor(tensor, shard_list, arena.region_id, off))
        for name, (shape, dtype) in declared.items():
            reg.parameters.add(name=name, dtype=dtypes.to_proto(dtype), shape=shape)
        for spec in extra_parameters:
            if spec.name not in declared:
                reg.parameters.append(spec)
        self._reg = reg  # protos only: what a re-registration sends
        resp = conn.call("RegisterSource(%s)" % self.who, conn.registry.RegisterSource,
                         registration_pb2.RegisterSourceRequest(
                             source=reg, replace_existing=replace_existing))
        self.handle = resp.handle
        self.reregistrations = 0
        self._lease = _LeaseKeeper(conn, self.handle, resp.lease_duration_ms, self.who)
        log.info("%s registered as %s (%d pieces)", self.who,
                 self.handle.participant_id, len(reg.pieces))

    def _reregister(self, why):
        """The daemon no longer knows this rank (it restarted, or the lease
        ran out): registers again with the same layout and memory, never
        taking over a rank someone else registered meanwhile."""
        log.warning("%s: %s; registering again", self.who, why)
        resp = self.conn.call("RegisterSource(%s)" % self.who,
                              self.conn.registry.RegisterSource,
                              registration_pb2.RegisterSourceRequest(source=self._reg))
        self._lease.stop()
        self.handle = resp.handle
        self._lease = _LeaseKeeper(self.conn, self.handle, resp.lease_duration_ms,
                                   self.who)
        self.reregistrations += 1

    @classmethod
    def from_module(cls, conn, stream, rank, world_size, module, sharding, arenas,
                    **kwargs):
        """Registers ``module``'s parameters: ``sharding(name, param)`` returns
        the Shard (or list of Shards, for a fused tensor) the parameter holds,
        or None to leave it out. The parameters must live in ``arenas``
        (ferry.move_to_arena)."""
        params = []
        for name, p in module.named_parameters():
            s = sharding(name, p)
            if s is not None:
                params.append((p.data, s))
        return cls(conn, stream, rank, world_size, arenas, params, **kwargs)

    def begin(self, version):
        """BeginVersion: engines prepare while the trainer finishes the step.
        A rank the daemon no longer knows (restarted, lease ran out) registers
        again first, as the C++ client does."""
        def call():
            return self.conn.call("BeginVersion(%s, %d)" % (self.who, version),
                                  self.conn.versions.BeginVersion,
                                  version_pb2.BeginVersionRequest(handle=self.handle,
                                                                  version=version))
        try:
            resp = call()
        except FerryError as e:
            # BeginVersion's NOT_FOUND and PERMISSION_DENIED are about the
            # handle (version.proto).
            if e.code not in (grpc.StatusCode.NOT_FOUND,
                              grpc.StatusCode.PERMISSION_DENIED):
                raise
            self._reregister(e.details)
            resp = call()
        return list(resp.instance_ids)

    def commit(self, version):
        """CommitVersion: blocks until every instance settled. Do not write the
        registered memory until it returns."""
        resp = self.conn.call("CommitVersion(%s, %d)" % (self.who, version),
                              self.conn.versions.CommitVersion,
                              version_pb2.CommitVersionRequest(handle=self.handle,
                                                               version=version),
                              timeout_s=self.commit_timeout_s)
        return PublishOutcome(version, resp.instances)

    def abort(self, version, reason):
        self.conn.call("AbortVersion(%s, %d)" % (self.who, version),
                       self.conn.versions.AbortVersion,
                       version_pb2.AbortVersionRequest(handle=self.handle,
                                                       version=version, reason=reason))

    def publish(self, version):
        """begin + commit; returns the PublishOutcome (per-instance results)."""
        self.begin(version)
        return self.commit(version)

    def close(self):
        if self._lease is None:
            return
        self._lease.stop()
        self._lease = None
        _deregister(self.conn, self.handle, self.who)


# ---------------------------------------------------------------------------
# Destinations

_ACK_KINDS = (version_pb2.UPDATE_EVENT_KIND_PREPARE, version_pb2.UPDATE_EVENT_KIND_PAUSE,
              version_pb2.UPDATE_EVENT_KIND_APPLY)


class _Staging:
    """A daemon staging region mapped here (ids >= 2^31)."""

    def __init__(self, region):
        self.size = region.size_bytes
        self.offset = region.shared_memory.file_offset_bytes
        self.path = _Staging.path_of(region)
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            self.map = mmap.mmap(fd, self.offset + self.size, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    @staticmethod
    def path_of(region):
        shm = region.shared_memory
        if shm.WhichOneof("memory") == "memfd":
            return "/proc/%d/fd/%d" % (shm.memfd.pid, shm.memfd.fd)
        return "/dev/shm" + shm.shm_name


class DestinationClient:
    """One TP rank of an engine instance. ``params`` is the engine parameter
    table (a list of EngineParam), every tensor inside one of ``arenas``.
    Events are handled on a reader thread; see the module doc for the
    callbacks."""

    def __init__(self, conn, instance_id, stream, tp_rank, tp_size, arenas, params,
                 on_prepare=None, on_pause=None, on_apply=None, on_commit=None,
                 on_abort=None, on_offload=None, on_onload=None, held_version=0,
                 replace_existing=False, node="", reregister=True,
                 on_adapter_pause=None, on_adapter_apply=None,
                 on_adapter_commit=None, on_adapter_abort=None,
                 on_adapter_unload=None):
        self.conn = conn
        self.instance_id = instance_id
        self.stream = stream
        self.tp_rank = tp_rank
        self.who = "instance %s tp rank %d" % (instance_id, tp_rank)
        self.tp_size = tp_size
        self.arenas = _as_regions(arenas)
        self._callbacks = dict(prepare=on_prepare, pause=on_pause, apply=on_apply,
                               commit=on_commit, abort=on_abort,
                               offload=on_offload, onload=on_onload,
                               adapter_pause=on_adapter_pause,
                               adapter_apply=on_adapter_apply,
                               adapter_commit=on_adapter_commit,
                               adapter_abort=on_adapter_abort,
                               adapter_unload=on_adapter_unload)
        reg = self._registration(stream, self.arenas, params, held_version, node)
        # Protos only (no tensor: an offload must be able to drop them all):
        # what a re-registration sends.
        self._reg = reg
        self._reregister_enabled = reregister
        self.reregistrations = 0
        self._applied = held_version  # the latest version acked APPLY OK
        resp = conn.call("RegisterDestination(%s)" % self.who,
                         conn.registry.RegisterDestination,
                         registration_pb2.RegisterDestinationRequest(
                             destination=reg, replace_existing=replace_existing))
        self.handle = resp.handle
        self._cond = threading.Condition()
        self._committed = held_version
        self._aborted = 0
        self._abort_reason = ""
        self._dirty = False
        self._stream_error = None
        self._stopping = False
        self._call = None
        # Staging mappings by adapter name ("": the base model), by region id.
        self._staging = {}
        # Verdicts of recent events, by id (error message or None): a resent
        # event is acked again without running its callback twice.
        self._verdicts = {}
        self._swapping = False
        self._swaps = 0
        self._lease = _LeaseKeeper(conn, self.handle, resp.lease_duration_ms, self.who)
        self._reader = threading.Thread(target=self._read_events,
                                        name="ferry-events " + self.who, daemon=True)
        self._reader.start()
        log.info("%s registered as %s", self.who, self.handle.participant_id)

    def _registration(self, stream, arenas, params, held_version, node=""):
        reg = registration_pb2.DestinationRegistration(
            instance_id=self.instance_id, stream=stream, tp_rank=self.tp_rank,
            tp_size=self.tp_size, node=node, pid=os.getpid(),
            held_version=held_version)
        reg.device.kind = types_pb2.DEVICE_KIND_HOST
        for a in arenas:
            reg.regions.append(a.describe())
        names = set()
        for p in params:
            if p.name in names:
                raise ValueError("%s: engine parameter %s listed twice" % (self.who, p.name))
            names.add(p.name)
            arena, off = _locate(p.tensor, arenas, "%s: %s" % (self.who, p.name))
            reg.engine_table.parameters.append(
                p.to_proto(arena.region_id, off, self.tp_size))
        return reg

    def swap(self, stream, arenas, params, held_version=0, timeout_s=120.0):
        """Lifecycle.SwapModel for this rank: switches it to a new
        registration (another model, layout or stream) together with the
        instance's other ranks, which must call too (docs/api.md, "Model
        swap"). Blocks until the instance switched: the client then follows
        the new registration (its events, its handle; the callbacks stay).
        Raises FerryError if it did not; the client stays on the old one."""
        new_arenas = _as_regions(arenas)
        reg = self._registration(stream, new_arenas, params, held_version)
        with self._cond:
            if self._swapping:
                raise FerryError("SwapModel(%s)" % self.who,
                                 grpc.StatusCode.FAILED_PRECONDITION,
                                 "a swap is in progress")
            self._swapping = True
            handle = self.handle
        try:
            resp = self.conn.call("SwapModel(%s)" % self.who,
                                  self.conn.lifecycle.SwapModel,
                                  lifecycle_pb2.SwapModelRequest(
                                      handle=handle, new_registration=reg),
                                  timeout_s=timeout_s)
        except FerryError:
            with self._cond:
                self._swapping = False
                self._cond.notify_all()
            raise
        old_lease = self._lease
        with self._cond:
            self.handle = resp.handle
            self.stream = stream
            self.arenas = new_arenas
            self._reg = reg
            self._lease = _LeaseKeeper(self.conn, self.handle,
                                       resp.lease_duration_ms, self.who)
            self._committed = held_version
            self._aborted = 0
            self._dirty = False
            self._swaps += 1
            self._swapping = False
            call = self._call
            self._cond.notify_all()
        old_lease.stop()
        if call is not None:
            call.cancel()  # the reader subscribes with the new handle
        log.info("%s swapped to stream %s as %s", self.who, stream,
                 self.handle.participant_id)

    @classmethod
    def from_module(cls, conn, instance_id, stream, tp_rank, tp_size, module,
                    describe, arenas, **kwargs):
        """Registers ``module``'s parameters as the engine table:
        ``describe(name, param)`` returns an EngineParam or None."""
        params = []
        for name, p in module.named_parameters():
            e = describe(name, p)
            if e is not None:
                params.append(e)
        return cls(conn, instance_id, stream, tp_rank, tp_size, arenas, params,
                   **kwargs)

    # -- state ------------------------------------------------------------
    @property
    def committed_version(self):
        """The latest version this rank saw COMMIT for (held_version before)."""
        with self._cond:
            return self._committed

    @property
    def dirty(self):
        """True after a dirty ABORT, until the next COMMIT."""
        with self._cond:
            return self._dirty

    def wait_committed(self, version, timeout_s=60.0):
        """Blocks until this rank saw COMMIT(v' >= version). Raises FerryError
        (ABORTED) once it saw ABORT(version) with no later commit,
        DEADLINE_EXCEEDED after ``timeout_s``, or the stream's error."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._committed >= version:
                    return self._committed
                if self._aborted >= version:
                    raise FerryError(self.who, grpc.StatusCode.ABORTED,
                                     "version %d aborted: %s" % (version, self._abort_reason))
                if self._stream_error is not None:
                    raise self._stream_error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FerryError(self.who, grpc.StatusCode.DEADLINE_EXCEEDED,
                                     "version %d not committed within %.0f s (holds %d)"
                                     % (version, timeout_s, self._committed))
                self._cond.wait(min(left, 0.5))

    def wait_for_version(self, version, timeout_s=60.0):
        """Versions.WaitForVersion for this instance: its InstanceStatus."""
        return self.conn.wait_for_version(self.stream, version, self.instance_id,
                                          timeout_s)[0]

    # -- events -----------------------------------------------------------
    def _read_events(self):
        backoff = 0.2
        while True:
            with self._cond:
                if self._stopping:
                    return
                call = self.conn.versions.Subscribe(
                    version_pb2.SubscribeRequest(handle=self.handle))
                self._call = call
                swaps = self._swaps
            got = False
            code, details = None, ""
            try:
                for event in call:
                    got = True
                    backoff = 0.2
                    self._handle(event)
                code, details = grpc.StatusCode.UNAVAILABLE, "the daemon ended the stream"
            except grpc.RpcError as e:
                code, details = e.code(), e.details()
            with self._cond:
                self._call = None
                # A swap ends the old registration's stream: follow the new
                # handle once SwapModel returned.
                self._cond.wait_for(lambda: not self._swapping or self._stopping)
                if self._stopping:
                    return
                swapped = self._swaps != swaps
            if swapped:
                self._verdicts = {}  # the new participant's ids
                backoff = 0.2
                continue
            err = FerryError("Subscribe(%s)" % self.who, code, details)
            if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED) \
                    and self._reregister_enabled and self._try_reregister(err):
                backoff = 0.2
                continue
            if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED,
                        grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.CANCELLED):
                log.error("%s (no more events for this rank)", err)
                with self._cond:
                    self._stream_error = err
                    self._cond.notify_all()
                return
            log.warning("%s; subscribing again in %.1f s", err, backoff)
            with self._cond:
                self._cond.wait_for(lambda: self._stopping, timeout=backoff)
                if self._stopping:
                    return
            if not got:
                backoff = min(backoff * 2, 5.0)

    def _try_reregister(self, why):
        """The daemon no longer knows this rank (it restarted, or the lease
        ran out): registers again with the same layout and memory, holding
        the latest version it committed or applied (a COMMIT can die with its
        daemon after the instance committed), never taking over a rank
        someone else registered meanwhile. True once registered; False (the
        stream's error is set) when the daemon refuses."""
        if any(a.released for a in self.arenas):
            return False  # offloaded: its memory is gone, nothing to register
        with self._cond:
            reg = registration_pb2.DestinationRegistration()
            reg.CopyFrom(self._reg)
            reg.held_version = max(self._committed, self._applied)
        log.warning("%s: %s; registering again holding version %d", self.who,
                    why, reg.held_version)
        try:
            resp = self.conn.call("RegisterDestination(%s)" % self.who,
                                  self.conn.registry.RegisterDestination,
                                  registration_pb2.RegisterDestinationRequest(
                                      destination=reg))
        except FerryError as e:
            log.error("%s: registering again failed: %s", self.who, e)
            return False
        old_lease = self._lease
        with self._cond:
            self.handle = resp.handle
            self._lease = _LeaseKeeper(self.conn, self.handle,
                                       resp.lease_duration_ms, self.who)
            self._committed = reg.held_version
            self._verdicts = {}  # the new participant's event ids
            self.reregistrations += 1
            self._cond.notify_all()
        old_lease.stop()
        return True

    def _handle(self, event):
        # A resent event (after resubscribing) is acked again with the same
        # verdict, without running the callback twice.
        if event.event_id and event.event_id in self._verdicts:
            if event.ack_timeout_ms > 0:
                self._ack(event, self._verdicts[event.event_id])
            return
        try:
            if event.adapter_name:
                self._dispatch_adapter(event)
            else:
                self._dispatch(event)
            error = None
        except Exception as e:  # the callback's failure is the ack's message
            error = "%s: %s" % (type(e).__name__, e)
            log.warning("%s: %s v%d failed: %s", self.who,
                        version_pb2.UpdateEventKind.Name(event.kind), event.version, error)
        self._verdicts[event.event_id] = error
        while len(self._verdicts) > 64:
            del self._verdicts[min(self._verdicts)]
        if event.ack_timeout_ms > 0:
            self._ack(event, error)

    def _dispatch(self, event):
        v = event.version
        k = event.kind
        cb = self._callbacks
        if k == version_pb2.UPDATE_EVENT_KIND_PREPARE:
            if cb["prepare"]:
                cb["prepare"](v)
        elif k == version_pb2.UPDATE_EVENT_KIND_PAUSE:
            if cb["pause"]:
                cb["pause"](v)
        elif k == version_pb2.UPDATE_EVENT_KIND_APPLY:
            tensors = self._map_apply(event.apply)
            if cb["apply"]:
                cb["apply"](v, tensors)
            with self._cond:
                self._applied = max(self._applied, v)
        elif k == version_pb2.UPDATE_EVENT_KIND_COMMIT:
            with self._cond:
                self._committed = max(self._committed, v)
                self._dirty = False
                self._cond.notify_all()
            if cb["commit"]:
                cb["commit"](v)
        elif k == version_pb2.UPDATE_EVENT_KIND_ABORT:
            with self._cond:
                self._aborted = max(self._aborted, v)
                self._abort_reason = event.abort.reason
                self._dirty = event.abort.dirty
                self._cond.notify_all()
            log.warning("%s: version %d aborted: %s (%s)", self.who, v,
                        event.abort.reason, "dirty" if event.abort.dirty else "clean")
            if cb["abort"]:
                cb["abort"](v, event.abort.reason, event.abort.dirty)
        elif k == version_pb2.UPDATE_EVENT_KIND_OFFLOAD:
            self._offload(event.offload)
        elif k == version_pb2.UPDATE_EVENT_KIND_ONLOAD:
            self._onload(event.onload)
        else:
            raise NotImplementedError("the Python client does not handle event %s" %
                                      version_pb2.UpdateEventKind.Name(k)
                                      if k in version_pb2.UpdateEventKind.values()
                                      else "kind %d" % k)

    def _dispatch_adapter(self, event):
        name = event.adapter_name
        v = event.version
        k = event.kind
        cb = self._callbacks
        if k == version_pb2.UPDATE_EVENT_KIND_PREPARE:
            return
        if k == version_pb2.UPDATE_EVENT_KIND_PAUSE:
            if cb["adapter_pause"]:
                cb["adapter_pause"](name, v)
        elif k == version_pb2.UPDATE_EVENT_KIND_APPLY:
            if not cb["adapter_apply"]:
                raise NotImplementedError(
                    "%s: adapter %s arrived, but this engine gave no "
                    "on_adapter_apply (it does not serve LoRA adapters)"
                    % (self.who, name))
            tensors = self._map_apply(event.apply, name)
            cb["adapter_apply"](name, v, event.apply.adapter_config_json,
                                tensors)
        elif k == version_pb2.UPDATE_EVENT_KIND_COMMIT:
            if cb["adapter_commit"]:
                cb["adapter_commit"](name, v)
        elif k == version_pb2.UPDATE_EVENT_KIND_ABORT:
            log.warning("%s: adapter %s version %d aborted: %s", self.who,
                        name, v, event.abort.reason)
            if cb["adapter_abort"]:
                cb["adapter_abort"](name, v, event.abort.reason,
                                    event.abort.dirty)
        elif k == version_pb2.UPDATE_EVENT_KIND_UNLOAD_ADAPTER:
            if not cb["adapter_unload"]:
                raise NotImplementedError(
                    "%s: UNLOAD_ADAPTER needs on_adapter_unload, which this "
                    "engine did not give" % self.who)
            cb["adapter_unload"](name)
            self._staging.pop(name, None)  # the daemon releases it now
        else:
            raise NotImplementedError(
                "%s: adapter event %s is not one an adapter receives"
                % (self.who, version_pb2.UpdateEventKind.Name(k)))

    def _arenas_of(self, region_ids):
        by_id = {a.region_id: a for a in self.arenas}
        missing = [i for i in region_ids if i not in by_id]
        if missing:
            raise ValueError("%s: regions %s are not this client's arenas"
                             % (self.who, missing))
        return [by_id[i] for i in region_ids]

    def _offload(self, detail):
        arenas = self._arenas_of(detail.region_ids)
        # The engine drops its tensors first; then nothing views the arenas.
        if self._callbacks["offload"]:
            self._callbacks["offload"](list(detail.region_ids),
                                       detail.host_copy_kept)
        self._staging = {}  # the daemon's staging: mapped again at APPLY
        import gc
        gc.collect()  # tensors in reference cycles still view the memory
        for a in arenas:
            a.release()
        with self._cond:
            self._dirty = True  # no weights until onloaded and refilled
            self._cond.notify_all()
        log.info("%s: offloaded (%d arenas released, host copy %s)", self.who,
                 len(arenas), "kept" if detail.host_copy_kept else "not kept")

    def _onload(self, detail):
        arenas = self._arenas_of(detail.region_ids)
        for a in arenas:
            if a.released:
                a.reallocate()
        req = registration_pb2.UpdateRegionsRequest(
            handle=self.handle, regions=[a.describe() for a in arenas])
        self.conn.call("UpdateRegions(%s)" % self.who,
                       self.conn.registry.UpdateRegions, req)
        with self._cond:  # a re-registration names the new memory
            by_id = {r.region_id: r for r in req.regions}
            for r in self._reg.regions:
                if r.region_id in by_id:
                    r.CopyFrom(by_id[r.region_id])
        if self._callbacks["onload"]:
            self._callbacks["onload"](list(detail.region_ids))
        log.info("%s: onloaded %d arenas; paused until refilled", self.who,
                 len(arenas))

    def _map_apply(self, apply, adapter=""):
        """The APPLY's tensors: (name, tensor) for the base model; (name,
        tensor, share) for an adapter. Each adapter keeps its own set of
        staging mappings, as the base model does."""
        import torch
        mapped = self._staging.setdefault(adapter, {})
        kept = {}
        for r in apply.staging_regions:
            if r.WhichOneof("memory") != "shared_memory":
                raise NotImplementedError("staging region %d is not host shared memory"
                                          % r.region_id)
            # Region ids are per registration: after a swap, a daemon restart
            # or a new registration the same id names another file.
            old = mapped.get(r.region_id)
            if (old is not None and old.size == r.size_bytes and
                    old.offset == r.shared_memory.file_offset_bytes and
                    old.path == _Staging.path_of(r)):
                kept[r.region_id] = old
                continue
            kept[r.region_id] = _Staging(r)
        self._staging[adapter] = kept  # released ones unmap when collected
        out = []
        for t in apply.fallback_tensors:
            m = kept.get(t.region_id)
            if m is None:
                raise ValueError("fallback tensor %s is in region %d, which the APPLY "
                                 "event does not list" % (t.parameter, t.region_id))
            if t.byte_offset < 0 or t.size_bytes < 0 or t.byte_offset + t.size_bytes > m.size:
                raise ValueError("fallback tensor %s bytes [%d, +%d) are outside staging "
                                 "region %d (%d bytes)" % (t.parameter, t.byte_offset,
                                                           t.size_bytes, t.region_id, m.size))
            dtype = dtypes.from_proto(t.dtype)
            share = None
            shape = tuple(t.shape)
            if t.HasField("share"):
                share = (tuple(t.share.offset), tuple(t.share.extent))
                shape = share[1]
                if (len(shape) != len(t.shape) or any(
                        o < 0 or e < 0 or o + e > d
                        for o, e, d in zip(share[0], shape, t.shape))):
                    raise ValueError("%s: share %s of %s lies outside its shape %s"
                                     % (self.who, share, t.parameter,
                                        tuple(t.shape)))
            count = 1
            for d in shape:
                count *= d
            if adapter and (count * torch.tensor([], dtype=dtype).element_size()
                            != t.size_bytes):
                raise ValueError("%s: tensor %s of shape %s is not %d bytes"
                                 % (self.who, t.parameter, shape, t.size_bytes))
            tensor = torch.frombuffer(m.map, dtype=dtype, count=count,
                                      offset=m.offset + t.byte_offset).view(shape)
            out.append((t.parameter, tensor, share) if adapter else
                       (t.parameter, tensor))
        return out

    def _ack(self, event, error):
        req = version_pb2.AckRequest(
            handle=self.handle, event_id=event.event_id, version=event.version,
            kind=event.kind,
            status=version_pb2.ACK_STATUS_FAILED if error else version_pb2.ACK_STATUS_OK,
            error_message=error or "")
        try:
            self.conn.versions.Ack(req, timeout=self.conn.rpc_timeout_s)
        except grpc.RpcError as e:
            log.warning("Ack(%s, %s v%d): %s: %s", self.who,
                        version_pb2.UpdateEventKind.Name(event.kind), event.version,
                        e.code().name, e.details())

    def close(self):
        """Ends the stream, stops heartbeats, deregisters."""
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            call = self._call
            self._cond.notify_all()
        if call is not None:
            call.cancel()
        self._reader.join(timeout=10)
        self._lease.stop()
        _deregister(self.conn, self.handle, self.who)
        self._staging = {}

"""DestinationClient: one TP rank of an inference engine instance
(client/destination_client.h).

An engine rank registers its live parameters as an engine parameter table
(a list of EngineParam whose tensors are CUDA tensors of one GPU, or live
in SharedTensorArenas) that ferry resolves into direct, fused or fallback
pieces, then follows its Subscribe stream on
a thread of its own: each event becomes a call of the engine's
EngineCallbacks (ferry/callbacks.py) and is acked with its outcome.

    with ferry.DestinationClient.register(conn, "vllm-0", "policy", rank, tp,
                                          arena, table, Engine()) as dst:
        dst.wait_committed(1, timeout_s=60)

The constructor validates and builds the registration without any RPC;
``open()`` registers, starts the lease and the event reader
(``register(...)`` is both, as is entering a ``with`` block); ``close()``,
or leaving the block, ends the stream and deregisters.

The client registers again by itself when the daemon no longer knows the
rank (it restarted, or the lease ran out), as the C++ client does: when
its event stream ends, holding the latest version it committed or applied
(``reregister=False`` turns it off), never taking over a rank someone else
registered meanwhile.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional,
                    Sequence)

import grpc

from ferry.callbacks import EngineCallbacks
from ferry.errors import FerryError
from ferry.layout import EngineParam
from ferry.lease import LeaseKeeper, deregister
from ferry.memory import Arenas, RankMemory
from ferry.staging import StagingMaps
from ferry.v1 import lifecycle_pb2, registration_pb2, types_pb2, version_pb2

if TYPE_CHECKING:
    import torch

    from ferry.connection import Connection

log = logging.getLogger("ferry")


class DestinationClient:
    """One TP rank of an engine instance. ``params`` is the engine parameter
    table (a list of EngineParam), every tensor a CUDA tensor of one GPU or
    inside one of ``arenas``;
    ``callbacks`` the engine's EngineCallbacks (None: the base class, an
    engine that takes every version and does nothing)."""

    def __init__(self, conn: "Connection", instance_id: str, stream: str,
                 tp_rank: int, tp_size: int, arenas: Arenas,
                 params: Iterable[EngineParam],
                 callbacks: Optional[EngineCallbacks] = None, *,
                 held_version: int = 0, replace_existing: bool = False,
                 node: str = "", reregister: bool = True,
                 staging: str = "auto") -> None:
        """Validates and builds the registration; no RPC (see ``open``).
        ``held_version``: what the live tensors hold now (0: the base
        weights); ``replace_existing``: take over the rank's registration (a
        restarted engine rank); ``staging``: where ferryd assembles the
        fallback tensors handed to ``on_apply``: "auto" (on the rank's GPU
        when its tensors are CUDA tensors, else host memory), "device" (a
        GPU rank only) or "host" (host memory, also for a GPU rank: ferryd
        pins it). ValueError for a tensor outside the arenas, a parameter
        listed twice, or a staging the rank cannot have; TypeError for
        callbacks that are not an EngineCallbacks."""
        if not instance_id or not stream:
            raise ValueError("DestinationClient: instance id %r and stream %r "
                             "must not be empty" % (instance_id, stream))
        if not 0 <= tp_rank < tp_size:
            raise ValueError("DestinationClient %s: tp_rank %d is outside [0, %d)"
                             % (instance_id, tp_rank, tp_size))
        if callbacks is None:
            callbacks = EngineCallbacks()
        if not isinstance(callbacks, EngineCallbacks):
            raise TypeError("DestinationClient: callbacks must be an "
                            "ferry.EngineCallbacks (a subclass overriding its "
                            "on_* methods), not %s" % type(callbacks).__name__)
        self.conn = conn
        self.instance_id = instance_id
        self.stream = stream
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.who = "instance %s tp rank %d" % (instance_id, tp_rank)
        self.callbacks = callbacks
        self.replace_existing = replace_existing
        if staging not in ("auto", "device", "host"):
            raise ValueError("%s: staging %r is not auto, device or host"
                             % (self.who, staging))
        self._staging_choice = staging
        self.memory = RankMemory(arenas, self.who)
        self.arenas = self.memory.arenas
        # Protos only (no tensor: an offload must be able to drop them all):
        # what registration and a re-registration send.
        self._reg = self._registration(stream, self.memory, params, held_version, node)
        self._reregister_enabled = reregister
        self.reregistrations = 0
        self.handle: Optional[types_pb2.ParticipantHandle] = None
        self._cond = threading.Condition()
        self._applied = held_version  # the latest version acked APPLY OK
        self._committed = held_version
        self._aborted = 0
        self._abort_reason = ""
        self._dirty = False
        self._stream_error: Optional[FerryError] = None
        self._opened = False
        self._stopping = False
        self._call: Any = None
        self._staging = StagingMaps(self.who)
        # Verdicts of recent events, by id (error message or None): a resent
        # event is acked again without running its callback twice.
        self._verdicts: Dict[int, Optional[str]] = {}
        self._swapping = False
        self._swaps = 0
        self._lease: Optional[LeaseKeeper] = None
        self._reader: Optional[threading.Thread] = None

    @classmethod
    def register(cls, conn: "Connection", instance_id: str, stream: str,
                 tp_rank: int, tp_size: int, arenas: Arenas,
                 params: Iterable[EngineParam],
                 callbacks: Optional[EngineCallbacks] = None,
                 **options: Any) -> "DestinationClient":
        """The constructor, then ``open()``: a registered rank following its
        events."""
        return cls(conn, instance_id, stream, tp_rank, tp_size, arenas, params,
                   callbacks, **options).open()

    @classmethod
    def from_module(cls, conn: "Connection", instance_id: str, stream: str,
                    tp_rank: int, tp_size: int, module: "torch.nn.Module",
                    describe: Callable[[str, "torch.nn.Parameter"],
                                       Optional[EngineParam]],
                    arenas: Arenas, callbacks: Optional[EngineCallbacks] = None,
                    **options: Any) -> "DestinationClient":
        """Registers ``module``'s parameters as the engine table (like
        ``register``): ``describe(name, param)`` returns an EngineParam or
        None to leave the parameter out."""
        params = []
        for name, p in module.named_parameters():
            e = describe(name, p)
            if e is not None:
                params.append(e)
        return cls.register(conn, instance_id, stream, tp_rank, tp_size, arenas,
                            params, callbacks, **options)

    def _registration(self, stream: str, memory: RankMemory,
                      params: Iterable[EngineParam], held_version: int,
                      node: str = "") -> registration_pb2.DestinationRegistration:
        reg = registration_pb2.DestinationRegistration(
            instance_id=self.instance_id, stream=stream, tp_rank=self.tp_rank,
            tp_size=self.tp_size, node=node, pid=os.getpid(),
            held_version=held_version)
        names = set()
        for p in params:
            if p.name in names:
                raise ValueError("%s: engine parameter %s listed twice" % (self.who, p.name))
            names.add(p.name)
            region_id, off = memory.locate(p.tensor, "%s: %s" % (self.who, p.name))
            reg.engine_table.parameters.append(
                p.to_proto(region_id, off, self.tp_size))
        memory.describe(reg)
        if self._staging_choice == "device" and not memory.on_gpu:
            raise ValueError("%s: staging 'device' needs the rank's tensors on "
                             "a GPU; its tensors are in host memory" % self.who)
        reg.staging = (registration_pb2.STAGING_PLACEMENT_DEVICE
                       if memory.on_gpu and self._staging_choice != "host"
                       else registration_pb2.STAGING_PLACEMENT_HOST)
        return reg

    def live_tensor(self, name: str) -> "torch.Tensor":
        """Engine parameter ``name`` as a tensor at its registered place:
        for an engine rebuilding its tensors after an onload (its arenas,
        or the GPU memory this client allocated anew, hold the same
        offsets)."""
        from ferry import dtypes
        with self._cond:
            params = list(self._reg.engine_table.parameters)
        for p in params:
            if p.name == name:
                return self.memory.view(p.region_id, p.byte_offset,
                                        tuple(p.local_shape),
                                        dtypes.from_proto(p.dtype))
        raise KeyError("%s: no engine parameter %s" % (self.who, name))

    # -- registration -----------------------------------------------------
    def open(self) -> "DestinationClient":
        """Registry.RegisterDestination; starts the lease and the thread that
        follows the events. Returns self."""
        with self._cond:
            if self._stopping:
                raise FerryError("RegisterDestination(%s)" % self.who,
                                 grpc.StatusCode.FAILED_PRECONDITION,
                                 "the client was closed")
            if self._opened:
                return self
            reg = self._reg
        resp = self.conn.call("RegisterDestination(%s)" % self.who,
                              self.conn.registry.RegisterDestination,
                              registration_pb2.RegisterDestinationRequest(
                                  destination=reg,
                                  replace_existing=self.replace_existing))
        with self._cond:
            self.handle = resp.handle
            self._lease = LeaseKeeper(self.conn, self.handle, resp.lease_duration_ms,
                                      self.who)
            self._reader = threading.Thread(target=self._read_events,
                                            name="ferry-events " + self.who,
                                            daemon=True)
            self._opened = True
            self._reader.start()  # it waits for the lock, then subscribes
        log.info("%s registered as %s", self.who, self.handle.participant_id)
        return self

    @property
    def registered(self) -> bool:
        with self._cond:
            return self._opened and not self._stopping

    @property
    def registration(self) -> registration_pb2.DestinationRegistration:
        """What the client registers (and registers again after a daemon
        restart)."""
        with self._cond:
            return self._reg

    def swap(self, stream: str, arenas: Arenas, params: Iterable[EngineParam],
             held_version: int = 0, timeout_s: float = 120.0) -> None:
        """Lifecycle.SwapModel for this rank: switches it to a new
        registration (another model, layout or stream) together with the
        instance's other ranks, which must call too (docs/api.md, "Model
        swap"). Blocks until the instance switched: the client then follows
        the new registration (its events, its handle; the callbacks stay).
        Raises FerryError if it did not; the client stays on the old one."""
        new_memory = RankMemory(arenas, self.who)
        reg = self._registration(stream, new_memory, params, held_version)
        with self._cond:
            if not self._opened or self._stopping:
                raise FerryError("SwapModel(%s)" % self.who,
                                 grpc.StatusCode.FAILED_PRECONDITION,
                                 "not registered")
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
            self.memory = new_memory
            self.arenas = new_memory.arenas
            self._reg = reg
            self._lease = LeaseKeeper(self.conn, self.handle,
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

    # -- state ------------------------------------------------------------
    @property
    def committed_version(self) -> int:
        """The latest version this rank saw COMMIT for (held_version before)."""
        with self._cond:
            return self._committed

    @property
    def dirty(self) -> bool:
        """True after a dirty ABORT, until the next COMMIT."""
        with self._cond:
            return self._dirty

    def wait_committed(self, version: int, timeout_s: float = 60.0) -> int:
        """Blocks until this rank saw COMMIT(v' >= version); returns v'.
        Raises FerryError (ABORTED) once it saw ABORT(version) with no later
        commit, DEADLINE_EXCEEDED after ``timeout_s``, or the stream's
        error."""
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

    def wait_for_version(self, version: int,
                         timeout_s: float = 60.0) -> types_pb2.InstanceStatus:
        """Versions.WaitForVersion for this instance: its InstanceStatus."""
        return self.conn.wait_for_version(self.stream, version, self.instance_id,
                                          timeout_s)[0]

    # -- events -----------------------------------------------------------
    def _read_events(self) -> None:
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

    def _try_reregister(self, why: FerryError) -> bool:
        """The daemon no longer knows this rank (it restarted, or the lease
        ran out): registers again with the same layout and memory, holding
        the latest version it committed or applied (a COMMIT can die with its
        daemon after the instance committed), never taking over a rank
        someone else registered meanwhile. True once registered; False (the
        stream's error is set) when the daemon refuses."""
        if any(r.released for r in self.memory.regions):
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
            self._lease = LeaseKeeper(self.conn, self.handle,
                                      resp.lease_duration_ms, self.who)
            self._committed = reg.held_version
            self._verdicts = {}  # the new participant's event ids
            self.reregistrations += 1
            self._cond.notify_all()
        old_lease.stop()
        return True

    def _handle(self, event: version_pb2.UpdateEvent) -> None:
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

    def _dispatch(self, event: version_pb2.UpdateEvent) -> None:
        v = event.version
        k = event.kind
        cb = self.callbacks
        if k == version_pb2.UPDATE_EVENT_KIND_PREPARE:
            cb.on_prepare(v)
        elif k == version_pb2.UPDATE_EVENT_KIND_PAUSE:
            cb.on_pause(v)
            # A forward pass the engine launched may still be reading the
            # weights on the GPU: done before ferryd writes them.
            self.memory.synchronize()
        elif k == version_pb2.UPDATE_EVENT_KIND_APPLY:
            cb.on_apply(v, self._staging.map_apply(event.apply))
            # The loader's copies out of staging are done before the ack
            # lets ferryd reuse it.
            self.memory.synchronize()
            with self._cond:
                self._applied = max(self._applied, v)
        elif k == version_pb2.UPDATE_EVENT_KIND_COMMIT:
            with self._cond:
                self._committed = max(self._committed, v)
                self._dirty = False
                self._cond.notify_all()
            cb.on_commit(v)
        elif k == version_pb2.UPDATE_EVENT_KIND_ABORT:
            with self._cond:
                self._aborted = max(self._aborted, v)
                self._abort_reason = event.abort.reason
                self._dirty = event.abort.dirty
                self._cond.notify_all()
            log.warning("%s: version %d aborted: %s (%s)", self.who, v,
                        event.abort.reason, "dirty" if event.abort.dirty else "clean")
            cb.on_abort(v, event.abort.reason, event.abort.dirty)
        elif k == version_pb2.UPDATE_EVENT_KIND_OFFLOAD:
            self._offload(event.offload)
        elif k == version_pb2.UPDATE_EVENT_KIND_ONLOAD:
            self._onload(event.onload)
        else:
            raise NotImplementedError("the Python client does not handle event %s" %
                                      version_pb2.UpdateEventKind.Name(k)
                                      if k in version_pb2.UpdateEventKind.values()
                                      else "kind %d" % k)

    def _dispatch_adapter(self, event: version_pb2.UpdateEvent) -> None:
        name = event.adapter_name
        v = event.version
        k = event.kind
        cb = self.callbacks
        if k == version_pb2.UPDATE_EVENT_KIND_PREPARE:
            return
        if k == version_pb2.UPDATE_EVENT_KIND_PAUSE:
            cb.on_adapter_pause(name, v)
        elif k == version_pb2.UPDATE_EVENT_KIND_APPLY:
            shares = self._staging.map_apply(event.apply, name)
            try:
                cb.on_adapter_apply(name, v, event.apply.adapter_config_json, shares)
            except BaseException:
                # Mapped again at the next APPLY; an engine that does not
                # serve adapters keeps nothing mapped.
                del shares
                self._staging.drop(name)
                raise
            self.memory.synchronize()
        elif k == version_pb2.UPDATE_EVENT_KIND_COMMIT:
            cb.on_adapter_commit(name, v)
        elif k == version_pb2.UPDATE_EVENT_KIND_ABORT:
            log.warning("%s: adapter %s version %d aborted: %s", self.who,
                        name, v, event.abort.reason)
            cb.on_adapter_abort(name, v, event.abort.reason, event.abort.dirty)
        elif k == version_pb2.UPDATE_EVENT_KIND_UNLOAD_ADAPTER:
            cb.on_adapter_unload(name)
            self._staging.drop(name)  # the daemon releases it now
        else:
            raise NotImplementedError(
                "%s: adapter event %s is not one an adapter receives"
                % (self.who, version_pb2.UpdateEventKind.Name(k)))

    def _offload(self, detail: version_pb2.OffloadDetail) -> None:
        regions = self.memory.of(detail.region_ids)
        # The engine drops its tensors first; then nothing views the memory.
        self.callbacks.on_offload(list(detail.region_ids), detail.host_copy_kept)
        self._staging.clear()  # the daemon's staging: mapped again at APPLY
        gc.collect()  # tensors in reference cycles still view the memory
        for r in regions:
            r.release()
        with self._cond:
            self._dirty = True  # no weights until onloaded and refilled
            self._cond.notify_all()
        log.info("%s: offloaded (%d regions released, host copy %s)", self.who,
                 len(regions), "kept" if detail.host_copy_kept else "not kept")

    def _onload(self, detail: version_pb2.OnloadDetail) -> None:
        regions = self.memory.of(detail.region_ids)
        for r in regions:
            if r.released:
                r.reallocate()
        req = registration_pb2.UpdateRegionsRequest(
            handle=self.handle, regions=[r.describe() for r in regions])
        self.conn.call("UpdateRegions(%s)" % self.who,
                       self.conn.registry.UpdateRegions, req)
        with self._cond:  # a re-registration names the new memory
            by_id = {r.region_id: r for r in req.regions}
            for r in self._reg.regions:
                if r.region_id in by_id:
                    r.CopyFrom(by_id[r.region_id])
        self.callbacks.on_onload(list(detail.region_ids))
        log.info("%s: onloaded %d regions; paused until refilled", self.who,
                 len(regions))

    def _ack(self, event: version_pb2.UpdateEvent, error: Optional[str]) -> None:
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

    # -- lifetime ---------------------------------------------------------
    def close(self) -> None:
        """Ends the stream, stops heartbeats, deregisters (once; a no-op
        afterwards)."""
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            opened = self._opened
            call = self._call
            self._cond.notify_all()
        if not opened:
            return
        if call is not None:
            call.cancel()
        self._reader.join(timeout=10)
        self._lease.stop()
        deregister(self.conn, self.handle, self.who)
        self._staging.clear()

    def __enter__(self) -> "DestinationClient":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

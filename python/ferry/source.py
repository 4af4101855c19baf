"""SourceClient: one trainer rank of a stream (client/source_client.h).

A trainer rank registers pieces of its tensors, which are CUDA tensors (a
model on ``cuda:N`` as it is: each allocation is registered once, ferry.cuda)
or live in SharedTensorArenas (host memory), and calls ``publish(v)`` once
its memory holds version v (``begin(v)`` while it finishes the step, then
``commit(v)``).

    src = ferry.SourceClient.register(conn, "policy", rank, world, None,
                                      [(tensor, ferry.Shard(...)), ...])
    with src:
        for v in range(1, steps + 1):
            train_step()
            print(src.publish(v).summary())

The constructor validates and builds the registration without any RPC;
``open()`` registers it and starts the lease (``register(...)`` is both, as
is entering a ``with`` block); ``close()``, or leaving the block,
deregisters. A rank the daemon no longer knows (it restarted, or the lease
ran out) registers again by itself, as the C++ client does, never taking
over a rank someone else registered meanwhile: at once, on a thread of its
own, when a heartbeat finds the lease lost (retrying while the daemon is
unavailable), so every trainer rank is back before the next version; and
at its next ``begin()`` if it is still gone then.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional,
                    Sequence, Tuple, Union)

import grpc

from ferry import dtypes
from ferry.errors import FerryError
from ferry.layout import FlatShard, Shard, pieces_for_tensor
from ferry.lease import LeaseKeeper, deregister
from ferry.memory import Arenas, RankMemory
from ferry.v1 import registration_pb2, types_pb2, version_pb2

if TYPE_CHECKING:
    import torch

    from ferry.connection import Connection

log = logging.getLogger("ferry")

SourceParams = Iterable[Tuple["torch.Tensor", Union[Shard, FlatShard, Sequence[Shard]]]]


def instance_label(status: types_pb2.InstanceStatus) -> str:
    """What a status is about: the instance, or for a LoRA adapter attached
    to one "<instance> adapter <name>" (its instance_id is internal)."""
    if status.adapter_name:
        return "%s adapter %s" % (status.base_instance_id, status.adapter_name)
    return status.instance_id


class PublishOutcome:
    """One version's outcome: an InstanceStatus per instance. For an adapter
    stream, one per attachment: ``status.base_instance_id`` names the engine
    instance and ``status.adapter_name`` the adapter."""

    def __init__(self, version: int,
                 instances: Iterable[types_pb2.InstanceStatus]) -> None:
        self.version = version
        self.instances = list(instances)

    def all_committed(self) -> bool:
        return all(s.state == types_pb2.INSTANCE_STATE_COMMITTED
                   for s in self.instances)

    def by_instance(self) -> Dict[str, types_pb2.InstanceStatus]:
        """By engine instance id (an adapter stream's attachments by the
        instance they are attached to)."""
        return {(s.base_instance_id or s.instance_id): s for s in self.instances}

    def committed_on(self, instance_id: str, adapter: str = "") -> bool:
        """Whether the version landed on ``instance_id`` (with ``adapter``:
        whether that adapter's version landed on it)."""
        for s in self.instances:
            base = s.base_instance_id or s.instance_id
            if base == instance_id and s.adapter_name == adapter:
                return s.state == types_pb2.INSTANCE_STATE_COMMITTED
        return False

    def summary(self) -> str:
        done = [s for s in self.instances if s.state == types_pb2.INSTANCE_STATE_COMMITTED]
        bad = [s for s in self.instances if s.state != types_pb2.INSTANCE_STATE_COMMITTED]
        text = "%d committed, %d aborted" % (len(done), len(bad))
        if bad:
            text += " (" + "; ".join("%s: %s%s" % (instance_label(s), s.abort_reason,
                                                   " [dirty]" if s.dirty else "")
                                     for s in bad) + ")"
        return text


class SourceClient:
    """One trainer rank of a stream. ``params`` is a list of (tensor, shard
    or list of shards: the parts of a fused tensor); every tensor is a CUDA
    tensor (of one GPU) or lives in one of ``arenas`` (None: no arena).
    ``extra_parameters`` declares more ParameterSpecs
    (PP, EP: declared, not held here)."""

    def __init__(self, conn: "Connection", stream: str, rank: int, world_size: int,
                 arenas: Arenas, params: SourceParams, *,
                 replace_existing: bool = False, node: str = "",
                 extra_parameters: Iterable[types_pb2.ParameterSpec] = (),
                 commit_timeout_s: float = 600.0) -> None:
        """Validates and builds the registration; no RPC (see ``open``).
        ValueError for a tensor outside the arenas, a parameter declared
        twice differently, or a shard that does not fit its tensor."""
        if not stream:
            raise ValueError("SourceClient: the stream name is empty")
        if not 0 <= rank < world_size:
            raise ValueError("SourceClient %s: rank %d is outside [0, %d)"
                             % (stream, rank, world_size))
        self.conn = conn
        self.stream = stream
        self.rank = rank
        self.world_size = world_size
        self.who = "source %s rank %d" % (stream, rank)
        self.commit_timeout_s = commit_timeout_s
        self.replace_existing = replace_existing
        self.memory = RankMemory(arenas, self.who)
        self.arenas = self.memory.arenas
        reg = registration_pb2.SourceRegistration(
            stream=stream, rank=rank, world_size=world_size, node=node, pid=os.getpid())
        declared: Dict[str, Tuple[Tuple[int, ...], Any]] = {}
        for tensor, shards in params:
            shard_list = list(shards) if isinstance(shards, (list, tuple)) else [shards]
            for s in shard_list:
                spec = (s.shape, tensor.dtype)
                if declared.setdefault(s.name, spec) != spec:
                    raise ValueError("%s: parameter %s declared twice differently"
                                     % (self.who, s.name))
            region_id, off = self.memory.locate(tensor, "%s: %s" % (
                self.who, shard_list[0].name))
            reg.pieces.extend(pieces_for_tensor(tensor, shard_list, region_id, off))
        self.memory.describe(reg)
        for name, (shape, dtype) in declared.items():
            reg.parameters.add(name=name, dtype=dtypes.to_proto(dtype), shape=shape)
        for spec in extra_parameters:
            if spec.name not in declared:
                reg.parameters.append(spec)
        # Protos only: what registration (and a re-registration) sends.
        self.registration = reg
        self.handle: Optional[types_pb2.ParticipantHandle] = None
        self.reregistrations = 0
        self._lease: Optional[LeaseKeeper] = None
        self._closed = False
        # One re-registration at a time (the lost lease's thread, begin()).
        self._rereg_lock = threading.Lock()

    @classmethod
    def register(cls, conn: "Connection", stream: str, rank: int, world_size: int,
                 arenas: Arenas, params: SourceParams, **options: Any) -> "SourceClient":
        """The constructor, then ``open()``: a registered rank."""
        return cls(conn, stream, rank, world_size, arenas, params, **options).open()

    @classmethod
    def from_module(cls, conn: "Connection", stream: str, rank: int, world_size: int,
                    module: "torch.nn.Module",
                    sharding: Callable[[str, "torch.nn.Parameter"],
                                       Union[Shard, Sequence[Shard], None]],
                    arenas: Arenas, **options: Any) -> "SourceClient":
        """Registers ``module``'s parameters (like ``register``):
        ``sharding(name, param)`` returns the Shard (or list of Shards, for
        a fused tensor) the parameter holds, or None to leave it out. The
        parameters are CUDA tensors, or live in ``arenas``
        (ferry.move_to_arena)."""
        params = []
        for name, p in module.named_parameters():
            s = sharding(name, p)
            if s is not None:
                params.append((p.data, s))
        return cls.register(conn, stream, rank, world_size, arenas, params, **options)

    # -- registration -----------------------------------------------------
    @property
    def registered(self) -> bool:
        return self._lease is not None

    def open(self) -> "SourceClient":
        """Registry.RegisterSource; starts the lease. Returns self."""
        if self._closed:
            raise FerryError("RegisterSource(%s)" % self.who,
                             grpc.StatusCode.FAILED_PRECONDITION,
                             "the client was closed")
        if self._lease is not None:
            return self
        resp = self.conn.call("RegisterSource(%s)" % self.who,
                              self.conn.registry.RegisterSource,
                              registration_pb2.RegisterSourceRequest(
                                  source=self.registration,
                                  replace_existing=self.replace_existing))
        self.handle = resp.handle
        self._lease = self._new_lease(resp.lease_duration_ms)
        log.info("%s registered as %s (%d pieces)", self.who,
                 self.handle.participant_id, len(self.registration.pieces))
        return self

    def _require_open(self, what: str) -> None:
        if self._lease is None:
            raise FerryError("%s(%s)" % (what, self.who),
                             grpc.StatusCode.FAILED_PRECONDITION,
                             "closed" if self._closed else
                             "not registered: call open(), or make it with "
                             "SourceClient.register")

    def _new_lease(self, lease_ms: int) -> LeaseKeeper:
        return LeaseKeeper(self.conn, self.handle, lease_ms, self.who,
                           on_lost=self._lease_lost)

    def _lease_lost(self) -> None:
        """From the lease's thread: registers again on a thread of its own,
        retrying while the daemon is unavailable."""
        lost = self.handle

        def rejoin() -> None:
            backoff = 0.2
            while not self._closed:
                try:
                    self._reregister("the lease was lost", lost)
                    return
                except FerryError as e:
                    if e.code not in (grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.DEADLINE_EXCEEDED):
                        # The next begin() tries again and raises it.
                        log.error("%s: registering again: %s", self.who, e)
                        return
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

        threading.Thread(target=rejoin, name="ferry-rejoin " + self.who,
                         daemon=True).start()

    def _reregister(self, why: str,
                    lost: Optional[types_pb2.ParticipantHandle] = None) -> None:
        """The daemon no longer knows this rank (it restarted, or the lease
        ran out): registers again with the same layout and memory, never
        taking over a rank someone else registered meanwhile. A no-op when
        the registration ``lost`` was already replaced, or the client
        closed."""
        with self._rereg_lock:
            if self._closed or self._lease is None:
                return
            if lost is not None and self.handle != lost:
                return  # registered again meanwhile
            log.warning("%s: %s; registering again", self.who, why)
            resp = self.conn.call("RegisterSource(%s)" % self.who,
                                  self.conn.registry.RegisterSource,
                                  registration_pb2.RegisterSourceRequest(
                                      source=self.registration))
            old = self._lease
            self.handle = resp.handle
            self._lease = self._new_lease(resp.lease_duration_ms)
            self.reregistrations += 1
        old.stop()

    # -- the version protocol ---------------------------------------------
    def begin(self, version: int) -> List[str]:
        """BeginVersion: engines prepare while the trainer finishes the step;
        returns the instances taking part. A rank the daemon no longer knows
        (restarted, lease ran out) registers again first, as the C++ client
        does."""
        self._require_open("BeginVersion")

        def call() -> version_pb2.BeginVersionResponse:
            return self.conn.call("BeginVersion(%s, %d)" % (self.who, version),
                                  self.conn.versions.BeginVersion,
                                  version_pb2.BeginVersionRequest(handle=self.handle,
                                                                  version=version))
        used = self.handle
        try:
            resp = call()
        except FerryError as e:
            # BeginVersion's NOT_FOUND and PERMISSION_DENIED are about the
            # handle (version.proto).
            if e.code not in (grpc.StatusCode.NOT_FOUND,
                              grpc.StatusCode.PERMISSION_DENIED):
                raise
            self._reregister(e.details, used)
            resp = call()
        return list(resp.instance_ids)

    def commit(self, version: int) -> PublishOutcome:
        """CommitVersion: blocks until every instance settled. Do not write the
        registered memory until it returns. The rank's GPU work is waited
        for first (its step's kernels may still be writing the weights)."""
        self._require_open("CommitVersion")
        self.memory.synchronize()
        resp = self.conn.call("CommitVersion(%s, %d)" % (self.who, version),
                              self.conn.versions.CommitVersion,
                              version_pb2.CommitVersionRequest(handle=self.handle,
                                                               version=version),
                              timeout_s=self.commit_timeout_s)
        return PublishOutcome(version, resp.instances)

    def abort(self, version: int, reason: str) -> None:
        """AbortVersion: the version begun is not coming."""
        self._require_open("AbortVersion")
        self.conn.call("AbortVersion(%s, %d)" % (self.who, version),
                       self.conn.versions.AbortVersion,
                       version_pb2.AbortVersionRequest(handle=self.handle,
                                                       version=version, reason=reason))

    def publish(self, version: int) -> PublishOutcome:
        """begin + commit; returns the PublishOutcome (per-instance results)."""
        self.begin(version)
        return self.commit(version)

    # -- lifetime ---------------------------------------------------------
    def close(self) -> None:
        """Stops the lease and deregisters (once; a no-op afterwards)."""
        with self._rereg_lock:  # no re-registration after this
            self._closed = True
            lease, self._lease = self._lease, None
        if lease is None:
            return
        lease.stop()
        deregister(self.conn, self.handle, self.who)

    def __enter__(self) -> "SourceClient":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

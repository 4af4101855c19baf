"""ferry as a vLLM weight-transfer backend, named "ferry".

vLLM selects a weight-transfer backend by name
(``--weight-transfer-config '{"backend": "ferry"}'``) from
``WeightTransferEngineFactory`` (engine side) and
``WeightTransferTrainerFactory`` (trainer side). The ferry wheel registers
both in every vLLM process through its ``vllm.general_plugins`` entry point
(``ferry = "ferry.vllm:register"``, python/pyproject.toml), so a framework
on vLLM's native weight-sync API (TRL, open-instruct, ...) switches to ferry
by the backend name alone.

Written against vLLM's ``vllm/distributed/weight_transfer/base.py`` as of
late 2026 (the engine built as ``Engine(config, vllm_config, device,
model)`` with ``init_transfer_engine`` / ``start_weight_update`` /
``update_weights`` -> ``receive_weights`` / ``finish_weight_update`` /
``shutdown``; the trainer engine built by ``trainer_init(init_info, *,
client, source)`` with ``send_weights()``); ``register()`` checks that the
installed vLLM has those and refuses, naming what is missing, otherwise.
Every vLLM import of ferry is in this module. It has not run against a live
vLLM: vLLM cannot be installed where ferry is built and tested; what is
not the vLLM import itself (``WorkerCore``, ``TrainerCore``) is tested with
the PyTorch example's model (python/tests/vllm_core_test.py), and
python/tests/vllm_backend_test.py runs the real classes where ``import
vllm`` works and skips, saying so, where it does not.

How vLLM's phases map onto ferry's version protocol (docs/engines.md):

- ``init_transfer_engine({"instance_id": ..., "socket": ..., "stream": ...})``
  on every worker: connect to the node's ferryd and register the rank's
  live parameters through ``ferry.engine.EngineAdapter`` (vLLM's table for
  the model's config, bound by name; fallback tensors through the model's
  ``load_weights``);
- the controller pauses generation (vLLM's ``/pause``) and calls
  ``start_weight_update``: the worker opens its update window; ferry's PAUSE
  of the next version waits for that window, so ferry never writes weights
  a forward pass may read;
- ``update_weights({"version": v})``: the worker waits until this rank
  committed version v (APPLY's fallback tensors loaded, COMMIT);
- ``finish_weight_update``: the window closes; the controller resumes.

On the trainer side, ``send_weights()`` publishes the next version from the
rank's ``WeightSource`` (rank 0 publishes; other ranks only run the
source's collectives) while the client drives the workers through the same
four calls.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import (TYPE_CHECKING, Any, Callable, ClassVar, Dict, Iterable, List,
                    Optional, Tuple)

if TYPE_CHECKING:
    from ferry.source import PublishOutcome

log = logging.getLogger("ferry")

BACKEND = "ferry"
# What register() needs from the installed vLLM (see the module doc).
_ENGINE_METHODS = ("init_transfer_engine", "start_weight_update",
                   "finish_weight_update", "receive_weights", "shutdown")
_TRAINER_METHODS = ("trainer_init", "send_weights")


# ---------------------------------------------------------------------------
# The parts without vLLM: tested everywhere.

@dataclasses.dataclass
class FerryInitFields:
    """``init_info`` of the ferry backend (one dict, the same on every
    worker of an instance)."""

    instance_id: str                 # the engine instance, e.g. "vllm-0"
    socket: str = ""                 # the node's ferryd; "" = $FERRY_SOCKET ...
    stream: str = "policy"           # the stream the instance follows
    fallback: Tuple[str, ...] = ()   # parameters forced through load_weights
    update_timeout_s: float = 600.0  # how long update_weights waits for v
    pause_timeout_s: float = 600.0   # how long PAUSE waits for the window


@dataclasses.dataclass
class FerryUpdateFields:
    """``update_info`` of the ferry backend: the version to reach."""

    version: int


class WorkerCore:
    """One vLLM worker as a ferry engine rank, without vLLM: the backend's
    engine class holds one and forwards vLLM's calls to it."""

    def __init__(self, model: Any, hf_config: Dict[str, Any], tp_rank: int,
                 tp_size: int, load_weights: Optional[Callable] = None) -> None:
        self.model, self.hf_config = model, hf_config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.load_weights = load_weights
        self.adapter: Any = None
        self.fields: Optional[FerryInitFields] = None
        self._cond = threading.Condition()
        self._window = False

    def init(self, fields: FerryInitFields, **adapter_options: Any) -> None:
        import ferry
        from ferry.engine import EngineAdapter
        if self.adapter is not None:
            raise RuntimeError("ferry backend: init_transfer_engine called twice "
                               "on tp rank %d" % self.tp_rank)
        self.fields = fields
        conn = ferry.connect(fields.socket or None)
        self.adapter = EngineAdapter(
            conn, fields.instance_id, self.tp_rank, self.tp_size, self.model,
            self.hf_config, stream=fields.stream, load_weights=self.load_weights,
            fallback=fields.fallback, pause_hook=self._wait_for_window,
            pause_timeout_s=fields.pause_timeout_s, **adapter_options).open()
        log.info("ferry backend: %s tp rank %d registered on stream %s",
                 fields.instance_id, self.tp_rank, fields.stream)

    def _wait_for_window(self, version: int) -> None:
        """ferry's PAUSE of ``version``: returns once the controller paused
        generation and opened the update window (start_weight_update)."""
        timeout = self.fields.pause_timeout_s if self.fields else 600.0
        with self._cond:
            if not self._cond.wait_for(lambda: self._window, timeout):
                raise TimeoutError(
                    "ferry backend: version %d arrived, but start_weight_update "
                    "was not called within %.0f s (pause generation, then "
                    "start_weight_update, before the trainer publishes)"
                    % (version, timeout))

    def start_weight_update(self) -> None:
        self._require_init("start_weight_update")
        with self._cond:
            self._window = True
            self._cond.notify_all()

    def update_weights(self, info: FerryUpdateFields) -> int:
        """Waits until this rank committed ``info.version``; returns the
        version it holds."""
        self._require_init("update_weights")
        with self._cond:
            if not self._window:
                raise RuntimeError("ferry backend: update_weights outside "
                                   "start_weight_update / finish_weight_update")
        return self.adapter.wait_committed(int(info.version),
                                           self.fields.update_timeout_s)

    def finish_weight_update(self) -> None:
        with self._cond:
            self._window = False

    def shutdown(self) -> None:
        if self.adapter is not None:
            self.adapter.close()
            self.adapter = None

    close = shutdown

    def _require_init(self, what: str) -> None:
        if self.adapter is None:
            raise RuntimeError("ferry backend: %s before init_transfer_engine"
                               % what)


class TrainerCore:
    """The trainer side without vLLM: a ferry source fed by a WeightSource
    (anything iterable as (name, tensor) pairs), publishing one version per
    ``send_weights`` while ``client`` (vLLM's four weight-sync calls) drives
    the workers. Rank 0 publishes; other ranks iterate the source (its
    gathers are collectives) and publish nothing.

    The source's tensors are registered once. A source whose tensors are
    the same memory every round (a plain module) is read in place; one that
    materializes fresh tensors each round (an FSDP gather) is copied into
    buffers registered at the first round (the default; ``direct=True``
    reads CUDA tensors in place, for sources whose tensors stay put)."""

    def __init__(self, source: Iterable[Tuple[str, Any]], client: Any, *,
                 rank: int = 0, socket: str = "", stream: str = "policy",
                 direct: bool = False, init_info: Optional[Dict[str, Any]] = None,
                 commit_timeout_s: float = 600.0) -> None:
        import ferry
        self.source, self.client = source, client
        self.is_sender = rank == 0
        self.version = 0
        self.direct = direct
        self._registered: Dict[str, Any] = {}
        self.src = None
        if not self.is_sender:
            return
        tensors = self._materialize()
        # Registered once: CUDA tensors as they are with direct=True, else
        # a copy made here (a gathered source yields new memory each round);
        # host tensors in an arena, where ferryd can map them.
        host = [t for t in tensors.values() if not t.is_cuda]
        arenas = []
        if host:
            from ferry.torch_utils import bytes_needed
            arenas.append(ferry.SharedTensorArena("trainer.%s" % stream,
                                                  bytes_needed(host)))
        params = []
        for name, t in tensors.items():
            if not t.is_cuda:
                keep = arenas[0].tensor(tuple(t.shape), t.dtype)
                keep.copy_(t)
            elif direct:
                keep = t
            else:
                keep = t.detach().clone()
            self._registered[name] = keep
            params.append((keep, ferry.Shard(name, tuple(t.shape))))
        self.arenas = arenas
        conn = ferry.connect(socket or None)
        self.src = ferry.SourceClient.register(conn, stream, 0, 1, arenas, params,
                                               commit_timeout_s=commit_timeout_s)
        if init_info is not None:
            client.init_weight_transfer_engine(init_info)

    def _materialize(self) -> Dict[str, Any]:
        out = {}
        for name, t in self.source:
            full = getattr(t, "full_tensor", None)
            out[name] = full() if callable(full) else t
        return out

    def send_weights(self) -> Optional[PublishOutcome]:
        """One round: the next version published and every worker at it.
        Returns the PublishOutcome on rank 0, None elsewhere."""
        tensors = self._materialize()  # every rank: the source's collectives
        if not self.is_sender:
            return None
        for name, t in tensors.items():
            keep = self._registered.get(name)
            if keep is None:
                raise ValueError("ferry backend: the source yields %s, which it "
                                 "did not at the first round" % name)
            if keep.data_ptr() != t.data_ptr():
                keep.copy_(t)
        self.version += 1
        v = self.version
        self.client.start_weight_update()
        errors: List[BaseException] = []

        def workers():
            try:
                self.client.update_weights({"version": v})
            except BaseException as e:  # reported below
                errors.append(e)
        t = threading.Thread(target=workers, name="ferry-vllm-update")
        t.start()
        try:
            outcome = self.src.publish(v)
        finally:
            t.join()
        if errors:
            raise errors[0]
        try:
            self.client.finish_weight_update(str(v))
        except TypeError:  # clients whose finish takes no version
            self.client.finish_weight_update()
        if not outcome.all_committed():
            raise RuntimeError("ferry backend: version %d: %s" % (v, outcome.summary()))
        return outcome

    def shutdown(self) -> None:
        if self.src is not None:
            self.src.close()
            self.src = None
        for a in getattr(self, "arenas", []):
            a.close()

    close = shutdown


# ---------------------------------------------------------------------------
# The vLLM classes: defined when vLLM is importable.

def _vllm_classes():
    """The engine and trainer classes over the installed vLLM's bases."""
    from vllm.distributed.weight_transfer import base

    @dataclasses.dataclass
    class FerryWeightTransferInitInfo(base.WeightTransferInitInfo, FerryInitFields):
        pass

    @dataclasses.dataclass
    class FerryWeightTransferUpdateInfo(base.WeightTransferUpdateInfo,
                                        FerryUpdateFields):
        pass

    class FerryWeightTransferEngine(base.WeightTransferEngine):
        """vLLM's worker side of the "ferry" backend: a WorkerCore."""

        init_info_cls = FerryWeightTransferInitInfo
        update_info_cls = FerryWeightTransferUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model) -> None:
            super().__init__(config, vllm_config, device, model)
            from vllm.distributed import (get_tensor_model_parallel_rank,
                                          get_tensor_model_parallel_world_size)
            hf = vllm_config.model_config.hf_config
            self.core = WorkerCore(model, hf.to_dict(),
                                   get_tensor_model_parallel_rank(),
                                   get_tensor_model_parallel_world_size(),
                                   load_weights=model.load_weights)

        def init_transfer_engine(self, init_info) -> None:
            self.core.init(init_info)

        def start_weight_update(self) -> None:
            self.core.start_weight_update()

        def receive_weights(self, update_info) -> None:
            self.core.update_weights(update_info)

        def finish_weight_update(self) -> None:
            self.core.finish_weight_update()

        def shutdown(self) -> None:
            self.core.shutdown()

    trainer_info_base = getattr(base, "TrainerInitInfo", None)
    trainer_engine_base = getattr(base, "TrainerWeightTransferEngine", None)
    trainer_classes = ()
    if trainer_info_base is not None and trainer_engine_base is not None:
        @dataclasses.dataclass
        class FerryTrainerInitInfo(trainer_info_base):
            backend: ClassVar[str] = BACKEND
            instance_ids: Tuple[str, ...] = ()
            socket: str = ""
            stream: str = "policy"
            direct: bool = False

        class FerryTrainerWeightTransferEngine(trainer_engine_base):
            """vLLM's trainer side of the "ferry" backend: a TrainerCore."""

            init_info_cls = FerryTrainerInitInfo

            @classmethod
            def trainer_init(cls, init_info, *, client, source=None):
                engine = cls(client=client, source=source,
                             is_sender=init_info.is_sender)
                engine.core = TrainerCore(
                    source, client, rank=init_info.rank, socket=init_info.socket,
                    stream=init_info.stream, direct=init_info.direct)
                return engine

            def send_weights(self) -> None:
                self.core.send_weights()

            def shutdown(self) -> None:
                self.core.shutdown()

        trainer_classes = (FerryTrainerInitInfo, FerryTrainerWeightTransferEngine)
    return (FerryWeightTransferEngine, FerryWeightTransferInitInfo,
            FerryWeightTransferUpdateInfo) + trainer_classes


def missing_vllm_api() -> List[str]:
    """What the installed vLLM lacks of the API this backend was written
    against (empty: all there). ImportError when vLLM is not installed."""
    from vllm.distributed.weight_transfer import base
    missing = ["WeightTransferEngine.%s" % m for m in _ENGINE_METHODS
               if not hasattr(base.WeightTransferEngine, m)]
    trainer = getattr(base, "TrainerWeightTransferEngine", None)
    if trainer is not None:  # optional: older vLLMs have no trainer side
        missing += ["TrainerWeightTransferEngine.%s" % m for m in _TRAINER_METHODS
                    if not hasattr(trainer, m)]
    return missing


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the "ferry"
    backend with vLLM's factories (both sides where this vLLM has the
    trainer factory). Refuses, logging what is missing, on a vLLM whose
    weight-transfer API differs from the one this module was written for."""
    try:
        import vllm.distributed.weight_transfer as wt
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError as e:
        log.error("ferry backend: this vLLM has no weight-transfer factory "
                  "(%s); the ferry backend is not registered", e)
        return
    missing = missing_vllm_api()
    if missing:
        log.error("ferry backend: this vLLM's weight-transfer API lacks %s; the "
                  "ferry backend is not registered", ", ".join(missing))
        return
    registry = getattr(WeightTransferEngineFactory, "_registry", {})
    if BACKEND not in registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "ferry.vllm", "FerryWeightTransferEngine")
    trainer_factory = getattr(wt, "WeightTransferTrainerFactory", None)
    if trainer_factory is None:
        try:
            from vllm.distributed.weight_transfer.factory import \
                WeightTransferTrainerFactory as trainer_factory  # noqa: N813
        except ImportError:
            trainer_factory = None
    if trainer_factory is not None and BACKEND not in getattr(
            trainer_factory, "_registry", {}):
        trainer_factory.register_engine(BACKEND, "ferry.vllm",
                                        "FerryTrainerWeightTransferEngine")


def __getattr__(name: str) -> Any:
    """The vLLM classes, made on first use (the factories import this
    module and look them up by name)."""
    names = ("FerryWeightTransferEngine", "FerryWeightTransferInitInfo",
             "FerryWeightTransferUpdateInfo", "FerryTrainerInitInfo",
             "FerryTrainerWeightTransferEngine")
    if name not in names:
        raise AttributeError(name)
    classes = _vllm_classes()
    found = dict(zip(names, classes))
    globals().update(found)
    if name not in found:
        raise AttributeError("%s: this vLLM has no trainer-side weight transfer"
                             % name)
    return found[name]

"""ferry.engine: any torch model as an engine rank of ferry.

The part every engine integration shares (the vLLM backend, the SGLang
loader, an engine of your own). Given a model's live parameters, its
Hugging Face config, the instance id and the rank's TP rank and size,
``EngineAdapter``:

1. builds vLLM's parameter table for the config (``ferry.vllm_table``: fused
   ``qkv_proj`` / ``gate_up_proj``, MoE ``w13`` / ``w2``, vocabulary padding)
   and binds it **by name** onto the live tensors, each one's shape and
   dtype checked against the table. Every parameter keeps its live tensor:
   ferry's layout resolution then writes it directly when it can prove the
   bytes land right, and otherwise falls back, fail-closed, naming why
   (``explain()``):

   - a parameter whose live shape or dtype is not the table's (the engine
     pads, quantizes or reorders it) is registered as it is: ferry's
     resolution writes it directly where it can prove the bytes land right
     (padded vocabulary rows) and otherwise hands the checkpoint tensors to
     the loader;
   - a parameter the table does not know is registered as a CUSTOM
     parameter consuming the checkpoint tensor of the same name;
   - ``fallback=[...]`` forces parameters through the loader (TRANSFORMED);

   and the fallback tensors of each version reach the model's own
   ``load_weights(iterable of (checkpoint name, tensor))``, as vLLM's and
   SGLang's loaders take them;
2. registers the rank (a ``DestinationClient``) and turns ferry's events into
   the engine's: a ``ServingGate`` its serving loop consults (closed from
   PAUSE until COMMIT or a clean ABORT; a dirty ABORT keeps it closed),
   fallback tensors into ``load_weights``, offload and onload through the
   engine's release / reallocate hooks (for an ``nn.Module`` the default
   drops ``param.data`` and rebinds it to the fresh memory), and LoRA
   adapters to a ``LoraManager``.

Host tensors must be registered memory: an ``nn.Module`` on the CPU is moved
into an arena (``ferry.move_to_arena``); a mapping of tensors names its
``arenas``. CUDA tensors are registered as they are.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Mapping,
                    Optional, Sequence, Tuple, Union)

from ferry import layout
from ferry.callbacks import EngineCallbacks
from ferry.destination import DestinationClient
from ferry.memory import Arenas, as_arenas
from ferry.tables import vllm_table

if TYPE_CHECKING:
    import torch

    from ferry.connection import Connection
    from ferry.staging import AdapterShare

log = logging.getLogger("ferry")

LoadWeights = Callable[[Iterable[Tuple[str, "torch.Tensor"]]], Any]


class NotServing(RuntimeError):
    """The engine holds no complete version (a dirty ABORT, an offload)."""


class ServingGate:
    """What the engine's serving loop consults: ``with gate.serving(): ...``
    around each forward pass. Closed while ferry writes the weights (from
    PAUSE to COMMIT or a clean ABORT): new passes wait, and ``pause`` waits
    for the passes in flight. A dirty ABORT or an offload keeps it closed
    until the next COMMIT, and passes raise NotServing meanwhile."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = True
        self._dirty = False
        self._active = 0

    def serving(self, timeout_s: float = 600.0) -> "_Pass":
        return _Pass(self, timeout_s)

    def _enter(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._open:
                if self._dirty:
                    raise NotServing("the weights are half-written (a version "
                                     "aborted dirty, or the rank is offloaded); "
                                     "the next committed version reopens")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the weights are being updated; not open "
                                       "within %.0f s" % timeout_s)
                self._cond.wait(left)
            self._active += 1

    def _exit(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def pause(self, timeout_s: float = 600.0) -> None:
        """Closes the gate and waits for the passes in flight."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._open = False
            while self._active:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("%d forward passes still running after "
                                       "%.0f s" % (self._active, timeout_s))
                self._cond.wait(left)

    def resume(self) -> None:
        with self._cond:
            self._open, self._dirty = True, False
            self._cond.notify_all()

    def mark_dirty(self) -> None:
        with self._cond:
            self._open, self._dirty = False, True
            self._cond.notify_all()

    @property
    def is_open(self) -> bool:
        with self._cond:
            return self._open


class _Pass:
    def __init__(self, gate: ServingGate, timeout_s: float) -> None:
        self._gate, self._timeout_s = gate, timeout_s

    def __enter__(self) -> None:
        self._gate._enter(self._timeout_s)

    def __exit__(self, *exc: object) -> None:
        self._gate._exit()


class LoraManager:
    """Where LoRA adapters go (Lifecycle.LoadAdapter): override what the
    engine serves. ``shares`` is this rank's part of each lora_A / lora_B as
    (tensor name, tensor, share), valid during the call; copy what you keep."""

    def load(self, name: str, version: int, config_json: str,
             shares: List["AdapterShare"]) -> None:
        raise NotImplementedError("this engine does not serve LoRA adapters")

    def activate(self, name: str, version: int) -> None:
        """Serve the adapter at ``version`` (its COMMIT)."""

    def unload(self, name: str) -> None:
        raise NotImplementedError("this engine does not serve LoRA adapters")


class Placement:
    """How one live parameter was registered, before ferry resolved it:
    ``kind`` "table" (bound to vLLM's table entry, shape and dtype agree),
    "differs" (the table's entry, but the live tensor's shape or dtype is
    not the table's: ferry's resolution decides, direct where it proves the
    bytes land right, e.g. padded vocabulary rows, else fallback), "forced" (``fallback=``) or "unknown" (not in
    the table: CUSTOM, consuming the checkpoint tensor of its name); and
    ``reason``."""

    def __init__(self, name: str, kind: str, reason: str = "") -> None:
        self.name, self.kind, self.reason = name, kind, reason

    def __repr__(self) -> str:
        return "Placement(%s: %s%s)" % (self.name, self.kind,
                                        ", " + self.reason if self.reason else "")


def bind_table(table_params: Sequence[Any], live: Mapping[str, "torch.Tensor"],
               fallback: Iterable[str] = ()
               ) -> Tuple[List[layout.EngineParam], Dict[str, Placement]]:
    """vLLM's table entries (ferry.tables.ParamLayout) bound by name onto the
    live tensors: the EngineParams to register and how each was placed."""
    forced = set(fallback)
    by_name = {p.name: p for p in table_params}
    unknown_forced = forced - set(live)
    if unknown_forced:
        raise ValueError("fallback names parameters the model does not have: %s"
                         % sorted(unknown_forced))
    out: List[layout.EngineParam] = []
    placed: Dict[str, Placement] = {}
    for name, tensor in live.items():
        p = by_name.get(name)
        if p is None:
            out.append(layout.EngineParam(name, tensor, layout.CUSTOM,
                                          consumes=[name]))
            placed[name] = Placement(name, "unknown", "vLLM's table for this "
                                     "config has no %s; the loader gets the "
                                     "checkpoint tensor of that name" % name)
            continue
        flags = list(p.flags)
        consumes = list(p.consumes)
        if name in forced:
            flags.append(layout.TRANSFORMED)
            if not consumes:
                consumes = [part.checkpoint_name for part in p.parts] or [name]
            kind, reason = "forced", "fallback= (the engine's loader takes it)"
        elif tuple(tensor.shape) != p.shape or tensor.dtype != p.dtype:
            kind = "differs"
            reason = "live %s %s, vLLM's table %s %s" % (
                tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
                p.shape, str(p.dtype).replace("torch.", ""))
        else:
            kind, reason = "table", ""
        out.append(layout.EngineParam(
            name, tensor, p.loader, shard_dim=p.shard_dim, fused_parts=p.parts,
            flags=flags, consumes=consumes, alias_of=p.alias_of))
        placed[name] = Placement(name, kind, reason)
    return out, placed


class EngineAdapter(EngineCallbacks):
    """One engine rank of ferry, around a live torch model (see the module
    doc). ``model``: an ``nn.Module`` (its ``named_parameters()``) or a
    mapping of engine parameter names to live tensors. ``config``: the
    Hugging Face config (dict, JSON text or path). ``load_weights``: the
    engine's loader for fallback tensors (default: ``model.load_weights``
    when the model has one). ``release`` / ``reallocate``: the engine's
    offload hooks (``release()`` drops its tensors; ``reallocate(tensors)``
    takes the fresh ones by name); for an ``nn.Module`` the default rebinds
    ``param.data``. ``pause_hook`` (optional) runs at PAUSE before the gate
    closes, e.g. to wait until the serving frontend stopped admitting
    requests. Other keywords go to the DestinationClient (``node``,
    ``held_version``, ``replace_existing``, ``staging``)."""

    def __init__(self, conn: "Connection", instance_id: str, tp_rank: int,
                 tp_size: int, model: Union["torch.nn.Module",
                                            Mapping[str, "torch.Tensor"]],
                 config: Union[Dict[str, Any], str], *, stream: str = "policy",
                 arenas: Arenas = None, load_weights: Optional[LoadWeights] = None,
                 fallback: Iterable[str] = (), lora: Optional[LoraManager] = None,
                 release: Optional[Callable[[], None]] = None,
                 reallocate: Optional[Callable[[Dict[str, "torch.Tensor"]], None]] = None,
                 pause_hook: Optional[Callable[[int], None]] = None,
                 ep: bool = False, pause_timeout_s: float = 600.0,
                 **client_options: Any) -> None:
        self.instance_id, self.tp_rank, self.tp_size = instance_id, tp_rank, tp_size
        self.who = "engine %s tp rank %d" % (instance_id, tp_rank)
        self.model = model
        self.gate = ServingGate()
        self.lora = lora
        self.pause_hook = pause_hook
        self.pause_timeout_s = pause_timeout_s
        self.loaded: List[str] = []  # fallback tensors of the last APPLY
        is_module = hasattr(model, "named_parameters")
        self._own_arenas: List[Any] = []  # made here: closed with the adapter
        live: Dict[str, "torch.Tensor"]
        if is_module:
            arenas = as_arenas(arenas)
            live = {n: p.data for n, p in model.named_parameters()}
            host = [t for t in live.values() if not t.is_cuda]
            if host and not arenas:
                from ferry.torch_utils import arena_for_module, move_to_arena
                arenas = [arena_for_module(model, "%s.tp%d" % (instance_id, tp_rank))]
                move_to_arena(model, arenas[0])
                self._own_arenas = list(arenas)
                live = {n: p.data for n, p in model.named_parameters()}
            self._params = dict(model.named_parameters())
        else:
            live = dict(model)
            self._params = {}
        if load_weights is None and hasattr(model, "load_weights"):
            load_weights = model.load_weights
        self.load_weights = load_weights
        self._release = release
        self._reallocate = reallocate
        table = vllm_table(config, tp_size=tp_size, tp_rank=tp_rank, ep=ep)
        params, self.placement = bind_table(table.params, live, fallback)
        for name, p in self.placement.items():
            if p.kind != "table":
                log.info("%s: %s: %s (%s)", self.who, name, p.kind, p.reason)
        self.client = DestinationClient(conn, instance_id, stream, tp_rank, tp_size,
                                        arenas, params, self, **client_options)

    # -- lifetime -----------------------------------------------------------
    def open(self) -> "EngineAdapter":
        self.client.open()
        return self

    def close(self) -> None:
        self.client.close()
        for a in self._own_arenas:
            a.close()  # unlinked; the model's tensors keep the mapping

    def __enter__(self) -> "EngineAdapter":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def committed(self) -> int:
        """The latest version this rank committed (the client's view)."""
        return self.client.committed_version

    def wait_committed(self, version: int, timeout_s: float = 60.0) -> int:
        """Blocks until this rank committed ``version`` (or a later one)."""
        return self.client.wait_committed(version, timeout_s)

    def explain(self) -> Dict[str, Tuple[str, str]]:
        """How ferryd resolved each live parameter of this rank: name ->
        (resolution, reason), with this adapter's own reason where it placed
        the parameter off the table (Inspection.ExplainPlan)."""
        from ferry.v1 import inspection_pb2
        plan = self.client.conn.explain_plan(self.instance_id, self.tp_rank)
        out = {}
        for p in plan.parameters:
            if p.tp_rank != self.tp_rank:
                continue
            reason = p.reason
            mine = self.placement.get(p.name)
            if mine is not None and mine.reason:
                reason = "%s (%s)" % (reason, mine.reason) if reason else mine.reason
            out[p.name] = (inspection_pb2.Resolution.Name(p.resolution), reason)
        return out

    # -- ferry's events, as the engine's ------------------------------------
    def on_pause(self, version: int) -> None:
        if self.pause_hook is not None:
            self.pause_hook(version)
        self.gate.pause(self.pause_timeout_s)

    def on_apply(self, version: int, fallback: List[Tuple[str, "torch.Tensor"]]) -> None:
        if fallback:
            if self.load_weights is None:
                raise ValueError("%s: fallback tensors %s arrived, and the engine "
                                 "has no load_weights" % (self.who,
                                                          [n for n, _ in fallback]))
            self.load_weights(iter(fallback))
        self.loaded = [n for n, _ in fallback]

    def on_commit(self, version: int) -> None:
        self.gate.resume()

    def on_abort(self, version: int, reason: str, dirty: bool) -> None:
        if dirty:
            self.gate.mark_dirty()
        else:
            self.gate.resume()

    def on_offload(self, region_ids: List[int], host_copy_kept: bool) -> None:
        self.gate.mark_dirty()
        if self._release is not None:
            self._release()
        else:
            import torch
            for p in self._params.values():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if isinstance(self.model, dict):
            self.model.clear()

    def on_onload(self, region_ids: List[int]) -> None:
        names = [p.name for p in self.client.registration.engine_table.parameters]
        fresh = {n: self.client.live_tensor(n) for n in names}
        if self._reallocate is not None:
            self._reallocate(fresh)
        else:
            for n, p in self._params.items():
                p.data = fresh[n]
        if isinstance(self.model, dict):
            self.model.update(fresh)

    def on_adapter_apply(self, name: str, version: int, config_json: str,
                         shares: List["AdapterShare"]) -> None:
        if self.lora is None:
            super().on_adapter_apply(name, version, config_json, shares)
        self.lora.load(name, version, config_json, shares)

    def on_adapter_commit(self, name: str, version: int) -> None:
        if self.lora is not None:
            self.lora.activate(name, version)

    def on_adapter_unload(self, name: str) -> None:
        if self.lora is None:
            super().on_adapter_unload(name)
        self.lora.unload(name)

"""EngineCallbacks: what an engine rank does at each event of its
DestinationClient (client/destination_client.h, DestinationCallbacks).

An engine subclasses EngineCallbacks and overrides the methods it needs;
the DestinationClient calls them on its reader thread, one at a time, in
event order, and acks each event with the outcome: a method that returns
acks OK, one that raises acks FAILED with the exception's type and text,
which aborts the instance's version. The methods not overridden keep the
behaviour written here: every one acks OK, except ``on_adapter_apply``
and ``on_adapter_unload``, which raise NotImplementedError (an engine
without them does not serve LoRA adapters, and those events are acked
FAILED, saying so).

    class Engine(ferry.EngineCallbacks):
        def on_pause(self, version):
            gate.pause()
        def on_apply(self, version, fallback):
            for name, tensor in fallback:
                loader.load(name, tensor)
        def on_commit(self, version):
            gate.resume()
        def on_abort(self, version, reason, dirty):
            if not dirty:
                gate.resume()

    dst = ferry.DestinationClient.register(conn, "vllm-0", "policy", rank, tp,
                                           arena, table, Engine())

For each version of the base model the events are PREPARE, PAUSE, APPLY,
then COMMIT or ABORT (docs/api.md, "Version protocol"). LoRA adapters
(``conn.load_adapter``; docs/api.md, "LoRA adapters") come as events with
an adapter name, a sequence of their own per adapter, interleaved with the
base model's; an adapter version never pauses the base model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Tuple

if TYPE_CHECKING:
    import torch

    from ferry.staging import Share


class EngineCallbacks:
    """The engine's side of the version protocol; override what it needs.
    The base class is an engine that takes every version without doing
    anything and serves no adapters."""

    # -- the base model ---------------------------------------------------
    def on_prepare(self, version: int) -> None:
        """Get ready to pause (stop admitting requests)."""

    def on_pause(self, version: int) -> None:
        """Return at a safe point: no forward pass reads the weights; ferry
        then writes the live tensors. For a GPU rank the client waits for
        the kernels already queued on the GPU before it acks."""

    def on_apply(self, version: int,
                 fallback: List[Tuple[str, "torch.Tensor"]]) -> None:
        """The direct bytes are in place. ``fallback`` lists (checkpoint
        name, tensor) of whole checkpoint tensors in the daemon's staging,
        for the engine's own loader (the parameters ferry falls back on);
        they are valid during the call only. For a GPU rank they are CUDA
        tensors on its GPU (device staging; host tensors where ferryd staged
        in host memory), and the client waits for the GPU's queued copies
        before it acks. Return once the rank holds ``version``. The base
        class loads nothing: an engine with fallback parameters must
        override this."""

    def on_commit(self, version: int) -> None:
        """Resume serving at ``version``."""

    def on_abort(self, version: int, reason: str, dirty: bool) -> None:
        """The version did not commit. Clean (``dirty`` False): the live
        tensors still hold the previous version; resume serving it. Dirty:
        they are half-written; serve nothing until the next COMMIT (a retry
        or the stream's next version follows)."""

    # -- offload and onload (Lifecycle.Offload / Onload) -------------------
    def on_offload(self, region_ids: List[int], host_copy_kept: bool) -> None:
        """Drop every tensor viewing these regions (the engine's parameters
        and every view of them): the client then releases them. An arena is
        unmapped and unlinked, and the client acks FAILED if a tensor still
        views it; a CUDA region's memory goes back to the driver
        (torch.cuda.empty_cache), with a warning if some tensor still holds
        its allocation. Serve nothing until onloaded."""

    def on_onload(self, region_ids: List[int]) -> None:
        """The client has made the regions anew (same sizes and ids; an
        arena under a new /dev/shm name, a CUDA region as a fresh GPU
        allocation; registered with Registry.UpdateRegions): rebuild the
        tensors at their offsets (``DestinationClient.live_tensor(name)``,
        or ``arena.view``). Stay paused until COMMIT
        (the instance was refilled) or a dirty ABORT (the stream's next
        version fills it)."""

    # -- LoRA adapters ------------------------------------------------------
    def on_adapter_pause(self, name: str, version: int) -> None:
        """Stop using adapter ``name`` (the base model and the other
        adapters keep serving)."""

    def on_adapter_apply(self, name: str, version: int, config_json: str,
                         shares: List[Tuple[str, "torch.Tensor", Optional["Share"]]]
                         ) -> None:
        """Load the adapter under ``name``, replacing what it held, without
        serving it before its COMMIT. ``shares`` lists (tensor name, tensor,
        share): this rank's part of each lora_A / lora_B, ``share`` being
        (offsets, extents) of the global tensor, or None for the whole
        tensor (the engine then slices it). The tensors view daemon
        staging, valid during the call only: copy what is kept.

        Not overridden: the engine does not serve adapters, and the event is
        acked FAILED."""
        raise NotImplementedError(
            "adapter %s arrived, but this engine does not serve LoRA adapters "
            "(its EngineCallbacks do not override on_adapter_apply)" % name)

    def on_adapter_commit(self, name: str, version: int) -> None:
        """Serve the adapter at ``version``."""

    def on_adapter_abort(self, name: str, version: int, reason: str,
                         dirty: bool) -> None:
        """The adapter's version did not commit: keep the previous adapter
        (clean), or do not use it until a later commit (dirty)."""

    def on_adapter_unload(self, name: str) -> None:
        """Drop the adapter; return once no request uses it.

        Not overridden: the event is acked FAILED (an engine that serves
        no adapters has none to drop)."""
        raise NotImplementedError(
            "UNLOAD_ADAPTER of %s needs on_adapter_unload, which this engine's "
            "EngineCallbacks do not override" % name)

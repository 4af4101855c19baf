"""ferry behind SGLang's ``update_weights_from_tensor``.

SGLang takes weight updates through ``update_weights_from_tensor(named_tensors,
load_format)``; a ``load_format`` named in the server's
``--custom-weight-loader`` list is imported and called in every TP worker as
``loader(model, named_tensors)``. ``ferry.sglang.load_weights`` is such a
loader: the "tensors" it receives are one small tensor, the version to reach
(``version_tensors(v)``); the weights themselves come through ferry, written
by ferryd into the live parameters (fallback tensors through the model's own
``load_weights``). The worker's first call registers the rank with the node's
ferryd (``ferry.engine.EngineAdapter``, vLLM's table for the model's config,
which SGLang's Llama/Qwen layouts share), so attach once at start-up with
version 0.

    # the SGLang server, every node:
    #   FERRY_INSTANCE_ID=sglang-0 python -m sglang.launch_server ... \\
    #     --custom-weight-loader ferry.sglang.load_weights
    # the trainer (rank 0), once:
    engine.update_weights_from_tensor(ferry.sglang.version_tensors(0),
                                      load_format=ferry.sglang.LOADER)
    # every step:
    ferry.sglang.publish(src, v, pause=engine.pause_generation,
                         update=lambda t: engine.update_weights_from_tensor(
                             t, load_format=ferry.sglang.LOADER),
                         resume=engine.continue_generation)

``publish`` pauses generation, publishes version v from the trainer's
SourceClient while the workers' loaders wait for it, then resumes. A worker
whose loader has not been called for v holds ferry's PAUSE (it never writes
weights a forward pass may read), so a version published without the
loader call aborts clean after ``FERRY_PAUSE_TIMEOUT_S``.

Environment of the SGLang workers: ``FERRY_INSTANCE_ID`` (required),
``FERRY_SOCKET`` (default: the clients' rule), ``FERRY_STREAM`` ("policy"),
``FERRY_FALLBACK`` (comma-separated parameters forced through the loader),
``FERRY_PAUSE_TIMEOUT_S`` (600). Every SGLang import of ferry is in
``_tp_rank_and_size``. It has not run against a live SGLang (not
installable where ferry is tested); python/tests/sglang_test.py calls the
loader as SGLang does, with the PyTorch example's model.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

if TYPE_CHECKING:
    from ferry.source import PublishOutcome

LOADER = "ferry.sglang.load_weights"
VERSION_TENSOR = "__ferry_version__"

_workers: Dict[int, Any] = {}  # id(model) -> ferry.vllm.WorkerCore
_lock = threading.Lock()


def version_tensors(version: int) -> List[Tuple[str, Any]]:
    """What the trainer passes to update_weights_from_tensor: the version."""
    import torch
    return [(VERSION_TENSOR, torch.tensor([int(version)], dtype=torch.int64))]


def _tp_rank_and_size() -> Tuple[int, int]:
    try:
        from sglang.srt.distributed import (get_tensor_model_parallel_rank,
                                            get_tensor_model_parallel_world_size)
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (ImportError, AssertionError):
        # Outside an SGLang worker (tests, a single-process engine).
        return (int(os.environ.get("FERRY_TP_RANK", "0")),
                int(os.environ.get("FERRY_TP_SIZE", "1")))


def _hf_config(model: Any) -> Dict[str, Any]:
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("ferry.sglang: the model has no .config (its Hugging "
                         "Face config), which vLLM's table is built from")
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def _worker(model: Any):
    from ferry.vllm import FerryInitFields, WorkerCore
    with _lock:
        core = _workers.get(id(model))
        if core is not None:
            return core
        instance = os.environ.get("FERRY_INSTANCE_ID", "")
        if not instance:
            raise ValueError("ferry.sglang: set FERRY_INSTANCE_ID (the engine "
                             "instance's id, e.g. sglang-0) in the server's "
                             "environment")
        rank, size = _tp_rank_and_size()
        core = WorkerCore(model, _hf_config(model), rank, size,
                          load_weights=getattr(model, "load_weights", None))
        fallback = tuple(f for f in os.environ.get("FERRY_FALLBACK", "").split(",") if f)
        core.init(FerryInitFields(
            instance_id=instance, socket=os.environ.get("FERRY_SOCKET", ""),
            stream=os.environ.get("FERRY_STREAM", "policy"), fallback=fallback,
            pause_timeout_s=float(os.environ.get("FERRY_PAUSE_TIMEOUT_S", "600"))))
        _workers[id(model)] = core
        return core


def load_weights(model: Any, named_tensors: List[Tuple[str, Any]]) -> None:
    """SGLang's custom weight loader: ``named_tensors`` holds the version to
    reach (``version_tensors``); returns once this worker committed it
    (version 0: once the rank is registered)."""
    versions = [t for n, t in named_tensors if n == VERSION_TENSOR]
    if len(versions) != 1 or len(named_tensors) != 1:
        raise ValueError("ferry.sglang.load_weights takes one tensor, %s (the "
                         "version, ferry.sglang.version_tensors(v)); got %s"
                         % (VERSION_TENSOR, [n for n, _ in named_tensors]))
    version = int(versions[0].reshape(-1)[0].item())
    core = _worker(model)
    if version == 0:
        return
    from ferry.vllm import FerryUpdateFields
    core.start_weight_update()
    try:
        core.update_weights(FerryUpdateFields(version=version))
    finally:
        core.finish_weight_update()


def detach(model: Any) -> None:
    """Deregisters the worker of ``model`` (shutdown)."""
    with _lock:
        core = _workers.pop(id(model), None)
    if core is not None:
        core.shutdown()


def publish(source: Any, version: int, *, update: Callable[[List], Any],
            pause: Optional[Callable[[], Any]] = None,
            resume: Optional[Callable[[], Any]] = None) -> PublishOutcome:
    """The trainer's side of one SGLang update: pause generation, publish
    ``version`` from ``source`` (a ferry.SourceClient) while ``update`` (the
    engine's update_weights_from_tensor with LOADER) waits on the workers,
    resume. Returns the PublishOutcome; raises what ``update`` raised."""
    if pause is not None:
        pause()
    errors: List[BaseException] = []

    def call_update():
        try:
            update(version_tensors(version))
        except BaseException as e:  # reported below
            errors.append(e)
    t = threading.Thread(target=call_update, name="ferry-sglang-update")
    t.start()
    try:
        outcome = source.publish(version)
    finally:
        t.join()
        if resume is not None:
            resume()
    if errors:
        raise errors[0]
    return outcome

"""ferry Python client: register trainer ranks (sources) and engine ranks
(destinations) with ferryd, publish versions, follow them. docs/python.md.

The modules mirror the C++ client (client/*.h): ``connection`` (Connection,
connect), ``source`` (SourceClient, PublishOutcome), ``destination``
(DestinationClient), ``callbacks`` (EngineCallbacks), ``staging`` (the
daemon's staging memory at APPLY), ``lease`` (LeaseKeeper), ``lifecycle``
(controller calls), ``errors`` (FerryError); ``arena`` (SharedTensorArena),
``layout`` (Shard, EngineParam), ``dtypes`` (torch <-> ferry.v1 dtypes),
``tables`` (vllm_table), ``torch_utils``. The ferry.v1 stubs are the
modules of ``ferry.v1``.

PyTorch is imported when tensors are first made or described, not here: a
process that only calls ferryd (lifecycle, inspection) needs grpcio and
protobuf only.
"""

__version__ = "0.1.0"

from ferry.v1 import (inspection_pb2, lifecycle_pb2, registration_pb2,  # noqa: E402
                      types_pb2, version_pb2)
from ferry import dtypes, lifecycle  # noqa: E402
from ferry.arena import SharedTensorArena  # noqa: E402
from ferry.callbacks import EngineCallbacks  # noqa: E402
from ferry.connection import (Connection, connect,  # noqa: E402
                              default_socket_path, normalize_address)
from ferry.destination import DestinationClient  # noqa: E402
from ferry.errors import FerryError  # noqa: E402
from ferry.layout import (COLUMN, CUSTOM, FUSED, REPLICATED, ROW,  # noqa: E402
                          VOCAB_PARALLEL, EngineParam, FlatShard, Fp8, FusedPart,
                          Shard,
                          PACKED, TRANSPOSED, PRE_SHARDED, WRAPPED_LOADER,
                          TRANSFORMED)
from ferry.lease import LeaseKeeper  # noqa: E402
from ferry.source import PublishOutcome, SourceClient, instance_label  # noqa: E402
from ferry.tables import VllmTable, vllm_table  # noqa: E402
from ferry.torch_utils import arena_for_module, move_to_arena  # noqa: E402

COMMITTED = types_pb2.INSTANCE_STATE_COMMITTED
ABORTED = types_pb2.INSTANCE_STATE_ABORTED

__all__ = [
    "ABORTED", "COLUMN", "COMMITTED", "CUSTOM", "FUSED", "PACKED", "PRE_SHARDED",
    "REPLICATED", "ROW", "TRANSFORMED", "TRANSPOSED", "VOCAB_PARALLEL",
    "WRAPPED_LOADER", "Connection", "DestinationClient", "EngineCallbacks",
    "EngineParam", "FerryError", "FlatShard", "Fp8", "FusedPart", "LeaseKeeper", "PublishOutcome",
    "Shard", "SharedTensorArena", "SourceClient", "VllmTable", "__version__",
    "arena_for_module", "connect", "default_socket_path", "dtypes",
    "inspection_pb2", "instance_label", "lifecycle", "lifecycle_pb2", "move_to_arena",
    "normalize_address", "registration_pb2", "types_pb2", "version_pb2",
    "vllm_table",
]

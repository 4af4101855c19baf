"""ferry Python client: register trainer ranks (sources) and engine ranks
(destinations) with ferryd, publish versions, follow them.

See docs/python.md. The ferry.v1 stubs are generated from proto/ (never
checked in) into the package as ferry.v1; see ferry/v1/__init__.py.
"""

__version__ = "0.1.0"

from ferry.v1 import (inspection_pb2, registration_pb2, types_pb2,  # noqa: F401
                          version_pb2)
from ferry.arena import SharedTensorArena  # noqa: F401
from ferry.client import (Connection, DestinationClient, FerryError,  # noqa: F401
                          PublishOutcome, SourceClient, connect)
from ferry.layout import (COLUMN, CUSTOM, FUSED, REPLICATED, ROW,  # noqa: F401
                          VOCAB_PARALLEL, EngineParam, FusedPart, Shard,
                          PACKED, TRANSPOSED, PRE_SHARDED, WRAPPED_LOADER,
                          TRANSFORMED)
from ferry.tables import VllmTable, vllm_table  # noqa: F401
from ferry.torch_utils import arena_for_module, move_to_arena  # noqa: F401

COMMITTED = types_pb2.INSTANCE_STATE_COMMITTED
ABORTED = types_pb2.INSTANCE_STATE_ABORTED

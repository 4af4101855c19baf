"""Lifecycle calls a controller makes on an instance (client/lifecycle_client.h):
an RL controller, a test, an operator's script. Functions over a Connection,
each one RPC; ``Connection`` has a method of the same name for each, which
calls the function here (``conn.offload("vllm-0")``). docs/api.md,
"Bootstrap and reload", "Load options", "LoRA adapters", "Offload and
onload". The rank-side call, SwapModel, is ``DestinationClient.swap``.

Each returns the instance's status once settled; an ABORTED status is an
outcome, not an error. A refused call raises FerryError.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterable, Mapping, Optional

from ferry.v1 import lifecycle_pb2, types_pb2

if TYPE_CHECKING:
    from ferry.connection import Connection


def reload_in_place(conn: "Connection", instance_id: str,
                    timeout_s: float = 120.0) -> types_pb2.InstanceStatus:
    """Lifecycle.ReloadInPlace: the stream's latest committed version
    written into the instance again, from a peer instance; returns its
    InstanceStatus once settled (COMMITTED, or ABORTED with the reason)."""
    req = lifecycle_pb2.ReloadInPlaceRequest(instance_id=instance_id)
    return conn.call("ReloadInPlace(%s)" % instance_id,
                     conn.lifecycle.ReloadInPlace, req,
                     timeout_s=timeout_s).status


def offload(conn: "Connection", instance_id: str, keep_host_copy: bool = False,
            timeout_s: float = 600.0) -> types_pb2.InstanceStatus:
    """Lifecycle.Offload: the instance's ranks release their memory, after
    ferryd copied it if ``keep_host_copy``; returns its InstanceStatus once
    settled (OFFLOADED, or ABORTED with the reason)."""
    req = lifecycle_pb2.OffloadRequest(instance_id=instance_id,
                                       keep_host_copy=keep_host_copy)
    return conn.call("Offload(%s)" % instance_id, conn.lifecycle.Offload,
                     req, timeout_s=timeout_s).status


def onload(conn: "Connection", instance_id: str,
           timeout_s: float = 600.0) -> types_pb2.InstanceStatus:
    """Lifecycle.Onload: the ranks allocate again and are refilled (host
    copy, else a peer); returns COMMITTED, or ABORTED with dirty set when
    the instance waits for the stream's next version."""
    req = lifecycle_pb2.OnloadRequest(instance_id=instance_id)
    return conn.call("Onload(%s)" % instance_id, conn.lifecycle.Onload,
                     req, timeout_s=timeout_s).status


def load_adapter(conn: "Connection", instance_id: str, adapter_name: str,
                 adapter_stream: str, adapter_config_json: str,
                 timeout_s: float = 120.0) -> types_pb2.InstanceStatus:
    """Lifecycle.LoadAdapter: attaches the LoRA adapter whose tensors are
    the stream ``adapter_stream`` to the instance under ``adapter_name``;
    returns its InstanceStatus on that stream: COMMITTED when delivered now
    (from a peer instance), IDLE (``waiting_reason``) when it waits for the
    stream's next version."""
    req = lifecycle_pb2.LoadAdapterRequest(
        instance_id=instance_id, adapter_name=adapter_name,
        adapter_stream=adapter_stream, adapter_config_json=adapter_config_json)
    return conn.call("LoadAdapter(%s, %s)" % (instance_id, adapter_name),
                     conn.lifecycle.LoadAdapter, req, timeout_s=timeout_s).status


def update_adapter(conn: "Connection", instance_id: str, adapter_name: str,
                   adapter_stream: str = "", adapter_config_json: str = "",
                   timeout_s: float = 120.0) -> types_pb2.InstanceStatus:
    """Lifecycle.UpdateAdapter: the name follows another stream and/or
    configuration ("" keeps the current one)."""
    req = lifecycle_pb2.UpdateAdapterRequest(
        instance_id=instance_id, adapter_name=adapter_name,
        adapter_stream=adapter_stream, adapter_config_json=adapter_config_json)
    return conn.call("UpdateAdapter(%s, %s)" % (instance_id, adapter_name),
                     conn.lifecycle.UpdateAdapter, req, timeout_s=timeout_s).status


def unload_adapter(conn: "Connection", instance_id: str, adapter_name: str,
                   timeout_s: float = 120.0) -> None:
    """Lifecycle.UnloadAdapter: the ranks drop the adapter; its staging is
    released."""
    req = lifecycle_pb2.UnloadAdapterRequest(instance_id=instance_id,
                                             adapter_name=adapter_name)
    conn.call("UnloadAdapter(%s, %s)" % (instance_id, adapter_name),
              conn.lifecycle.UnloadAdapter, req, timeout_s=timeout_s)


def update_config(conn: "Connection", instance_id: str,
                  set_options: Optional[Mapping[str, str]] = None,
                  clear_options: Iterable[str] = ()) -> Dict[str, str]:
    """Lifecycle.UpdateConfig: sets and clears load options (docs/api.md,
    "Load options"); returns every option now in effect, as a dict."""
    req = lifecycle_pb2.UpdateConfigRequest(
        instance_id=instance_id, set_options=dict(set_options or {}),
        clear_options=list(clear_options))
    return dict(conn.call("UpdateConfig(%s)" % instance_id,
                          conn.lifecycle.UpdateConfig, req).options)


def get_config(conn: "Connection", instance_id: str) -> Dict[str, str]:
    """The instance's load options in effect, defaults included."""
    return update_config(conn, instance_id)

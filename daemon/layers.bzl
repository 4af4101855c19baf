# ferryd's packages and the arrows between them, in one place: Bazel's
# visibility (visible_to, below) and tools/check_layering.py (which reads
# DAEMON_LAYERS) both come from this table.
#
# package -> the daemon packages it may depend on. Every package may also
# use the project's lower packages (core, common, proto, transport,
# checkpoint, cuda); the root package (daemon/: main.cc, server, the
# options) may use all of these. Bottom up:
DAEMON_LAYERS = {
    # Prometheus counters ferryd keeps and the endpoint that serves them.
    "metrics": [],
    # Memory ferryd maps from clients, its staging, and host copies kept
    # for offloaded ranks.
    "memory": [],
    # Mutual TLS, the caller of an RPC, the unix socket's peer credentials.
    "security": ["memory"],
    # Who is registered: ranks, their memory, declarations, leases.
    "registry": ["metrics", "memory"],
    # Transfer plans, cached per (source, destination) pair; FP8 in
    # flight's quantizer ranks own memory of the daemon's (memory).
    "plans": ["metrics", "memory", "registry"],
    # One instance's bytes: jobs, routes, executors, checksums, the data
    # path between daemons.
    "transfer": ["metrics", "memory", "registry", "plans"],
    # The version protocol: versions, runs, deadlines, the transfer queue.
    "versions": ["metrics", "memory", "registry", "plans", "transfer"],
    # LoRA adapters and model swaps, over the version protocol.
    "lifecycle": ["metrics", "memory", "registry", "plans", "transfer", "versions"],
    # Daemons together: a member's link to the coordinator, forwarding of
    # client calls, the Peer service.
    "cluster": ["metrics", "memory", "security", "registry", "plans", "transfer"],
    # The gRPC services clients call.
    "api": ["metrics", "memory", "security", "registry", "plans", "transfer",
            "versions", "lifecycle"],
}

def visible_to(package):
    """The visibility of `package`'s targets: the daemon packages above it,
    the root package, tests and benchmarks."""
    users = ["//daemon/%s:__pkg__" % p for p in DAEMON_LAYERS
             if package in DAEMON_LAYERS[p]]
    return users + [
        "//daemon:__pkg__",
        "//tests:__subpackages__",
        "//bench:__subpackages__",
    ]

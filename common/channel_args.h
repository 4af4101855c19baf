// How every ferry gRPC channel reconnects: a client to its daemon, a member
// to its coordinator, a daemon to a peer it sends to. One rule, here.
//
// After a restart the other side is found again within about a second
// (reconnect backoff 100 ms doubling to 1 s) instead of gRPC's default
// backoff, which grows to two minutes: clients re-register, members rejoin
// and routes resume promptly.
//
// Never GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: gRPC also takes it as the
// deadline of each connection attempt (TCP, TLS and the HTTP/2 handshake),
// and 100 ms for that fails on a loaded machine ("connection attempt timed
// out before receiving SETTINGS frame"). It cost clients their leases after
// a restart, and a fleet of 16 daemons on two cores its first version (every
// route to a starved member failed at once). gRPC's default, 20 s, stands.
#ifndef FERRY_COMMON_CHANNEL_ARGS_H_
#define FERRY_COMMON_CHANNEL_ARGS_H_

#include "grpcpp/support/channel_arguments.h"

namespace ferry {

inline grpc::ChannelArguments QuickReconnectArgs() {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return args;
}

}  // namespace ferry

#endif  // FERRY_COMMON_CHANNEL_ARGS_H_

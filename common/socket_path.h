// The unix socket where ferryd listens and where every client looks for it
// when given no address: one rule, here, for ferryd, ferryctl and the C++
// clients (python/ferry/connection.py mirrors it, and the tests check that
// the two agree).
//
//   1. $FERRY_SOCKET, when set and not empty;
//   2. $XDG_RUNTIME_DIR/ferry/ferryd.sock, when XDG_RUNTIME_DIR is set;
//   3. /tmp/ferry-<uid>/ferryd.sock.
//
// ferryd's --socket flag overrides it for the daemon, a client's address
// (--daemon, connect(address)) for the client.
#ifndef FERRY_COMMON_SOCKET_PATH_H_
#define FERRY_COMMON_SOCKET_PATH_H_

#include <string>

namespace ferry {

std::string DefaultSocketPath();

}  // namespace ferry

#endif  // FERRY_COMMON_SOCKET_PATH_H_

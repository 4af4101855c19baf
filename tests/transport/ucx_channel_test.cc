// The ucx backend: the conformance suite over UCX's tcp transport and over
// its shared-memory transports (sender and receiver on different threads),
// then the connection token, and two processes: a sender in a process of
// its own (ucx_peer) and one killed with SIGKILL mid-stream.
#include "transport/ucx/ucx_channel.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "tests/transport/transport_conformance.h"

namespace ferry {
namespace {

using testing::ChannelPair;
using testing::TestBucket;
using testing::TestDeadline;

ChannelPair UcxPair(const UcxChannelOptions& options) {
  absl::StatusOr<std::unique_ptr<UcxListener>> listener =
      ListenUcx("127.0.0.1", 0, options);
  INFO(listener.status().ToString());
  REQUIRE(listener.ok());
  // Connect returns before the listener accepts, as ferryd uses it.
  absl::StatusOr<std::unique_ptr<Channel>> sender = ConnectUcxChannel(
      "127.0.0.1", (*listener)->port(), (*listener)->worker_address(),
      TestDeadline(), options);
  absl::StatusOr<std::unique_ptr<Channel>> receiver =
      (*listener)->Accept(TestDeadline());
  INFO(receiver.status().ToString() << " / " << sender.status().ToString());
  REQUIRE(receiver.ok());
  REQUIRE(sender.ok());
  return ChannelPair{*std::move(sender), *std::move(receiver)};
}

ChannelPair OverTcp() {
  UcxChannelOptions options;
  options.transports = "tcp";
  return UcxPair(options);
}
FERRY_CHANNEL_CONFORMANCE_TESTS("ucx over tcp", OverTcp)

ChannelPair OverSharedMemory() {
  UcxChannelOptions options;
  options.transports = "sm";
  return UcxPair(options);
}
FERRY_CHANNEL_CONFORMANCE_TESTS("ucx over shared memory", OverSharedMemory)

// A rail's channel as ferryd opens it with --rails: its context limited to
// the rail's NIC (UCX_NET_DEVICES; "lo" here), the meeting connection
// from the rail's address.
ChannelPair OnARail() {
  UcxChannelOptions options;
  options.transports = "tcp";
  options.net_devices = "lo";
  options.socket.local_host = "127.0.0.1";
  return UcxPair(options);
}
FERRY_CHANNEL_CONFORMANCE_TESTS("ucx over tcp, a rail (lo only)", OnARail)

// Small segments cut boxes mid-row, with a connection token.
ChannelPair SmallSegmentsWithToken() {
  UcxChannelOptions options;
  options.transports = "tcp";
  options.segment_bytes = 1000;
  options.connection_token = "ferry-chan-0123456789abcdef";
  return UcxPair(options);
}
FERRY_CHANNEL_CONFORMANCE_TESTS("ucx, 1000-byte segments and a token",
                                SmallSegmentsWithToken)

TEST_CASE("ucx: a connection with the wrong token is refused, the next "
          "one with the right token accepted") {
  UcxChannelOptions options;
  options.transports = "tcp";
  options.connection_token = "right-token-0001";
  absl::StatusOr<std::unique_ptr<UcxListener>> listener =
      ListenUcx("127.0.0.1", 0, options);
  REQUIRE(listener.ok());
  UcxChannelOptions wrong = options;
  wrong.connection_token = "wrong-token-0001";
  // Connecting returns before the peer accepts (as a TCP connect does);
  // the intruder learns that it was hung up on once a bucket needs the
  // peer (a large one: the rendezvous waits for the receiver).
  absl::StatusOr<std::unique_ptr<Channel>> intruder = ConnectUcxChannel(
      "127.0.0.1", (*listener)->port(), (*listener)->worker_address(),
      TestDeadline(), wrong);
  REQUIRE(intruder.ok());
  const absl::Status refused = (*listener)->Accept(TestDeadline()).status();
  INFO(refused.ToString());
  CHECK(absl::IsPermissionDenied(refused));
  TestBucket b = testing::LargeBucket(71);
  absl::Status sent = (*intruder)->Send(b.SourceView(), TestDeadline());
  if (sent.ok()) sent = (*intruder)->Flush(TestDeadline());
  INFO(sent.ToString());
  CHECK(absl::IsUnavailable(sent));
  ChannelPair pair = UcxPair(options);
  CHECK(pair.sender != nullptr);
}

TEST_CASE("ucx: accept and connect fail cleanly") {
  UcxChannelOptions options;
  options.transports = "tcp";
  absl::StatusOr<std::unique_ptr<UcxListener>> listener =
      ListenUcx("127.0.0.1", 0, options);
  REQUIRE(listener.ok());
  const int port = (*listener)->port();
  const std::string address = (*listener)->worker_address();
  CHECK(!address.empty());
  CHECK(absl::IsDeadlineExceeded(
      (*listener)->Accept(absl::Now() + absl::Milliseconds(100)).status()));
  listener->reset();
  const absl::Status refused =
      ConnectUcxChannel("127.0.0.1", port, address, TestDeadline(), options)
          .status();
  INFO(refused.ToString());
  CHECK(absl::IsUnavailable(refused));
  UcxChannelOptions bogus;
  bogus.transports = "no-such-transport";
  const absl::Status none = ListenUcx("127.0.0.1", 0, bogus).status();
  INFO(none.ToString());
  CHECK(!none.ok());
  CHECK(none.message().find("no-such-transport") != std::string::npos);
}

TEST_CASE("ucx: a worker address of a size no peer sends is refused before "
          "UCX or the network sees it") {
  UcxChannelOptions options;
  options.transports = "tcp";
  // Port 1: nothing listens there, so only the size check can answer.
  for (const std::string& address :
       {std::string(), std::string((64 << 10) + 1, 'x')}) {
    const absl::Status s =
        ConnectUcxChannel("127.0.0.1", 1, address, TestDeadline(), options)
            .status();
    INFO(s.ToString());
    CHECK(absl::IsInvalidArgument(s));
    CHECK(s.message().find("worker address of") != std::string::npos);
  }
}

TEST_CASE("ucx: two ends that share no transport fail to connect, naming "
          "UCX's reason") {
  // The receiver's worker is reachable over shared memory only, the
  // sender's context has tcp only (docs/operations.md, "UCX between
  // nodes": both ends must share a transport).
  UcxChannelOptions receiving;
  receiving.transports = "sm";
  UcxChannelOptions sending;
  sending.transports = "tcp";
  absl::StatusOr<std::unique_ptr<UcxListener>> listener =
      ListenUcx("127.0.0.1", 0, receiving);
  REQUIRE(listener.ok());
  const absl::Status s =
      ConnectUcxChannel("127.0.0.1", (*listener)->port(),
                        (*listener)->worker_address(), TestDeadline(), sending)
          .status();
  INFO(s.ToString());
  CHECK(absl::IsUnavailable(s));
  CHECK(s.message().find("unreachable") != std::string::npos);
  CHECK(s.message().find("ucp_ep_create") != std::string::npos);
}

// ucx_peer in a process of its own: connects to `port` and sends buckets
// of the seeds given (see ucx_peer.cc).
pid_t StartPeer(const UcxListener& listener, const std::string& mode) {
  const std::string binary = "tests/transport/ucx_peer";
  const std::string port_arg = std::to_string(listener.port());
  const std::string address = absl::BytesToHexString(listener.worker_address());
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execl(binary.c_str(), binary.c_str(), port_arg.c_str(),
            address.c_str(), mode.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return pid;
}

int ExitCode(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST_CASE("ucx: sender and receiver in two processes") {
  UcxChannelOptions options;
  options.transports = "tcp";
  absl::StatusOr<std::unique_ptr<UcxListener>> listener =
      ListenUcx("127.0.0.1", 0, options);
  REQUIRE(listener.ok());
  const pid_t pid = StartPeer(**listener, "send");
  REQUIRE(pid > 0);
  absl::StatusOr<std::unique_ptr<Channel>> ch =
      (*listener)->Accept(TestDeadline());
  INFO(ch.status().ToString());
  REQUIRE(ch.ok());
  for (uint64_t seed = 200; seed < 220; ++seed) {
    TestBucket b = seed % 5 == 0 ? testing::LargeBucket(seed)
                                 : testing::RandomBucket(seed);
    const absl::Status s = (*ch)->Receive(b.DestinationView(), TestDeadline());
    INFO("seed " << seed << ": " << s.ToString());
    REQUIRE(s.ok());
    testing::CheckArrived(b);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  CHECK(ExitCode(status) == 0);
}

TEST_CASE("ucx: a sender killed mid-stream is UNAVAILABLE or DATA_LOSS "
          "at the receiver, not a hang") {
  UcxChannelOptions options;
  options.transports = "tcp";
  absl::StatusOr<std::unique_ptr<UcxListener>> listener =
      ListenUcx("127.0.0.1", 0, options);
  REQUIRE(listener.ok());
  const pid_t pid = StartPeer(**listener, "flood");
  REQUIRE(pid > 0);
  absl::StatusOr<std::unique_ptr<Channel>> ch =
      (*listener)->Accept(TestDeadline());
  REQUIRE(ch.ok());
  TestBucket first = testing::LargeBucket(300);
  REQUIRE((*ch)->Receive(first.DestinationView(), TestDeadline()).ok());
  ::kill(pid, SIGKILL);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  const absl::Time start = absl::Now();
  absl::Status s;
  // Buckets already in flight may still arrive; then the end.
  for (int i = 0; i < 100 && s.ok(); ++i) {
    TestBucket next = testing::LargeBucket(300);
    s = (*ch)->Receive(next.DestinationView(), TestDeadline());
  }
  INFO(s.ToString());
  CHECK((absl::IsUnavailable(s) || absl::IsDataLoss(s)));
  CHECK(absl::Now() - start < absl::Seconds(30));
}

}  // namespace
}  // namespace ferry

// The tcp backend: the conformance suite over loopback (sender and receiver
// on different threads), then what only a network channel has: two
// processes, a peer killed mid-bucket, deadlines on a stalled peer, and
// bytes from a peer that does not speak the format.
#include "transport/tcp/tcp_channel.h"

#include <signal.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "tests/transport/transport_conformance.h"
#include "transport/tcp/socket_io.h"
#include "transport/tcp/wire_format.h"

namespace ferry {
namespace {

using testing::ChannelPair;
using testing::TestBucket;
using testing::TestDeadline;

// Listener on an ephemeral port of `host` (loopback), one channel each
// way; the connection leaves from options.socket.local_host if set.
ChannelPair LoopbackPair(const TcpChannelOptions& options = {},
                         const std::string& host = "127.0.0.1") {
  TcpChannelOptions listening = options;
  listening.socket.local_host.clear();
  absl::StatusOr<std::unique_ptr<TcpListener>> listener =
      TcpListener::Listen(host, 0, listening);
  REQUIRE(listener.ok());
  // connect() completes against the backlog, so no thread is needed.
  absl::StatusOr<std::unique_ptr<Channel>> sender = ConnectTcpChannel(
      host, (*listener)->port(), TestDeadline(), options);
  REQUIRE(sender.ok());
  absl::StatusOr<std::unique_ptr<Channel>> receiver =
      (*listener)->Accept(TestDeadline());
  REQUIRE(receiver.ok());
  return ChannelPair{*std::move(sender), *std::move(receiver)};
}

FERRY_CHANNEL_CONFORMANCE_TESTS("tcp", [] { return LoopbackPair(); })

// Segments of 1000 bytes cut boxes mid-row and mid-unit-run (units of 18
// and 144 bytes do not divide 1000), and with the kernel's default buffer
// sizes.
ChannelPair SmallSegmentPair() {
  TcpChannelOptions options;
  options.segment_bytes = 1000;
  options.socket.buffer_bytes = 0;
  return LoopbackPair(options);
}
FERRY_CHANNEL_CONFORMANCE_TESTS("tcp, 1000-byte segments", SmallSegmentPair)

// Peer.OpenChannel's connection token, written before any framing.
ChannelPair TokenPair() {
  TcpChannelOptions options;
  options.connection_token = "ferry-chan-0123456789abcdef";
  return LoopbackPair(options);
}
FERRY_CHANNEL_CONFORMANCE_TESTS("tcp, connection token", TokenPair)

// A rail's channel as ferryd opens it with --rails: the listener on the
// receiver's rail address, the connection from the sender's, keepalive
// and TCP_USER_TIMEOUT armed on both ends.
ChannelPair RailPair() {
  TcpChannelOptions options;
  options.connection_token = "ferry-chan-rail";
  options.socket.dead_after = absl::Seconds(10);
  options.socket.local_host = "127.0.0.7";
  return LoopbackPair(options, "127.0.1.2");
}
FERRY_CHANNEL_CONFORMANCE_TESTS("tcp, a rail", RailPair)

TEST_CASE("tcp: a connection with the wrong token is refused, the next "
          "one with the right token accepted") {
  TcpChannelOptions options;
  options.connection_token = "right-token-0001";
  absl::StatusOr<std::unique_ptr<TcpListener>> listener =
      TcpListener::Listen("127.0.0.1", 0, options);
  REQUIRE(listener.ok());
  TcpChannelOptions wrong;
  wrong.connection_token = "wrong-token-0001";
  absl::StatusOr<std::unique_ptr<Channel>> intruder = ConnectTcpChannel(
      "127.0.0.1", (*listener)->port(), TestDeadline(), wrong);
  REQUIRE(intruder.ok());
  const absl::Status refused = (*listener)->Accept(TestDeadline()).status();
  INFO(refused.ToString());
  CHECK(absl::IsPermissionDenied(refused));
  absl::StatusOr<std::unique_ptr<Channel>> sender = ConnectTcpChannel(
      "127.0.0.1", (*listener)->port(), TestDeadline(), options);
  REQUIRE(sender.ok());
  absl::StatusOr<std::unique_ptr<Channel>> receiver =
      (*listener)->Accept(TestDeadline());
  REQUIRE(receiver.ok());
}

std::vector<uint8_t> Header(uint64_t id, uint64_t bytes) {
  std::vector<uint8_t> h(kBucketHeaderBytes);
  EncodeBucketHeader(BucketHeader{id, bytes}, h.data());
  return h;
}

std::vector<uint8_t> Trailer(uint64_t checksum) {
  std::vector<uint8_t> t(kBucketTrailerBytes);
  EncodeBucketTrailer(checksum, t.data());
  return t;
}

// A whole bucket as the wire carries it: header, payload, trailer.
std::vector<uint8_t> Wire(uint64_t id, const std::vector<uint8_t>& payload) {
  std::vector<uint8_t> wire = Header(id, payload.size());
  wire.insert(wire.end(), payload.begin(), payload.end());
  const std::vector<uint8_t> trailer =
      Trailer(ChecksumOf(payload.data(), payload.size()));
  wire.insert(wire.end(), trailer.begin(), trailer.end());
  return wire;
}

// A raw socket to the listener, for speaking (or mangling) the wire format
// by hand; and the channel the listener made of it.
struct RawPeer {
  std::unique_ptr<TcpListener> listener;
  ScopedFd raw;
  std::unique_ptr<Channel> channel;

  void Write(const std::vector<uint8_t>& bytes) {
    struct iovec iov = {const_cast<uint8_t*>(bytes.data()), bytes.size()};
    REQUIRE(WriteFull(raw.get(), &iov, 1, TestDeadline(), "raw peer").ok());
  }
};

RawPeer ConnectRawPeer() {
  RawPeer p;
  absl::StatusOr<std::unique_ptr<TcpListener>> listener =
      TcpListener::Listen("127.0.0.1", 0);
  REQUIRE(listener.ok());
  p.listener = *std::move(listener);
  absl::StatusOr<ScopedFd> raw =
      ConnectTcp("127.0.0.1", p.listener->port(), TestDeadline(), {});
  REQUIRE(raw.ok());
  p.raw = *std::move(raw);
  absl::StatusOr<std::unique_ptr<Channel>> channel =
      p.listener->Accept(TestDeadline());
  REQUIRE(channel.ok());
  p.channel = *std::move(channel);
  return p;
}

int ExitCode(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST_CASE("tcp: a listener on port 0 reports the ephemeral port it bound") {
  absl::StatusOr<std::unique_ptr<TcpListener>> a =
      TcpListener::Listen("127.0.0.1", 0);
  absl::StatusOr<std::unique_ptr<TcpListener>> b =
      TcpListener::Listen("127.0.0.1", 0);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK((*a)->port() > 0);
  CHECK((*a)->port() != (*b)->port());
  // Binding a port in use is an error naming the call.
  absl::StatusOr<std::unique_ptr<TcpListener>> again =
      TcpListener::Listen("127.0.0.1", (*a)->port());
  INFO(again.status().ToString());
  CHECK(!again.ok());
  CHECK(again.status().message().find("bind(") != std::string::npos);
}

TEST_CASE("tcp: accept and connect fail cleanly") {
  absl::StatusOr<std::unique_ptr<TcpListener>> listener =
      TcpListener::Listen("127.0.0.1", 0);
  REQUIRE(listener.ok());
  const int port = (*listener)->port();
  const absl::Status none =
      (*listener)->Accept(absl::Now() + absl::Milliseconds(100)).status();
  INFO(none.ToString());
  CHECK(absl::IsDeadlineExceeded(none));
  listener->reset();  // nobody listens there now
  const absl::Status refused =
      ConnectTcpChannel("127.0.0.1", port, TestDeadline()).status();
  INFO(refused.ToString());
  CHECK(absl::IsUnavailable(refused));
  CHECK(refused.message().find("connect(127.0.0.1:") != std::string::npos);
  CHECK(absl::IsInvalidArgument(
      ConnectTcpChannel("127.0.0.1", 70000, TestDeadline()).status()));
}

TEST_CASE("tcp: the bytes on the wire are the documented format") {
  RawPeer p = ConnectRawPeer();
  TestBucket b = testing::RandomBucket(71);
  // The accepted channel sends; the raw socket reads what it wrote.
  REQUIRE(p.channel->Send(b.SourceView(), TestDeadline()).ok());
  REQUIRE(p.channel->Flush(TestDeadline()).ok());
  const std::vector<uint8_t> payload = testing::ExpectedPacked(b);
  std::vector<uint8_t> wire(kBucketHeaderBytes + payload.size() +
                            kBucketTrailerBytes);
  size_t got = 0;
  REQUIRE(ReadFull(p.raw.get(), wire.data(), wire.size(), TestDeadline(),
                   "raw peer", &got)
              .ok());
  const std::vector<uint8_t> header = Header(b.id, payload.size());
  CHECK(std::equal(header.begin(), header.end(), wire.begin()));
  CHECK(std::memcmp(wire.data(), "FRY2", 4) == 0);
  CHECK(std::equal(payload.begin(), payload.end(),
                   wire.begin() + kBucketHeaderBytes));
  const std::vector<uint8_t> trailer =
      Trailer(ChecksumOf(payload.data(), payload.size()));
  CHECK(std::equal(trailer.begin(), trailer.end(),
                   wire.end() - kBucketTrailerBytes));
}

TEST_CASE("tcp: sender and receiver in two processes") {
  absl::StatusOr<std::unique_ptr<TcpListener>> listener =
      TcpListener::Listen("127.0.0.1", 0);
  REQUIRE(listener.ok());
  const int port = (*listener)->port();
  // No thread runs in this process now (earlier tests joined theirs), so
  // the child may use anything; it reports through its exit code.
  const pid_t pid = ::fork();
  if (pid == 0) {
    absl::StatusOr<std::unique_ptr<Channel>> ch =
        ConnectTcpChannel("127.0.0.1", port, TestDeadline());
    if (!ch.ok()) ::_exit(1);
    for (uint64_t seed = 200; seed < 220; ++seed) {
      TestBucket b = seed % 5 == 0 ? testing::LargeBucket(seed)
                                   : testing::RandomBucket(seed);
      if (!(*ch)->Send(b.SourceView(), TestDeadline()).ok()) ::_exit(2);
    }
    if (!(*ch)->Flush(TestDeadline()).ok()) ::_exit(3);
    ::_exit(0);
  }
  REQUIRE(pid > 0);
  absl::StatusOr<std::unique_ptr<Channel>> ch =
      (*listener)->Accept(TestDeadline());
  REQUIRE(ch.ok());
  for (uint64_t seed = 200; seed < 220; ++seed) {
    TestBucket b = seed % 5 == 0 ? testing::LargeBucket(seed)
                                 : testing::RandomBucket(seed);
    const absl::Status s = (*ch)->Receive(b.DestinationView(), TestDeadline());
    INFO("bucket " << seed << ": " << s.ToString());
    REQUIRE(s.ok());
    testing::CheckArrived(b);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  CHECK(ExitCode(status) == 0);
}

TEST_CASE("tcp: a sender killed mid-bucket is UNAVAILABLE at the receiver") {
  absl::StatusOr<std::unique_ptr<TcpListener>> listener =
      TcpListener::Listen("127.0.0.1", 0);
  REQUIRE(listener.ok());
  const int port = (*listener)->port();
  TestBucket b = testing::LargeBucket(81);
  const std::vector<uint8_t> payload = testing::ExpectedPacked(b);
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Header and the first half of the payload, then wait to be killed.
    absl::StatusOr<ScopedFd> fd = ConnectTcp("127.0.0.1", port, TestDeadline(), {});
    if (!fd.ok()) ::_exit(1);
    std::vector<uint8_t> wire = Header(b.id, payload.size());
    wire.insert(wire.end(), payload.begin(),
                payload.begin() + payload.size() / 2);
    struct iovec iov = {wire.data(), wire.size()};
    if (!WriteFull(fd->get(), &iov, 1, TestDeadline(), "child").ok()) {
      ::_exit(2);
    }
    if (::write(ready[1], "x", 1) != 1) ::_exit(3);
    ::pause();
    ::_exit(4);
  }
  REQUIRE(pid > 0);
  absl::StatusOr<std::unique_ptr<Channel>> ch =
      (*listener)->Accept(TestDeadline());
  REQUIRE(ch.ok());
  // The receiver is already reading when the sender dies.
  absl::Status status;
  std::thread receiver([&] {
    status = (*ch)->Receive(b.DestinationView(), TestDeadline());
  });
  char byte;
  REQUIRE(::read(ready[0], &byte, 1) == 1);
  ::kill(pid, SIGKILL);
  int wait_status = 0;
  ::waitpid(pid, &wait_status, 0);
  receiver.join();
  ::close(ready[0]);
  ::close(ready[1]);
  INFO(status.ToString());
  CHECK(absl::IsUnavailable(status));
  CHECK(status.message().find("bucket 81") != std::string::npos);
  // Broken for good.
  CHECK(absl::IsUnavailable(
      (*ch)->Receive(b.DestinationView(), TestDeadline())));
}

TEST_CASE("tcp: a TcpChannel sender killed mid-bucket is UNAVAILABLE") {
  absl::StatusOr<std::unique_ptr<TcpListener>> listener =
      TcpListener::Listen("127.0.0.1", 0);
  REQUIRE(listener.ok());
  const int port = (*listener)->port();
  const pid_t pid = ::fork();
  if (pid == 0) {
    absl::StatusOr<std::unique_ptr<Channel>> ch =
        ConnectTcpChannel("127.0.0.1", port, TestDeadline());
    if (!ch.ok()) ::_exit(1);
    // Bigger than both socket buffers together: blocks part-way, since
    // the parent does not read until the child is dead.
    for (uint64_t seed = 90; seed < 93; ++seed) {
      TestBucket b = testing::LargeBucket(seed);
      if (!(*ch)->Send(b.SourceView(), TestDeadline()).ok()) ::_exit(2);
    }
    (*ch)->Flush(TestDeadline()).IgnoreError();
    ::_exit(0);
  }
  REQUIRE(pid > 0);
  absl::StatusOr<std::unique_ptr<Channel>> ch =
      (*listener)->Accept(TestDeadline());
  REQUIRE(ch.ok());
  ::usleep(500 * 1000);  // the child packs and fills the socket buffers
  ::kill(pid, SIGKILL);
  int wait_status = 0;
  ::waitpid(pid, &wait_status, 0);
  CHECK(ExitCode(wait_status) == 128 + SIGKILL);  // it was still sending
  absl::Status status;
  for (uint64_t seed = 90; seed < 93 && status.ok(); ++seed) {
    TestBucket b = testing::LargeBucket(seed);
    status = (*ch)->Receive(b.DestinationView(), TestDeadline());
  }
  INFO(status.ToString());
  CHECK(absl::IsUnavailable(status));
}

TEST_CASE("tcp: a receiver that is gone is UNAVAILABLE at the sender") {
  ChannelPair pair = LoopbackPair();
  pair.receiver.reset();  // closes with nothing read: the kernel resets
  TestBucket b = testing::LargeBucket(95);
  absl::Status s;
  for (int i = 0; i < 20 && s.ok(); ++i) {
    s = pair.sender->Send(b.SourceView(), TestDeadline());
  }
  if (s.ok()) s = pair.sender->Flush(TestDeadline());
  INFO(s.ToString());
  CHECK(absl::IsUnavailable(s));
  CHECK(s.message().find("sendmsg(") != std::string::npos);
  // Sticky.
  CHECK(absl::IsUnavailable(pair.sender->Send(b.SourceView(), TestDeadline())));
}

TEST_CASE("tcp: a stalled receiver makes the sender's deadline expire") {
  ChannelPair pair = LoopbackPair();  // the receiver never reads
  TestBucket b = testing::LargeBucket(96);
  const absl::Time deadline = absl::Now() + absl::Milliseconds(300);
  absl::Status s;
  for (int i = 0; i < 4 && s.ok(); ++i) s = pair.sender->Send(b.SourceView(), deadline);
  if (s.ok()) s = pair.sender->Flush(absl::Now() + absl::Seconds(20));
  INFO(s.ToString());
  CHECK(absl::IsDeadlineExceeded(s));
  CHECK(absl::Now() - deadline < absl::Seconds(10));
}

TEST_CASE("tcp: a deadline mid-header resumes; mid-payload it breaks") {
  RawPeer p = ConnectRawPeer();
  TestBucket b = testing::RandomBucket(101);
  const std::vector<uint8_t> payload = testing::ExpectedPacked(b);
  const std::vector<uint8_t> wire = Wire(b.id, payload);
  // 10 bytes of header, then silence: DEADLINE_EXCEEDED, nothing lost.
  p.Write(std::vector<uint8_t>(wire.begin(), wire.begin() + 10));
  absl::Status s = p.channel->Receive(b.DestinationView(),
                                      absl::Now() + absl::Milliseconds(100));
  INFO(s.ToString());
  CHECK(absl::IsDeadlineExceeded(s));
  p.Write(std::vector<uint8_t>(wire.begin() + 10, wire.end()));
  s = p.channel->Receive(b.DestinationView(), TestDeadline());
  INFO(s.ToString());
  CHECK(s.ok());
  testing::CheckArrived(b);

  // A whole header and part of the payload, then silence: the stream is
  // out of step, so the channel stays broken.
  REQUIRE(payload.size() > 10);
  b.FillDestinationSentinel();
  p.Write(std::vector<uint8_t>(wire.begin(), wire.end() - 10));
  s = p.channel->Receive(b.DestinationView(),
                         absl::Now() + absl::Milliseconds(100));
  CHECK(absl::IsDeadlineExceeded(s));
  p.Write(std::vector<uint8_t>(wire.end() - 10, wire.end()));
  s = p.channel->Receive(b.DestinationView(), TestDeadline());
  INFO(s.ToString());
  CHECK(absl::IsDeadlineExceeded(s));
  CHECK(s.message().find("broken") != std::string::npos);
}

TEST_CASE("tcp: a corrupted payload is DATA_LOSS (checksum)") {
  RawPeer p = ConnectRawPeer();
  TestBucket b = testing::LargeBucket(111);
  std::vector<uint8_t> payload = testing::ExpectedPacked(b);
  std::vector<uint8_t> wire = Header(b.id, payload.size());
  const std::vector<uint8_t> trailer =
      Trailer(ChecksumOf(payload.data(), payload.size()));
  payload[payload.size() / 3] ^= 0x10;
  wire.insert(wire.end(), payload.begin(), payload.end());
  wire.insert(wire.end(), trailer.begin(), trailer.end());
  std::thread writer([&] { p.Write(wire); });
  const absl::Status s = p.channel->Receive(b.DestinationView(), TestDeadline());
  writer.join();
  INFO(s.ToString());
  CHECK(absl::IsDataLoss(s));
  CHECK(s.message().find("checksum") != std::string::npos);
}

TEST_CASE("tcp: garbage from the peer is DATA_LOSS, never a crash") {
  SECTION("random bytes") {
    RawPeer p = ConnectRawPeer();
    testing::TestRng rng(5);
    std::vector<uint8_t> junk(4096);
    for (uint8_t& x : junk) x = static_cast<uint8_t>(rng.Next());
    p.Write(junk);
    TestBucket b = testing::RandomBucket(121);
    const absl::Status s = p.channel->Receive(b.DestinationView(), TestDeadline());
    INFO(s.ToString());
    CHECK(absl::IsDataLoss(s));
    CHECK(s.message().find("not a ferry bucket header") != std::string::npos);
  }
  SECTION("a daemon of the older format (FRY1) is named") {
    RawPeer p = ConnectRawPeer();
    TestBucket b = testing::RandomBucket(124);
    std::vector<uint8_t> old_header = Header(b.id, b.bytes());
    std::memcpy(old_header.data(), "FRY1", 4);
    p.Write(old_header);
    const absl::Status s = p.channel->Receive(b.DestinationView(), TestDeadline());
    INFO(s.ToString());
    CHECK(absl::IsDataLoss(s));
    CHECK(s.message().find("FRY1") != std::string::npos);
    CHECK(s.message().find("same ferryd build") != std::string::npos);
  }
  SECTION("a header claiming an absurd size") {
    RawPeer p = ConnectRawPeer();
    TestBucket b = testing::RandomBucket(122);
    p.Write(Header(b.id, uint64_t{1} << 62));
    const absl::Status s = p.channel->Receive(b.DestinationView(), TestDeadline());
    INFO(s.ToString());
    CHECK(absl::IsDataLoss(s));
  }
  SECTION("a header, then the peer hangs up") {
    RawPeer p = ConnectRawPeer();
    TestBucket b = testing::RandomBucket(123);
    p.Write(Header(b.id, b.bytes()));
    p.raw = ScopedFd();
    const absl::Status s = p.channel->Receive(b.DestinationView(), TestDeadline());
    INFO(s.ToString());
    CHECK((absl::IsUnavailable(s) || (b.bytes() == 0 && absl::IsDataLoss(s))));
  }
}

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

int IntOption(int fd, int level, int name) {
  int value = -1;
  socklen_t len = sizeof(value);
  REQUIRE(::getsockopt(fd, level, name, &value, &len) == 0);
  return value;
}

TEST_CASE("tcp: a connection leaves from local_host (a rail's address), and "
          "dead_after arms keepalive and TCP_USER_TIMEOUT on both ends") {
  TcpSocketOptions options;
  options.local_host = "127.0.0.3";
  options.dead_after = absl::Milliseconds(2500);
  int port = 0;
  absl::StatusOr<ScopedFd> listener = ListenTcp("127.0.1.9", 0, options, &port);
  REQUIRE(listener.ok());
  absl::StatusOr<ScopedFd> fd =
      ConnectTcp("127.0.1.9", port, TestDeadline(), options);
  REQUIRE(fd.ok());
  std::string peer;
  absl::StatusOr<ScopedFd> accepted =
      AcceptTcp(listener->get(), TestDeadline(), &peer);
  REQUIRE(accepted.ok());
  INFO(peer);
  CHECK(absl::StartsWith(peer, "127.0.0.3:"));
  for (int f : {fd->get(), accepted->get()}) {
    CHECK(IntOption(f, SOL_SOCKET, SO_KEEPALIVE) == 1);
    CHECK(IntOption(f, IPPROTO_TCP, TCP_KEEPIDLE) == 1);
    CHECK(IntOption(f, IPPROTO_TCP, TCP_USER_TIMEOUT) == 2500);
  }
  // Without: the kernel's defaults.
  absl::StatusOr<ScopedFd> plain = ConnectTcp("127.0.1.9", port, TestDeadline(), {});
  REQUIRE(plain.ok());
  CHECK(IntOption(plain->get(), SOL_SOCKET, SO_KEEPALIVE) == 0);
  CHECK(IntOption(plain->get(), IPPROTO_TCP, TCP_USER_TIMEOUT) == 0);
  // An address that is not this host's is refused by name.
  options.local_host = "192.0.2.77";
  absl::StatusOr<ScopedFd> bad =
      ConnectTcp("127.0.1.9", port, TestDeadline(), options);
  REQUIRE_FALSE(bad.ok());
  INFO(bad.status());
  CHECK(absl::StrContains(bad.status().message(), "bind(192.0.2.77)"));
}

}  // namespace
}  // namespace ferry

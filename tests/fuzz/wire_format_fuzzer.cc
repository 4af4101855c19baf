// wire_format_fuzzer: the receiving end of a tcp channel
// (transport/tcp/) on whatever bytes a peer sends.
//
// Each input is a scenario (tests/fuzz/wire_input.h): the buckets the
// receiver expects and where their boxes land, and the bytes a peer writes
// on the connection after the connection token. The fuzzer connects to a
// real TcpListener on 127.0.0.1 (one per segment size, made once), writes
// the token and the bytes, half-closes, and has the accepted channel
// Receive the expected buckets until one fails. It also runs the wire
// format's own functions on the bytes: DecodeBucketHeader (and
// EncodeBucketHeader of what it decodes) and PayloadChecksum under an
// arbitrary split of the payload.
//
// Checked beyond "no crash": a wrong token is never accepted; a receive
// never waits once the peer has closed; a bucket that is received whole is
// what the peer sent (its header's id, size and checksum) and lands exactly
// where the view says, nothing else written; an error is sticky; decoding
// and encoding a header gives the same 24 bytes; the checksum does not
// depend on how the payload is split.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/geometry.h"
#include "tests/fuzz/wire_input.h"
#include "transport/tcp/tcp_channel.h"
#include "transport/tcp/wire_format.h"

namespace ferry {
namespace {

using fuzz::BoxSpec;
using fuzz::BucketSpec;
using fuzz::Layout;
using fuzz::WireScenario;

// More than a loopback socket buffers without a reader is not written.
constexpr size_t kMaxStreamBytes = 128 << 10;
constexpr uint8_t kUntouched = 0xAB;

[[noreturn]] void Broken(const std::string& what) {
  std::fprintf(stderr, "wire_format_fuzzer: invariant broken: %s\n",
               what.c_str());
  std::abort();
}

TcpListener& ListenerFor(int choice) {
  static std::unique_ptr<TcpListener> listeners[4];
  if (listeners[choice] == nullptr) {
    TcpChannelOptions options;
    options.segment_bytes = fuzz::kSegmentBytes[choice];
    options.connection_token = fuzz::kConnectionToken;
    absl::StatusOr<std::unique_ptr<TcpListener>> l =
        TcpListener::Listen("127.0.0.1", 0, options);
    if (!l.ok()) Broken(std::string(l.status().message()));
    listeners[choice] = *std::move(l);
  }
  return *listeners[choice];
}

// A box's destination in this process: its memory, filled with kUntouched.
struct Destination {
  std::vector<uint8_t> memory;
  Dims extent;
  Dims strides;  // units
  int64_t unit_bytes = 1;
  bool injective = true;
};

Destination MakeDestination(const BoxSpec& spec) {
  Destination d;
  d.unit_bytes = spec.unit_bytes;
  d.extent.assign(spec.extent.begin(), spec.extent.end());
  const size_t n = d.extent.size();
  d.strides.assign(n, 0);
  switch (spec.layout) {
    case Layout::kRowMajor:
      d.strides = RowMajorStrides(d.extent);
      break;
    case Layout::kPadded:
      d.strides[n - 1] = 1;
      for (size_t i = n - 1; i > 0; --i) {
        d.strides[i - 1] = d.strides[i] * (d.extent[i] + 1);
      }
      break;
    case Layout::kColumnMajor:
      d.strides[0] = 1;
      for (size_t i = 1; i < n; ++i) {
        d.strides[i] = d.strides[i - 1] * std::max<int64_t>(1, d.extent[i - 1]);
      }
      break;
    case Layout::kBroadcast:
      d.injective = false;
      break;
  }
  int64_t last = 0;  // highest unit index touched
  bool empty = false;
  for (size_t i = 0; i < n; ++i) {
    if (d.extent[i] == 0) empty = true;
    else last += (d.extent[i] - 1) * d.strides[i];
  }
  d.memory.assign(empty ? 1 : (last + 1) * d.unit_bytes, kUntouched);
  return d;
}

// What `d` must hold after receiving `payload` (its box's wire bytes).
std::vector<uint8_t> Expected(const Destination& d, const uint8_t* payload) {
  std::vector<uint8_t> out(d.memory.size(), kUntouched);
  const size_t n = d.extent.size();
  int64_t units = 1;
  for (int64_t e : d.extent) units *= e;
  Dims index(n, 0);
  for (int64_t u = 0; u < units; ++u) {
    int64_t at = 0;
    for (size_t i = 0; i < n; ++i) at += index[i] * d.strides[i];
    std::memcpy(out.data() + at * d.unit_bytes, payload + u * d.unit_bytes,
                static_cast<size_t>(d.unit_bytes));
    for (size_t i = n; i-- > 0;) {
      if (++index[i] < d.extent[i]) break;
      index[i] = 0;
    }
  }
  return out;
}

// The wire format's functions on their own.
void CheckWireFormat(const std::string& stream) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(stream.data());
  if (stream.size() >= kBucketHeaderBytes) {
    absl::StatusOr<BucketHeader> h = DecodeBucketHeader(bytes);
    if (h.ok()) {
      uint8_t again[kBucketHeaderBytes];
      EncodeBucketHeader(*h, again);
      if (std::memcmp(again, bytes, kBucketHeaderBytes) != 0) {
        Broken("EncodeBucketHeader(DecodeBucketHeader(x)) != x");
      }
    } else if (!absl::IsDataLoss(h.status())) {
      Broken("DecodeBucketHeader failed with a code other than DATA_LOSS");
    }
  }
  PayloadChecksum split;
  size_t at = 0;
  for (size_t k = 0; at < stream.size(); ++k) {
    const size_t step = 1 + bytes[k % stream.size()] % 67;
    const size_t n = std::min(step, stream.size() - at);
    split.Update(bytes + at, n);
    at += n;
  }
  if (split.Finish() != ChecksumOf(bytes, stream.size())) {
    Broken("PayloadChecksum depends on how the payload is split");
  }
}

// A blocking loopback connection to `port` that has sent `bytes`, and
// half-closed when `half_close`.
int SendAll(int port, const std::string& bytes, bool half_close) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) Broken("socket()");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // libFuzzer's SIGALRM (its -timeout watchdog) interrupts blocking calls:
  // an interrupted connect goes on by itself, and send is retried.
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int error = errno;
    if (error == EINTR) {
      pollfd p = {fd, POLLOUT, 0};
      while (::poll(&p, 1, -1) < 0 && errno == EINTR) {
      }
      socklen_t len = sizeof(error);
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len);
    }
    if (error != 0) {
      Broken(absl::StrCat("connect() to the fuzzer's own listener: ",
                          std::strerror(error)));
    }
  }
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + done, bytes.size() - done,
                             MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      Broken(absl::StrCat("send() to the fuzzer's own listener: ",
                          std::strerror(errno)));
    }
    done += static_cast<size_t>(n);
  }
  if (half_close) ::shutdown(fd, SHUT_WR);
  return fd;
}

// Closes with a reset, after the channel has read what it wanted: neither
// end keeps a TIME_WAIT entry, so millions of runs do not exhaust ports.
// (The client half-closes only when the token is right: a listener that
// refuses a token closes first, and a client that had sent its FIN first
// would then wait in TIME_WAIT.)
void Reset(int fd) {
  linger l{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  ::close(fd);
}

void RunChannel(const WireScenario& s) {
  TcpListener& listener = ListenerFor(s.segment_choice);
  std::string token = fuzz::kConnectionToken;
  if (s.wrong_token) token[token.size() / 2] ^= 0x20;
  const std::string stream = s.stream.substr(0, kMaxStreamBytes);
  const int client =
      SendAll(listener.port(), token + stream, /*half_close=*/!s.wrong_token);
  const absl::Time deadline = absl::Now() + absl::Seconds(3);
  absl::StatusOr<std::unique_ptr<Channel>> channel = listener.Accept(deadline);
  if (s.wrong_token) {
    if (channel.ok()) Broken("a wrong connection token was accepted");
    Reset(client);
    return;
  }
  if (!channel.ok()) {
    Broken(absl::StrCat("the right token was refused: ",
                        channel.status().ToString()));
  }
  size_t at = 0;  // where the next bucket starts in `stream`
  bool failed = false;
  for (const BucketSpec& spec : s.buckets) {
    std::vector<Destination> dest;
    for (const BoxSpec& box : spec.boxes) dest.push_back(MakeDestination(box));
    BucketView view;
    view.id = spec.id;
    for (Destination& d : dest) {
      view.regions.push_back(RegionView{d.memory.data(), d.strides});
      view.extents.push_back(d.extent);
      view.unit_bytes.push_back(d.unit_bytes);
      view.bytes += Volume(d.extent) * d.unit_bytes;
    }
    const absl::Time started = absl::Now();
    absl::Status r = (*channel)->Receive(view, started + absl::Seconds(3));
    if (failed) {
      if (r.ok()) Broken("a broken channel received another bucket");
      break;
    }
    if (absl::IsDeadlineExceeded(r)) {
      Broken("Receive waited for bytes after the peer closed: " + r.ToString());
    }
    if (!r.ok()) {
      failed = true;  // one more Receive must fail too
      continue;
    }
    // Received: the peer sent exactly this bucket.
    if (stream.size() - at <
        kBucketHeaderBytes + view.bytes + kBucketTrailerBytes) {
      Broken("received a bucket from fewer bytes than it has");
    }
    const auto* head = reinterpret_cast<const uint8_t*>(stream.data()) + at;
    absl::StatusOr<BucketHeader> h = DecodeBucketHeader(head);
    const uint8_t* payload = head + kBucketHeaderBytes;
    if (!h.ok() || h->bucket_id != spec.id ||
        h->payload_bytes != static_cast<uint64_t>(view.bytes) ||
        DecodeBucketTrailer(payload + view.bytes) !=
            ChecksumOf(payload, static_cast<size_t>(view.bytes))) {
      Broken("received a bucket whose framing the peer did not send");
    }
    for (const Destination& d : dest) {
      if (d.injective && Expected(d, payload) != d.memory) {
        Broken("received bytes did not land where the view says");
      }
      payload += Volume(d.extent) * d.unit_bytes;
    }
    at += kBucketHeaderBytes + static_cast<size_t>(view.bytes) +
          kBucketTrailerBytes;
  }
  Reset(client);
}

}  // namespace
}  // namespace ferry

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ferry;
  const WireScenario s = fuzz::DecodeScenario(data, size);
  CheckWireFormat(s.stream);
  RunChannel(s);
  return 0;
}

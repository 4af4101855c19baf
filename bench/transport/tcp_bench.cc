// Loopback TCP throughput: plain send/recv of a byte stream vs a TcpChannel
// carrying the same bytes as 64 MiB buckets (pack + checksum + header on
// the sender, checksum + unpack on the receiver), sender and receiver on
// two threads of one process.
//
// Two bucket shapes: four contiguous 16 MiB boxes, and two TP row shards
// of a [4096, 16384] bf16 matrix (4096 strided 8 KiB runs each on the
// sender, contiguous on the receiver). The channel pair is connected once
// and reused, as a daemon keeps its connections (its staging is then
// already faulted in). The raw stream keeps the kernel's default socket
// options. Runs are interleaved and the best of each is kept, so that load
// from other processes hits all three alike. On a 2-core machine loopback
// TCP is CPU-bound (each byte is copied by the kernel on both sides), so
// the channel's extra pass (pack) and checksums show fully in the ratio.
// Target: >= 0.7x the raw stream.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "transport/tcp/tcp_channel.h"
#include "transport/transport.h"

namespace ferry {
namespace {

constexpr int64_t kBucketBytes = int64_t{64} << 20;
constexpr int kBuckets = 24;  // 1.5 GiB per run
constexpr int kRepeats = 4;

[[noreturn]] void Die(const char* what) {
  std::perror(what);
  std::exit(1);
}

void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    std::exit(1);
  }
}

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// Plain blocking sockets with the kernel's defaults: what a hand-written
// stream gets. Returns seconds to move kBuckets * kBucketBytes.
double RawStream(uint8_t* src, uint8_t* dst) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  if (listener < 0) Die("socket");
  struct sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (::bind(listener, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      ::listen(listener, 1) != 0 ||
      ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    Die("bind/listen");
  }
  const int out = ::socket(AF_INET, SOCK_STREAM, 0);
  if (::connect(out, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    Die("connect");
  }
  const int in = ::accept(listener, nullptr, nullptr);
  if (in < 0) Die("accept");
  const int64_t total = kBuckets * kBucketBytes;
  const auto start = std::chrono::steady_clock::now();
  std::thread sender([&] {
    for (int64_t sent = 0; sent < total;) {
      const int64_t at = sent % kBucketBytes;
      const ssize_t n = ::send(out, src + at, kBucketBytes - at, 0);
      if (n <= 0) Die("send");
      sent += n;
    }
  });
  for (int64_t got = 0; got < total;) {
    const int64_t at = got % kBucketBytes;
    const ssize_t n = ::recv(in, dst + at, kBucketBytes - at, 0);
    if (n <= 0) Die("recv");
    got += n;
  }
  const double s = Seconds(std::chrono::steady_clock::now() - start);
  sender.join();
  ::close(in);
  ::close(out);
  ::close(listener);
  return s;
}

struct BucketPair {
  BucketView send, receive;
};

// Four contiguous 16 MiB boxes of 2-byte units.
BucketPair ContiguousBuckets(uint8_t* src, uint8_t* dst) {
  BucketPair p;
  for (int i = 0; i < 4; ++i) {
    const int64_t units = kBucketBytes / 4 / 2;
    p.send.regions.push_back(RegionView{src + i * (kBucketBytes / 4), {1}});
    p.receive.regions.push_back(RegionView{dst + i * (kBucketBytes / 4), {1}});
    for (BucketView* v : {&p.send, &p.receive}) {
      v->extents.push_back({units});
      v->unit_bytes.push_back(2);
    }
  }
  p.send.bytes = p.receive.bytes = kBucketBytes;
  return p;
}

// Shards 0 and 1 of 4 along dim 1 of a [4096, 16384] bf16 matrix in src.
BucketPair RowShardBuckets(uint8_t* src, uint8_t* dst) {
  const int64_t rows = 4096, cols = 16384, width = cols / 4;
  BucketPair p;
  for (int shard = 0; shard < 2; ++shard) {
    p.send.regions.push_back(RegionView{src + shard * width * 2, {cols, 1}});
    p.receive.regions.push_back(
        RegionView{dst + shard * rows * width * 2, {width, 1}});
    for (BucketView* v : {&p.send, &p.receive}) {
      v->extents.push_back({rows, width});
      v->unit_bytes.push_back(2);
    }
  }
  p.send.bytes = p.receive.bytes = 2 * rows * width * 2;
  return p;
}

// A connected pair, kept across runs as a daemon keeps its connections
// (and so its staging, already faulted in).
struct Link {
  std::unique_ptr<Channel> out, in;
};

Link Connect() {
  absl::StatusOr<std::unique_ptr<TcpListener>> listener =
      TcpListener::Listen("127.0.0.1", 0);
  Check(listener.status());
  const absl::Time deadline = absl::Now() + absl::Minutes(1);
  absl::StatusOr<std::unique_ptr<Channel>> out =
      ConnectTcpChannel("127.0.0.1", (*listener)->port(), deadline);
  Check(out.status());
  absl::StatusOr<std::unique_ptr<Channel>> in = (*listener)->Accept(deadline);
  Check(in.status());
  return Link{*std::move(out), *std::move(in)};
}

double ChannelStream(Link& link, BucketPair buckets, int count) {
  const absl::Time deadline = absl::Now() + absl::Minutes(5);
  static uint64_t next_id = 0;
  const uint64_t first_id = next_id;
  next_id += count;
  const auto start = std::chrono::steady_clock::now();
  std::thread sender([&] {
    for (int k = 0; k < count; ++k) {
      buckets.send.id = first_id + k;
      Check(link.out->Send(buckets.send, deadline));
    }
    Check(link.out->Flush(deadline));
  });
  for (int k = 0; k < count; ++k) {
    buckets.receive.id = first_id + k;
    Check(link.in->Receive(buckets.receive, deadline));
  }
  const double s = Seconds(std::chrono::steady_clock::now() - start);
  sender.join();
  return s;
}

int Main() {
  // The row-shard source is a 128 MiB matrix; the rest fit in 64 MiB.
  std::unique_ptr<uint8_t[]> src(new uint8_t[2 * kBucketBytes]);
  std::unique_ptr<uint8_t[]> dst(new uint8_t[kBucketBytes]);
  std::memset(src.get(), 1, 2 * kBucketBytes);
  std::memset(dst.get(), 2, kBucketBytes);
  const double bytes = double(kBuckets) * kBucketBytes;
  Link link = Connect();
  const BucketPair contiguous_buckets = ContiguousBuckets(src.get(), dst.get());
  const BucketPair row_shard_buckets = RowShardBuckets(src.get(), dst.get());
  ChannelStream(link, contiguous_buckets, 2);  // warm-up: staging faulted in
  double raw = 1e30, contiguous = 1e30, row_shards = 1e30;
  for (int i = 0; i < kRepeats; ++i) {
    raw = std::min(raw, RawStream(src.get(), dst.get()));
    contiguous = std::min(contiguous,
                          ChannelStream(link, contiguous_buckets, kBuckets));
    row_shards = std::min(row_shards,
                          ChannelStream(link, row_shard_buckets, kBuckets));
  }
  const double raw_gbs = bytes / raw / 1e9;
  std::printf("%.2f GiB over loopback, %u hardware threads\n",
              bytes / double(int64_t{1} << 30),
              std::thread::hardware_concurrency());
  std::printf("raw send/recv stream                  %6.2f GB/s\n", raw_gbs);
  for (auto [name, s] : {std::pair<const char*, double>{
                             "TcpChannel, 64 MiB contiguous boxes", contiguous},
                         {"TcpChannel, 64 MiB TP row shards   ", row_shards}}) {
    const double gbs = bytes / s / 1e9;
    std::printf("%s  %6.2f GB/s, ratio %.2fx (target >= 0.7x)\n", name, gbs,
                gbs / raw_gbs);
  }
  return 0;
}

}  // namespace
}  // namespace ferry

int main() { return ferry::Main(); }

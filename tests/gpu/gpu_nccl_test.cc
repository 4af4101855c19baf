// The nccl backend on one GPU: a one-rank communicator, and a loopback
// channel pair on it (the receiver issues the grouped self send/recv)
// moving random buckets from device source buffers into device destination
// buffers through pack -> NCCL -> unpack, checked byte by byte on the host;
// then the channel's failure contract, and deadlines that abort instead of
// hanging.
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <memory>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "cuda/device.h"
#include "cuda/nccl/nccl_channel.h"
#include "cuda/nccl/nccl_communicator.h"
#include "tests/gpu/device_buffers.h"

namespace ferry {
namespace {

using gpu::NcclCommunicator;
using gpu_testing::DeviceBucket;

absl::Time Deadline() { return absl::Now() + absl::Seconds(60); }

std::unique_ptr<NcclCommunicator> SelfCommunicator() {
  absl::StatusOr<std::string> id = gpu::NewNcclUniqueId();
  INFO(id.status().ToString());
  REQUIRE(id.ok());
  gpu::NcclCommunicatorOptions options;
  options.unique_id = *id;
  options.epoch = 1;
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
      NcclCommunicator::Create(options, Deadline());
  INFO(comm.status().ToString());
  REQUIRE(comm.ok());
  return *std::move(comm);
}

struct Loopback {
  std::unique_ptr<NcclCommunicator> comm;
  std::unique_ptr<Channel> sender, receiver;
};

Loopback MakeLoopback(int64_t staging_bytes = 4 << 20) {
  Loopback l;
  l.comm = SelfCommunicator();
  NcclChannelOptions options;
  options.peer = 0;
  options.staging_bytes = staging_bytes;
  for (std::unique_ptr<Channel>* c : {&l.sender, &l.receiver}) {
    absl::StatusOr<std::unique_ptr<Channel>> ch =
        CreateNcclChannel(l.comm.get(), options);
    INFO(ch.status().ToString());
    REQUIRE(ch.ok());
    *c = *std::move(ch);
  }
  return l;
}

// Sends every bucket on a second thread while this one receives each into
// its twin; checks all arrived.
void ExpectArrive(Loopback& l,
                  std::vector<std::unique_ptr<DeviceBucket>>& buckets) {
  absl::Status send_status;
  std::thread sender([&] {
    for (auto& b : buckets) {
      send_status = l.sender->Send(b->SourceView(), Deadline());
      if (!send_status.ok()) return;
    }
    send_status = l.sender->Flush(Deadline());
  });
  std::vector<absl::Status> received;
  for (auto& b : buckets) {
    received.push_back(l.receiver->Receive(b->DestinationView(), Deadline()));
    if (!received.back().ok()) break;
  }
  sender.join();
  INFO("send: " << send_status.ToString());
  CHECK(send_status.ok());
  REQUIRE(received.size() == buckets.size());
  for (size_t i = 0; i < buckets.size(); ++i) {
    INFO("receive of bucket " << buckets[i]->host.id << ": "
                              << received[i].ToString());
    CHECK(received[i].ok());
    buckets[i]->CheckArrived();
  }
}

TEST_CASE("nccl: a one-rank communicator joins and reports itself", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  auto comm = SelfCommunicator();
  CHECK(comm->world_size() == 1);
  CHECK(comm->health().ok());
  CHECK(comm->name() == "nccl(epoch 1, rank 0 of 1, device 0)");
}

TEST_CASE("nccl: joining a world nobody else joins times out, never hangs", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  absl::StatusOr<std::string> id = gpu::NewNcclUniqueId();
  REQUIRE(id.ok());
  gpu::NcclCommunicatorOptions options;
  options.unique_id = *id;
  options.world_size = 2;
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
      NcclCommunicator::Create(options, start + absl::Seconds(2));
  INFO(comm.status().ToString());
  CHECK(absl::IsDeadlineExceeded(comm.status()));
  CHECK(absl::Now() - start < absl::Seconds(30));
}

TEST_CASE("nccl loopback: random buckets of strided boxes arrive exactly", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  Loopback l = MakeLoopback();
  std::vector<std::unique_ptr<DeviceBucket>> buckets;
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    buckets.push_back(
        std::make_unique<DeviceBucket>(gpu_testing::RandomBucket(seed)));
  }
  buckets.push_back(std::make_unique<DeviceBucket>(gpu_testing::EmptyBoxes()));
  buckets.push_back(
      std::make_unique<DeviceBucket>(gpu_testing::ManySmallBoxes(12)));
  ExpectArrive(l, buckets);
}

TEST_CASE("nccl loopback: large buckets, chunked through small staging", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  // 1 MiB slots: each 38 MiB bucket is ~40 chunks, double-buffered.
  Loopback l = MakeLoopback(1 << 20);
  std::vector<std::unique_ptr<DeviceBucket>> buckets;
  for (uint64_t seed = 11; seed < 14; ++seed) {
    buckets.push_back(
        std::make_unique<DeviceBucket>(gpu_testing::LargeBucket(seed)));
  }
  ExpectArrive(l, buckets);
}

TEST_CASE("nccl loopback: Send copies the source; it may change on return", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  Loopback l = MakeLoopback();
  DeviceBucket source(gpu_testing::RandomBucket(21));
  std::vector<std::unique_ptr<DeviceBucket>> got;
  for (uint64_t v = 0; v < 6; ++v) {
    got.push_back(std::make_unique<DeviceBucket>(gpu_testing::RandomBucket(21)));
  }
  absl::Status send_status;
  std::thread sender([&] {
    for (uint64_t v = 0; v < 6 && send_status.ok(); ++v) {
      gpu_testing::TestBucket fill = source.host;
      fill.FillSource(1000 + v);
      source.src.Upload(fill.src);
      BucketView view = source.SourceView();
      view.id = 500 + v;
      send_status = l.sender->Send(view, Deadline());
      fill.FillSource(0xBAD);
      source.src.Upload(fill.src);  // scribble right after Send returns
    }
    if (send_status.ok()) send_status = l.sender->Flush(Deadline());
  });
  std::vector<absl::Status> status;
  for (uint64_t v = 0; v < 6; ++v) {
    BucketView view = got[v]->DestinationView();
    view.id = 500 + v;
    status.push_back(l.receiver->Receive(view, Deadline()));
  }
  sender.join();
  INFO(send_status.ToString());
  REQUIRE(send_status.ok());
  for (uint64_t v = 0; v < 6; ++v) {
    INFO("version " << v << ": " << status[v].ToString());
    CHECK(status[v].ok());
    got[v]->host.FillSource(1000 + v);
    got[v]->CheckArrived();
  }
}

TEST_CASE("nccl loopback: a wrong bucket id is DATA_LOSS naming both ids", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  Loopback l = MakeLoopback();
  DeviceBucket sent(gpu_testing::RandomBucket(31));
  DeviceBucket expected(gpu_testing::RandomBucket(31));
  BucketView sv = sent.SourceView();
  sv.id = 7;
  BucketView rv = expected.DestinationView();
  rv.id = 8;
  absl::Status send_status;
  std::thread sender([&] {
    send_status = l.sender->Send(sv, Deadline());
    if (send_status.ok()) send_status = l.sender->Flush(Deadline());
  });
  const absl::Status s = l.receiver->Receive(rv, Deadline());
  sender.join();
  INFO(s.ToString());
  CHECK(absl::IsDataLoss(s));
  CHECK(s.message().find("bucket 8") != std::string::npos);
  CHECK(s.message().find("bucket 7") != std::string::npos);
  CHECK(!l.receiver->Receive(rv, absl::Now() + absl::Milliseconds(50)).ok());
  CHECK(!send_status.ok());  // the sender learns the stream broke
}

TEST_CASE("nccl loopback: a wrong bucket size is DATA_LOSS", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  Loopback l = MakeLoopback();
  DeviceBucket sent(gpu_testing::RandomBucket(32));
  DeviceBucket expected(gpu_testing::RandomBucket(33));
  BucketView rv = expected.DestinationView();
  rv.id = sent.host.id;
  std::thread sender([&] { (void)l.sender->Send(sent.SourceView(), Deadline()); });
  const absl::Status s = l.receiver->Receive(rv, Deadline());
  sender.join();
  INFO(s.ToString());
  CHECK(absl::IsDataLoss(s));
}

TEST_CASE("nccl loopback: a receive deadline is DEADLINE_EXCEEDED, then usable", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  Loopback l = MakeLoopback();
  auto b = std::make_unique<DeviceBucket>(gpu_testing::RandomBucket(41));
  const absl::Time start = absl::Now();
  const absl::Status late = l.receiver->Receive(
      b->DestinationView(), start + absl::Milliseconds(200));
  INFO(late.ToString());
  CHECK(absl::IsDeadlineExceeded(late));
  CHECK(absl::Now() - start >= absl::Milliseconds(200));
  CHECK(absl::Now() - start < absl::Seconds(10));
  std::vector<std::unique_ptr<DeviceBucket>> buckets;
  buckets.push_back(std::move(b));
  ExpectArrive(l, buckets);
}

TEST_CASE("nccl loopback: a peer that is gone is UNAVAILABLE", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  Loopback l = MakeLoopback();
  l.sender.reset();
  DeviceBucket b(gpu_testing::RandomBucket(51));
  const absl::Status s = l.receiver->Receive(b.DestinationView(), Deadline());
  INFO(s.ToString());
  CHECK(absl::IsUnavailable(s));
}

TEST_CASE("nccl loopback: malformed buckets are INVALID_ARGUMENT", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  Loopback l = MakeLoopback();
  DeviceBucket b(gpu_testing::RandomBucket(61));
  BucketView view = b.SourceView();
  view.bytes += 1;
  CHECK(absl::IsInvalidArgument(l.sender->Send(view, Deadline())));
  view = b.DestinationView();
  view.unit_bytes.pop_back();
  CHECK(absl::IsInvalidArgument(l.receiver->Receive(view, Deadline())));
}

TEST_CASE("nccl: an aborted communicator fails every later call", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  Loopback l = MakeLoopback();
  l.comm->Abort(absl::UnavailableError("replaced by epoch 2"));
  DeviceBucket b(gpu_testing::RandomBucket(71));
  std::thread sender([&] { (void)l.sender->Send(b.SourceView(), Deadline()); });
  const absl::Status s = l.receiver->Receive(b.DestinationView(), Deadline());
  sender.join();
  INFO(s.ToString());
  CHECK(!s.ok());
  CHECK(s.message().find("epoch 2") != std::string::npos);
}

}  // namespace
}  // namespace ferry

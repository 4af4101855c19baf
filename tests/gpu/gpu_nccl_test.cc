// The nccl backend on one GPU, beyond the conformance suite (which runs a
// loopback pair in gpu_conformance_test): a one-rank communicator joins,
// joining a world nobody else joins times out instead of hanging, large
// buckets are chunked through small staging, and an aborted communicator
// fails every later call.
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

TEST_CASE("nccl loopback: large buckets, chunked through small staging", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  // 1 MiB slots: each 38 MiB bucket is ~40 chunks, double-buffered.
  Loopback l = MakeLoopback(1 << 20);
  std::vector<std::unique_ptr<DeviceBucket>> buckets;
  for (uint64_t seed = 11; seed < 14; ++seed) {
    buckets.push_back(
        std::make_unique<DeviceBucket>(testing::LargeBucket(seed)));
  }
  ExpectArrive(l, buckets);
}

TEST_CASE("nccl: an aborted communicator fails every later call", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  Loopback l = MakeLoopback();
  l.comm->Abort(absl::UnavailableError("replaced by epoch 2"));
  DeviceBucket b(testing::RandomBucket(71));
  std::thread sender([&] { (void)l.sender->Send(b.SourceView(), Deadline()); });
  const absl::Status s = l.receiver->Receive(b.DestinationView(), Deadline());
  sender.join();
  INFO(s.ToString());
  CHECK(!s.ok());
  CHECK(s.message().find("epoch 2") != std::string::npos);
}

}  // namespace
}  // namespace ferry

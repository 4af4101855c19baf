// update_bench: what one version costs on one node, end to end through the
// daemon (registration, version protocol, host copy engine), against what
// the machine's memory can do.
//
// Starts an in-process ferryd (daemon/server.h) on a temporary unix socket,
// registers one trainer rank and one engine rank through the client library
// (source_client.h, destination_client.h; shared memory arenas), and runs
// versions:
//
//   throughput   a ~1 GiB bf16 model (--model_mib): bytes / (BeginVersion ..
//                CommitVersion returned, i.e. every instance committed),
//                against single-thread memcpy bandwidth measured in the same
//                run between the same two arenas. Target >= 0.8x.
//   verify       with --transfer_checksums: Inspection.VerifyInstance of
//                the throughput model's last version (every byte hashed
//                once more, in the engine's memory).
//   control      a tiny model (--tiny_mib, a few MB): the same interval,
//                which is then almost all protocol (events, acks, planning
//                cache hit, transfer hand-off). Target < 5 ms.
//
//   bazel run -c opt //bench/daemon:update_bench -- [--versions=N]
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/daemon/bench_daemon.h"
#include "bench/daemon/bench_figures.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/connection.h"
#include "client/destination_client.h"
#include "client/shared_tensor_arena.h"
#include "client/source_client.h"
#include "daemon/daemon_options.h"
#include "daemon/server.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "proto/ferry/v1/inspection.grpc.pb.h"
#include "common/flags_help.h"

DEFINE_int64(model_mib, 1024, "size of the throughput model, MiB");
DEFINE_int64(tensor_mib, 16, "size of each tensor of the throughput model");
DEFINE_int64(tiny_mib, 4, "size of the control-overhead model, MiB");
DEFINE_int32(versions, 5, "versions per measurement");
DEFINE_int32(copy_threads, 0, "ferryd --copy_threads (0: its default)");
DEFINE_bool(transfer_checksums, false, "ferryd --transfer_checksums");

namespace ferry {
namespace {

using bench::Median;
using bench::MemcpyBandwidth;

constexpr int64_t kMiB = int64_t{1} << 20;

// A model of `tensors` bf16 tensors [rows, 4096], one contiguous piece each,
// packed back to back in region 0.
struct Model {
  ModelSpec spec;
  std::vector<Piece> pieces;
  int64_t bytes = 0;
};

Model MakeModel(const std::string& prefix, int64_t total_bytes,
                int64_t tensor_bytes) {
  Model m;
  constexpr int64_t kCols = 4096;
  const int64_t rows = std::max<int64_t>(1, tensor_bytes / (kCols * 2));
  const int64_t tensors = std::max<int64_t>(1, total_bytes / (rows * kCols * 2));
  for (int64_t i = 0; i < tensors; ++i) {
    m.spec.params.push_back(ParamSpec{
        absl::StrCat(prefix, ".layers.", i, ".weight"), DType::kBF16,
        {rows, kCols}});
  }
  m.spec.BuildIndex();
  for (int64_t i = 0; i < tensors; ++i) {
    m.pieces.push_back(Piece::Contiguous(static_cast<int32_t>(i),
                                         FullBox(m.spec.params[i].shape), 0,
                                         m.bytes, DType::kBF16));
    m.bytes += rows * kCols * 2;
  }
  return m;
}

struct Run {
  std::vector<double> seconds;  // per version, begin .. all committed
  // With --transfer_checksums: VerifyInstance of the last version.
  double verify_seconds = 0;
  v1::VerifyInstanceResponse verified;
};

// Registers one source rank and one destination rank of stream `stream`
// with `model`, runs `versions` versions, returns their durations.
absl::StatusOr<Run> RunVersions(const Connection& connection,
                                const std::string& stream, const Model& model,
                                int versions, double* memcpy_bw) {
  absl::StatusOr<std::unique_ptr<SharedTensorArena>> src =
      SharedTensorArena::Create(stream + ".src", model.bytes, 0);
  if (!src.ok()) return src.status();
  absl::StatusOr<std::unique_ptr<SharedTensorArena>> dst =
      SharedTensorArena::Create(stream + ".dst", model.bytes, 0);
  if (!dst.ok()) return dst.status();
  // Both sides hold real pages before the first version, as a trainer's and
  // an engine's weights do.
  std::memset((*src)->data(), 1, model.bytes);
  std::memset((*dst)->data(), 0, model.bytes);
  if (memcpy_bw != nullptr) {
    *memcpy_bw = MemcpyBandwidth((*src)->data(), (*dst)->data(), model.bytes);
  }

  SourceOptions so;
  so.stream = stream;
  SourceLayout sl{model.spec, model.pieces, {(*src)->Describe()}};
  absl::StatusOr<std::unique_ptr<SourceClient>> source =
      SourceClient::Register(connection, so, sl);
  if (!source.ok()) return source.status();

  DestinationOptions dopt;
  dopt.instance_id = stream + "-engine";
  dopt.stream = stream;
  absl::StatusOr<std::unique_ptr<DestinationClient>> destination =
      DestinationClient::Register(
          connection, dopt,
          DestinationLayout::FromPieces(model.spec, model.pieces,
                                        {(*dst)->Describe()}),
          DestinationCallbacks{});
  if (!destination.ok()) return destination.status();

  Run run;
  for (int v = 1; v <= versions; ++v) {
    (*src)->data()[0] = static_cast<uint8_t>(v);
    const absl::Time start = absl::Now();
    absl::StatusOr<PublishOutcome> outcome = (*source)->PublishVersion(v);
    const absl::Time end = absl::Now();
    if (!outcome.ok()) return outcome.status();
    if (!outcome->all_committed()) {
      return absl::InternalError(outcome->Summary());
    }
    if ((*dst)->data()[0] != static_cast<uint8_t>(v) ||
        std::memcmp((*dst)->data() + model.bytes - 4096,
                    (*src)->data() + model.bytes - 4096, 4096) != 0) {
      return absl::DataLossError(absl::StrCat("version ", v, " did not land"));
    }
    run.seconds.push_back(absl::ToDoubleSeconds(end - start));
  }
  if (FLAGS_transfer_checksums) {
    v1::VerifyInstanceRequest req;
    req.set_instance_id(dopt.instance_id);
    auto context = connection.NewContext(absl::Minutes(5));
    const absl::Time start = absl::Now();
    grpc::Status s =
        connection.inspection().VerifyInstance(context.get(), req, &run.verified);
    run.verify_seconds = absl::ToDoubleSeconds(absl::Now() - start);
    if (!s.ok()) {
      return absl::InternalError(
          absl::StrCat("VerifyInstance: ", s.error_message()));
    }
  }
  destination->reset();
  source->reset();
  return run;
}

int Main() {
  DaemonOptions options;
  options.copy_threads = FLAGS_copy_threads;
  options.transfer_checksums = FLAGS_transfer_checksums;
  absl::StatusOr<std::unique_ptr<bench::BenchDaemon>> daemon =
      bench::BenchDaemon::Start(options);
  if (!daemon.ok()) {
    LOG(ERROR) << "cannot start the in-process ferryd: " << daemon.status();
    return 1;
  }
  const Connection* connection = &(*daemon)->connection();
  std::printf("update_bench: %ld cores online, ferryd in process, copy "
              "threads %s, transfer checksums %s\n",
              sysconf(_SC_NPROCESSORS_ONLN),
              FLAGS_copy_threads > 0 ? absl::StrCat(FLAGS_copy_threads).c_str()
                                     : "default (min(4, cores))",
              FLAGS_transfer_checksums ? "on" : "off");

  const Model big =
      MakeModel("big", FLAGS_model_mib * kMiB, FLAGS_tensor_mib * kMiB);
  double memcpy_bw = 0;
  absl::StatusOr<Run> run =
      RunVersions(*connection, "big", big, FLAGS_versions, &memcpy_bw);
  if (!run.ok()) {
    LOG(ERROR) << run.status();
    return 1;
  }
  const double t = Median(run->seconds);
  const double best = *std::min_element(run->seconds.begin(), run->seconds.end());
  std::printf("throughput model: %zu tensors, %.1f MiB, %d versions\n",
              big.spec.params.size(), big.bytes / double(kMiB),
              FLAGS_versions);
  std::printf("  single-thread memcpy:      %8.2f GB/s\n", memcpy_bw / 1e9);
  std::printf("  update (begin..committed): median %8.2f ms = %6.2f GB/s, "
              "best %8.2f ms = %6.2f GB/s\n",
              t * 1e3, big.bytes / t / 1e9, best * 1e3,
              big.bytes / best / 1e9);
  std::printf("  ratio update/memcpy:       median %.2fx, best %.2fx "
              "(target >= 0.8x)\n",
              big.bytes / t / memcpy_bw, big.bytes / best / memcpy_bw);
  std::printf("  per version ms:");
  for (double s : run->seconds) std::printf(" %.1f", s * 1e3);
  std::printf("\n");
  if (FLAGS_transfer_checksums) {
    std::printf("  verify (VerifyInstance):   %8.2f ms = %6.2f GB/s, %lld "
                "boxes, %d mismatches\n",
                run->verify_seconds * 1e3,
                run->verified.bytes_checked() / run->verify_seconds / 1e9,
                static_cast<long long>(run->verified.boxes_checked()),
                run->verified.mismatches_size());
  }

  const Model tiny =
      MakeModel("tiny", FLAGS_tiny_mib * kMiB, std::max<int64_t>(kMiB / 4, 8192));
  const int tiny_versions = std::max(20, FLAGS_versions);
  absl::StatusOr<Run> control =
      RunVersions(*connection, "tiny", tiny, tiny_versions, nullptr);
  if (!control.ok()) {
    LOG(ERROR) << control.status();
    return 1;
  }
  const double c = Median(control->seconds);
  std::printf("control model: %zu tensors, %.1f MiB, %d versions\n",
              tiny.spec.params.size(), tiny.bytes / double(kMiB),
              tiny_versions);
  std::printf("  one version (begin..committed): median %.2f ms, best %.2f "
              "ms, worst %.2f ms (target < 5 ms)\n",
              c * 1e3,
              *std::min_element(control->seconds.begin(),
                                control->seconds.end()) * 1e3,
              *std::max_element(control->seconds.begin(),
                                control->seconds.end()) * 1e3);
  return 0;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "same-node update throughput and control overhead of ferryd");
  ferry::ParseFlagsWithOwnHelp(&argc, &argv, __FILE__);
  FLAGS_logtostderr = true;
  FLAGS_minloglevel = 1;  // warnings and errors only: the figures are stdout
  google::InitGoogleLogging(argv[0]);
  return ferry::Main();
}

// checkpoint_bench: a checkpoint file published as a version into a TP 4
// instance on one node (client/checkpoint_source.h), against what the
// machine can do.
//
// Writes the demo model (the Llama-3.1-8B tensor set scaled to ~1.6 GiB,
// bf16) as one .safetensors file under --dir (on disk, not /dev/shm),
// registers a TP 4 instance (engine tables as the demo engine has them:
// fused qkv_proj and gate_up_proj) on an in-process ferryd, and publishes
// the file as versions:
//
//   warm   page cache warm: begin .. every rank committed, against
//          single-thread memcpy of the same bytes measured in the same run.
//          Target >= 0.8x.
//   cold   the file's pages dropped first (posix_fadvise DONTNEED), beside
//          a plain sequential read(2) of the same cold file.
//
//   bazel run -c opt //bench/daemon:checkpoint_bench -- [--versions=N]
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "bench/daemon/bench_daemon.h"
#include "bench/daemon/bench_figures.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "checkpoint/checkpoint.h"
#include "client/checkpoint_source.h"
#include "client/source_client.h"
#include "client/connection.h"
#include "examples/demo/demo_model.h"
#include "examples/demo/verifying_engine.h"
#include "client/destination_client.h"
#include "daemon/daemon_options.h"
#include "daemon/server.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "common/flags_help.h"

DEFINE_string(dir, "/tmp", "where the checkpoint file is written (a disk)");
DEFINE_string(scale, "demo", "demo model scale: demo (~1.6 GiB), small, tiny");
DEFINE_int32(versions, 5, "warm publishes measured");
DEFINE_int32(tp, 4, "the instance's TP size");

namespace ferry {
namespace {

using bench::Median;
using bench::MemcpyBandwidth;

// The model as safetensors, every tensor bf16 filled with a pattern.
absl::StatusOr<std::string> WriteCheckpoint(const ModelSpec& spec,
                                            const std::string& suffix,
                                            int64_t* bytes) {
  std::string header = "{";
  int64_t at = 0;
  for (size_t i = 0; i < spec.params.size(); ++i) {
    const ParamSpec& p = spec.params[i];
    int64_t n = UnitBytes(p.dtype);
    std::string shape;
    for (size_t d = 0; d < p.shape.size(); ++d) {
      n *= p.shape[d];
      shape += absl::StrCat(d ? "," : "", p.shape[d]);
    }
    header += absl::StrCat(i ? "," : "", "\"", p.name, "\":{\"dtype\":\"",
                           absl::AsciiStrToUpper(DTypeName(p.dtype)),
                           "\",\"shape\":[", shape, "],\"data_offsets\":[", at,
                           ",", at + n, "]}");
    at += n;
  }
  header += "}";
  const std::string path =
      absl::StrCat(FLAGS_dir, "/ferry-bench-model", suffix, ".safetensors");
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  const uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f.write(header.data(), header.size());
  std::vector<char> chunk(8 << 20);
  for (size_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<char>(i * 7);
  for (int64_t left = at; left > 0;) {
    const int64_t w = std::min<int64_t>(left, chunk.size());
    f.write(chunk.data(), w);
    left -= w;
  }
  f.close();
  if (!f) return absl::InternalError(absl::StrCat("cannot write ", path));
  *bytes = at;
  return path;
}

double SequentialRead(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  std::vector<char> buf(16 << 20);
  int64_t total = 0;
  const absl::Time start = absl::Now();
  for (ssize_t n; (n = ::read(fd, buf.data(), buf.size())) > 0;) total += n;
  const double s = absl::ToDoubleSeconds(absl::Now() - start);
  ::close(fd);
  return total / s;
}

void DropCache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

int Main() {
  absl::StatusOr<std::unique_ptr<bench::BenchDaemon>> daemon =
      bench::BenchDaemon::Start();
  if (!daemon.ok()) {
    LOG(ERROR) << daemon.status();
    return 1;
  }
  const Connection* c = &(*daemon)->connection();
  absl::StatusOr<ModelSchema> schema = LoadDemoModel("llama-3.1-8b", FLAGS_scale);
  if (!schema.ok()) {
    LOG(ERROR) << schema.status();
    return 1;
  }
  int64_t model_bytes = 0;
  absl::StatusOr<std::string> path =
      WriteCheckpoint(schema->spec, "", &model_bytes);
  if (!path.ok()) return 1;
  absl::StatusOr<Checkpoint> ckpt = OpenCheckpoint(*path);
  if (!ckpt.ok()) {
    LOG(ERROR) << ckpt.status();
    return 1;
  }
  std::vector<std::unique_ptr<VerifyingEngine>> engines;
  std::vector<std::unique_ptr<DestinationClient>> ranks;
  for (int r = 0; r < FLAGS_tp; ++r) {
    auto e = VerifyingEngine::Create(*schema, FLAGS_tp, r, {},
                                     absl::StrCat("bench.ckpt.", r));
    if (!e.ok()) return 1;
    DestinationOptions o;
    o.instance_id = "engine";
    o.stream = "policy";
    o.tp_rank = r;
    o.tp_size = FLAGS_tp;
    auto d = DestinationClient::Register(
        *c, o,
        DestinationLayout::FromEngineTable((*e)->table(),
                                           {(*e)->arena().Describe()}),
        DestinationCallbacks{});
    if (!d.ok()) {
      LOG(ERROR) << d.status();
      return 1;
    }
    engines.push_back(*std::move(e));
    ranks.push_back(*std::move(d));
  }
  // memcpy of the model's bytes from the mapped (warm) file: the bytes one
  // version moves, single-threaded.
  const uint8_t* file = ckpt->files[0]->data();
  std::vector<uint8_t> sink(std::min<int64_t>(model_bytes, int64_t{1} << 31));
  const double memcpy_bw = MemcpyBandwidth(file, sink.data(), sink.size());
  // Warm: the file registered once as the stream's source, then versions
  // begun and committed back to back (begin .. every rank committed).
  std::vector<double> warm;
  int64_t v = 1;
  {
    absl::StatusOr<SourceLayout> layout = CheckpointSourceLayout(*ckpt);
    if (!layout.ok()) return 1;
    SourceOptions so;
    so.stream = "policy";
    absl::StatusOr<std::unique_ptr<SourceClient>> source =
        SourceClient::Register(*c, so, *layout);
    if (!source.ok()) {
      LOG(ERROR) << source.status();
      return 1;
    }
    for (int i = 0; i < FLAGS_versions; ++i, ++v) {
      const absl::Time start = absl::Now();
      absl::StatusOr<PublishOutcome> out = (*source)->PublishVersion(v);
      const double s = absl::ToDoubleSeconds(absl::Now() - start);
      if (!out.ok() || !out->all_committed()) {
        LOG(ERROR) << (out.ok() ? out->Summary() : out.status().ToString());
        return 1;
      }
      warm.push_back(s);
    }
  }
  // The whole of ferry_load, warm: register (the daemon maps and prefaults
  // the file), publish, deregister.
  double whole = 0;
  {
    CheckpointPublishOptions po;
    po.stream = "policy";
    po.version = v++;
    const absl::Time start = absl::Now();
    absl::StatusOr<PublishOutcome> out = PublishCheckpoint(*c, *ckpt, po);
    whole = absl::ToDoubleSeconds(absl::Now() - start);
    if (!out.ok() || !out->all_committed()) return 1;
  }
  // Cold: a second copy of the file that nothing has mapped (ferryd keeps
  // the first mapped while its versions are in its history, and mapped
  // pages cannot be dropped), its pages dropped after writing; a plain
  // read(2) of it cold, its pages dropped again, then ferry_load.
  absl::StatusOr<std::string> cold_path =
      WriteCheckpoint(schema->spec, "-cold", &model_bytes);
  if (!cold_path.ok()) return 1;
  DropCache(*cold_path);
  const double cold_read = SequentialRead(*cold_path);
  DropCache(*cold_path);
  absl::StatusOr<Checkpoint> cold_ckpt = OpenCheckpoint(*cold_path);
  if (!cold_ckpt.ok()) return 1;
  CheckpointPublishOptions po;
  po.stream = "policy";
  po.version = v;
  const absl::Time start = absl::Now();
  absl::StatusOr<PublishOutcome> out = PublishCheckpoint(*c, *cold_ckpt, po);
  const double cold = absl::ToDoubleSeconds(absl::Now() - start);
  if (!out.ok() || !out->all_committed()) return 1;
  const double med = Median(warm);
  std::printf("checkpoint_bench: %ld cores online, ferryd in process\n",
              sysconf(_SC_NPROCESSORS_ONLN));
  std::printf("model: llama-3.1-8b %s, %zu tensors, %.2f GiB bf16 safetensors "
              "in %s, into a TP%d instance (fused qkv/gate_up)\n",
              FLAGS_scale.c_str(), schema->spec.params.size(),
              model_bytes / double(1 << 30), FLAGS_dir.c_str(), FLAGS_tp);
  std::printf("  single-thread memcpy (warm file):  %6.2f GB/s\n", memcpy_bw / 1e9);
  std::printf("  version, warm (begin..committed):  median %.1f ms = %.2f "
              "GB/s = %.2fx memcpy (target >= 0.8x), min %.1f, max %.1f ms "
              "(%d versions)\n",
              med * 1e3, model_bytes / med / 1e9, model_bytes / med / memcpy_bw,
              *std::min_element(warm.begin(), warm.end()) * 1e3,
              *std::max_element(warm.begin(), warm.end()) * 1e3, FLAGS_versions);
  std::printf("  ferry_load, warm (register..committed..deregistered): %.1f ms "
              "= %.2f GB/s\n", whole * 1e3, model_bytes / whole / 1e9);
  std::printf("  ferry_load, cold page cache:       %.1f ms = %.2f GB/s; "
              "sequential read(2) of the cold file %.2f GB/s\n",
              cold * 1e3, model_bytes / cold / 1e9, cold_read / 1e9);
  ranks.clear();
  ::unlink(path->c_str());
  ::unlink(cold_path->c_str());
  return 0;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::SetUsageMessage("a checkpoint file published into a TP instance");
  ferry::ParseFlagsWithOwnHelp(&argc, &argv, __FILE__);
  FLAGS_logtostderr = true;
  FLAGS_minloglevel = 1;
  google::InitGoogleLogging(argv[0]);
  return ferry::Main();
}

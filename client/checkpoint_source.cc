#include "client/checkpoint_source.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "checkpoint/tp_split.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "proto/grpc_status.h"

namespace ferry {
namespace {

absl::StatusOr<v1::StreamInfo> StreamInfoOf(const Connection& c,
                                            const std::string& stream) {
  v1::ListStreamsRequest req;
  req.set_stream(stream);
  v1::ListStreamsResponse resp;
  auto context = c.NewContext();
  const grpc::Status s = c.inspection().ListStreams(context.get(), req, &resp);
  if (!s.ok()) return FromGrpcStatus(s, absl::StrCat("ListStreams(", stream, ")"));
  if (resp.streams_size() != 1) {
    return absl::NotFoundError(absl::StrCat("stream ", stream, " is not known"));
  }
  return resp.streams(0);
}

}  // namespace

absl::StatusOr<SourceLayout> CheckpointSourceLayout(const Checkpoint& c) {
  SourceLayout layout;
  for (size_t f = 0; f < c.files.size(); ++f) {
    v1::MemoryRegion r;
    r.set_region_id(static_cast<uint32_t>(f));
    r.set_size_bytes(c.files[f]->size());
    r.mutable_shared_memory()->set_file_path(c.files[f]->path());
    r.mutable_shared_memory()->set_file_offset_bytes(0);
    layout.regions.push_back(std::move(r));
  }
  for (const CheckpointTensor& t : c.tensors) {
    const std::string name = HfNameOfGguf(t.name);
    if (layout.model.Find(name) >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          c.files[t.file]->path(), ": tensors ", t.name, " and another map to ",
          name));
    }
    layout.model.params.push_back(ParamSpec{name, t.dtype, t.shape});
    layout.model.BuildIndex();
    layout.pieces.push_back(Piece::Contiguous(
        static_cast<int32_t>(layout.model.params.size() - 1), FullBox(t.shape),
        static_cast<uint32_t>(t.file), t.offset, t.dtype));
  }
  return layout;
}

absl::StatusOr<PublishOutcome> PublishCheckpoint(
    const Connection& connection, const Checkpoint& checkpoint,
    const CheckpointPublishOptions& options) {
  for (const auto& f : checkpoint.files) {
    if (f->path().empty() || f->path()[0] != '/') {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint file ", f->path(), ": give an absolute path (ferryd "
          "opens it by name)"));
    }
  }
  absl::StatusOr<SourceLayout> layout = CheckpointSourceLayout(checkpoint);
  if (!layout.ok()) return layout.status();
  SourceOptions so;
  so.stream = options.stream;
  absl::StatusOr<std::unique_ptr<SourceClient>> source =
      SourceClient::Register(connection, so, *layout);
  if (!source.ok()) return source.status();
  if (options.wait_for_instances > absl::ZeroDuration()) {
    const absl::Time deadline = absl::Now() + options.wait_for_instances;
    while (absl::Now() < deadline) {
      absl::StatusOr<v1::StreamInfo> info = StreamInfoOf(connection, options.stream);
      bool complete = info.ok() && info->instances_size() > 0;
      if (info.ok()) {
        for (const v1::InstanceInfo& i : info->instances()) {
          complete &= i.registered_tp_ranks_size() == i.tp_size();
        }
      }
      if (complete) break;
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
  int64_t version = options.version;
  if (version == 0) {
    absl::StatusOr<v1::StreamInfo> info = StreamInfoOf(connection, options.stream);
    if (!info.ok()) return info.status();
    version = info->latest_committed_version() + 1;
  }
  absl::StatusOr<PublishOutcome> outcome = (*source)->PublishVersion(version);
  source->reset();  // deregisters: the files are not read after the commit
  return outcome;
}

}  // namespace ferry

#include "checkpoint/safetensors.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/limits.h"

namespace ferry {
namespace {

// The format caps the header at 100 MB; a larger claim is a corrupt file.
constexpr int64_t kMaxHeaderBytes = 100'000'000;

constexpr const char* kDTypes[] = {"F32",     "F16", "BF16", "F8_E4M3",
                                   "F8_E5M2", "I8",  "U8",   "I32",
                                   "I64",     "BOOL"};

absl::Status Bad(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

// Parses one file's header into `out` (tensors appended with `file`).
absl::Status ParseFile(const MappedFile& f, int32_t file, Checkpoint* out) {
  const std::string& path = f.path();
  if (f.size() < 8) {
    return Bad(path, absl::StrCat("truncated: ", f.size(),
                                  " bytes, less than the 8-byte header length"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | f.data()[i];
  if (n > static_cast<uint64_t>(f.size() - 8) || n > kMaxHeaderBytes) {
    return Bad(path, absl::StrCat("the header claims ", n,
                                  " bytes at byte 8 but the file has ",
                                  f.size() - 8, " bytes after the length"));
  }
  const int64_t data_start = 8 + static_cast<int64_t>(n);
  const int64_t data_bytes = f.size() - data_start;
  nlohmann::json header = nlohmann::json::parse(
      f.data() + 8, f.data() + data_start, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return Bad(path, absl::StrCat("the header (bytes [8, ", data_start,
                                  ")) is not a JSON object"));
  }
  struct Range {
    int64_t begin, end;
    size_t tensor;
  };
  std::vector<Range> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {
      if (!it->is_object()) return Bad(path, "__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          return Bad(path, absl::StrCat("__metadata__ ", Quote(m.key()),
                                        " is not a string"));
        }
        out->metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    const std::string at = absl::StrCat("tensor ", Quote(name));
    const nlohmann::json& t = *it;
    if (!t.is_object() || !t.contains("dtype") || !t["dtype"].is_string() ||
        !t.contains("shape") || !t["shape"].is_array() ||
        !t.contains("data_offsets") || !t["data_offsets"].is_array() ||
        t["data_offsets"].size() != 2) {
      return Bad(path, absl::StrCat(at, ": needs \"dtype\" (a string), "
                                    "\"shape\" (an array) and "
                                    "\"data_offsets\" ([begin, end])"));
    }
    CheckpointTensor ct;
    ct.name = name;
    ct.file = file;
    ct.file_type = t["dtype"].get<std::string>();
    if (std::find(std::begin(kDTypes), std::end(kDTypes), ct.file_type) ==
        std::end(kDTypes)) {
      return Bad(path, absl::StrCat(at, ": unknown dtype ", Quote(ct.file_type),
                                    " (known: F32 F16 BF16 F8_E4M3 F8_E5M2 I8 "
                                    "U8 I32 I64 BOOL)"));
    }
    ct.dtype = *ParseDType(ct.file_type);
    int64_t elems = 1;
    for (const nlohmann::json& d : t["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) {
        return Bad(path, absl::StrCat(at, ": shape entries must be integers "
                                      ">= 0"));
      }
      ct.shape.push_back(d.get<int64_t>());
      if (!CheckedMul(elems, ct.shape.back(), &elems)) {
        return Bad(path, absl::StrCat(at, ": shape overflows 64 bits"));
      }
    }
    const nlohmann::json& off = t["data_offsets"];
    if (!off[0].is_number_integer() || !off[1].is_number_integer() ||
        off[0].get<int64_t>() < 0 || off[1].get<int64_t>() < off[0].get<int64_t>()) {
      return Bad(path, absl::StrCat(at, ": data_offsets must be integers "
                                    "0 <= begin <= end"));
    }
    const int64_t begin = off[0].get<int64_t>(), end = off[1].get<int64_t>();
    int64_t want;
    if (!CheckedMul(elems, UnitBytes(ct.dtype), &want)) {
      return Bad(path, absl::StrCat(at, ": size overflows 64 bits"));
    }
    if (end > data_bytes) {
      return Bad(path, absl::StrCat(at, ": data [", data_start + begin, ", ",
                                    data_start + end,
                                    ") runs past the end of the file (",
                                    f.size(), " bytes)"));
    }
    if (end - begin != want) {
      return Bad(path, absl::StrCat(at, " at byte ", data_start + begin, ": ",
                                    end - begin, " bytes of data, but ",
                                    ct.file_type, " ", DimsToString(ct.shape),
                                    " is ", want, " bytes"));
    }
    ct.offset = data_start + begin;
    ct.bytes = want;
    ranges.push_back(Range{ct.offset, ct.offset + ct.bytes,
                           out->tensors.size()});
    out->tensors.push_back(std::move(ct));
  }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin < b.begin;
  });
  // The range reaching furthest so far: a later non-empty one starting
  // before its end shares bytes with it.
  size_t far = 0;
  bool any = false;
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (ranges[i].end == ranges[i].begin) continue;
    if (any && ranges[i].begin < ranges[far].end) {
      return Bad(path, absl::StrCat(
                           "tensors ", Quote(out->tensors[ranges[far].tensor].name),
                           " and ", Quote(out->tensors[ranges[i].tensor].name),
                           " share bytes from byte ", ranges[i].begin));
    }
    if (!any || ranges[i].end > ranges[far].end) far = i;
    any = true;
  }
  // File order: by offset, as the data lies.
  std::stable_sort(out->tensors.begin(), out->tensors.end(),
                   [](const CheckpointTensor& a, const CheckpointTensor& b) {
                     return a.file != b.file ? a.file < b.file
                                             : a.offset < b.offset;
                   });
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Checkpoint> ReadSafetensors(const std::string& path) {
  absl::StatusOr<std::shared_ptr<const MappedFile>> f = MappedFile::Open(path);
  if (!f.ok()) return f.status();
  Checkpoint out;
  out.files.push_back(*f);
  absl::Status s = ParseFile(**f, 0, &out);
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<Checkpoint> ReadSafetensorsIndex(const std::string& index_path) {
  absl::StatusOr<std::shared_ptr<const MappedFile>> index =
      MappedFile::Open(index_path);
  if (!index.ok()) return index.status();
  const uint8_t* data = (*index)->data();
  nlohmann::json j = nlohmann::json::parse(
      data, data + (*index)->size(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") ||
      !j["weight_map"].is_object()) {
    return Bad(index_path, "not a safetensors index: a JSON object with a "
                           "\"weight_map\" object is expected");
  }
  const size_t slash = index_path.rfind('/');
  const std::string dir =
      slash == std::string::npos ? "" : index_path.substr(0, slash + 1);
  std::map<std::string, std::string> wanted;  // tensor -> shard
  std::map<std::string, int32_t> shards;      // shard -> file index
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it->is_string()) {
      return Bad(index_path, absl::StrCat("weight_map ", Quote(it.key()),
                                          " does not name a file"));
    }
    const std::string shard = it->get<std::string>();
    if (shard.empty() || shard.find('/') != std::string::npos) {
      return Bad(index_path, absl::StrCat("weight_map ", Quote(it.key()),
                                          " names ", Quote(shard),
                                          "; shards are files beside the index"));
    }
    wanted[it.key()] = shard;
    shards.emplace(shard, -1);
  }
  Checkpoint out;
  for (auto& [shard, file] : shards) {
    absl::StatusOr<std::shared_ptr<const MappedFile>> f =
        MappedFile::Open(dir + shard);
    if (!f.ok()) {
      return absl::Status(f.status().code(),
                          absl::StrCat(index_path, ": shard ", Quote(shard),
                                       ": ", f.status().message()));
    }
    file = static_cast<int32_t>(out.files.size());
    out.files.push_back(*f);
    absl::Status s = ParseFile(**f, file, &out);
    if (!s.ok()) return s;
  }
  std::map<std::string, int32_t> seen;
  for (const CheckpointTensor& t : out.tensors) {
    auto [it, fresh] = seen.emplace(t.name, t.file);
    if (!fresh) {
      return Bad(index_path, absl::StrCat(
                                 "tensor ", Quote(t.name), " is in two shards, ",
                                 Quote(out.files[it->second]->path()), " and ",
                                 Quote(out.files[t.file]->path())));
    }
  }
  for (const auto& [tensor, shard] : wanted) {
    const int32_t at = out.Find(tensor);
    if (at < 0 || out.tensors[at].file != shards[shard]) {
      return Bad(index_path, absl::StrCat("tensor ", Quote(tensor),
                                          " is not in its shard ", Quote(shard)));
    }
  }
  return out;
}

}  // namespace ferry

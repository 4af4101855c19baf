#include "checkpoint/gguf.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/limits.h"

namespace ferry {
namespace {

// Nesting of arrays allowed in metadata: deeper is a corrupt file (and
// would recurse without bound).
constexpr int kMaxArrayDepth = 8;

struct GgmlType {
  uint32_t id;
  const char* name;
  DType dtype;
};

// ggml's type numbers (ggml.h enum ggml_type).
constexpr GgmlType kGgmlTypes[] = {
    {0, "F32", DType::kF32},    {1, "F16", DType::kF16},
    {2, "Q4_0", DType::kQ4_0},  {3, "Q4_1", DType::kQ4_1},
    {6, "Q5_0", DType::kQ5_0},  {7, "Q5_1", DType::kQ5_1},
    {8, "Q8_0", DType::kQ8_0},  {10, "Q2_K", DType::kQ2_K},
    {11, "Q3_K", DType::kQ3_K}, {12, "Q4_K", DType::kQ4_K},
    {13, "Q5_K", DType::kQ5_K}, {14, "Q6_K", DType::kQ6_K},
    {30, "BF16", DType::kBF16},
};

// Reads little-endian values from the mapping; every read is bounds
// checked and a failure names what was being read and where.
class Reader {
 public:
  explicit Reader(const MappedFile& f) : f_(f) {}

  int64_t at() const { return at_; }
  int64_t left() const { return f_.size() - at_; }

  absl::Status Need(int64_t bytes, const std::string& what) const {
    if (bytes < 0 || bytes > left()) {
      return absl::InvalidArgumentError(absl::StrCat(
          f_.path(), ": truncated at byte ", at_, ": ", what, " needs ", bytes,
          " bytes, the file has ", left(), " left"));
    }
    return absl::OkStatus();
  }
  template <typename T>
  absl::StatusOr<T> Read(const std::string& what) {
    if (absl::Status s = Need(sizeof(T), what); !s.ok()) return s;
    T v;
    std::memcpy(&v, f_.data() + at_, sizeof(T));  // little-endian hosts
    at_ += sizeof(T);
    return v;
  }
  absl::StatusOr<std::string> String(const std::string& what) {
    absl::StatusOr<uint64_t> n = Read<uint64_t>(what + " (length)");
    if (!n.ok()) return n.status();
    if (*n > static_cast<uint64_t>(left())) {
      return absl::InvalidArgumentError(absl::StrCat(
          f_.path(), ": ", what, " at byte ", at_ - 8, " claims ", *n,
          " bytes; the file has ", left(), " left"));
    }
    std::string s(reinterpret_cast<const char*>(f_.data() + at_), *n);
    at_ += static_cast<int64_t>(*n);
    return s;
  }

 private:
  const MappedFile& f_;
  int64_t at_ = 0;
};

int64_t ScalarBytes(GgufType t) {
  switch (t) {
    case GgufType::kU8: case GgufType::kI8: case GgufType::kBool: return 1;
    case GgufType::kU16: case GgufType::kI16: return 2;
    case GgufType::kU32: case GgufType::kI32: case GgufType::kF32: return 4;
    case GgufType::kU64: case GgufType::kI64: case GgufType::kF64: return 8;
    default: return 0;
  }
}

absl::StatusOr<GgufValue> ReadValue(Reader& r, uint32_t type,
                                    const std::string& what, int depth) {
  GgufValue v;
  if (type > static_cast<uint32_t>(GgufType::kF64)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " at byte ", r.at(), ": unknown value type ", type));
  }
  v.type = static_cast<GgufType>(type);
  switch (v.type) {
    case GgufType::kU8: { auto x = r.Read<uint8_t>(what); if (!x.ok()) return x.status(); v.value = uint64_t{*x}; break; }
    case GgufType::kI8: { auto x = r.Read<int8_t>(what); if (!x.ok()) return x.status(); v.value = int64_t{*x}; break; }
    case GgufType::kU16: { auto x = r.Read<uint16_t>(what); if (!x.ok()) return x.status(); v.value = uint64_t{*x}; break; }
    case GgufType::kI16: { auto x = r.Read<int16_t>(what); if (!x.ok()) return x.status(); v.value = int64_t{*x}; break; }
    case GgufType::kU32: { auto x = r.Read<uint32_t>(what); if (!x.ok()) return x.status(); v.value = uint64_t{*x}; break; }
    case GgufType::kI32: { auto x = r.Read<int32_t>(what); if (!x.ok()) return x.status(); v.value = int64_t{*x}; break; }
    case GgufType::kU64: { auto x = r.Read<uint64_t>(what); if (!x.ok()) return x.status(); v.value = *x; break; }
    case GgufType::kI64: { auto x = r.Read<int64_t>(what); if (!x.ok()) return x.status(); v.value = *x; break; }
    case GgufType::kF32: { auto x = r.Read<float>(what); if (!x.ok()) return x.status(); v.value = double{*x}; break; }
    case GgufType::kF64: { auto x = r.Read<double>(what); if (!x.ok()) return x.status(); v.value = *x; break; }
    case GgufType::kBool: {
      auto x = r.Read<uint8_t>(what);
      if (!x.ok()) return x.status();
      if (*x > 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, " at byte ", r.at() - 1, ": bool value ", int{*x}));
      }
      v.value = *x == 1;
      break;
    }
    case GgufType::kString: {
      auto x = r.String(what);
      if (!x.ok()) return x.status();
      v.value = *std::move(x);
      break;
    }
    case GgufType::kArray: {
      if (depth >= kMaxArrayDepth) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, " at byte ", r.at(), ": arrays nested more than ",
            kMaxArrayDepth, " deep"));
      }
      auto et = r.Read<uint32_t>(what + " (array type)");
      if (!et.ok()) return et.status();
      auto n = r.Read<uint64_t>(what + " (array count)");
      if (!n.ok()) return n.status();
      // Every element takes at least one byte (a string eight): a count
      // the rest of the file cannot hold is refused before any allocation.
      const int64_t least =
          *et == static_cast<uint32_t>(GgufType::kString) ||
                  *et == static_cast<uint32_t>(GgufType::kArray)
              ? 8
              : std::max<int64_t>(1, ScalarBytes(static_cast<GgufType>(
                                         std::min<uint32_t>(*et, 12))));
      if (*n > static_cast<uint64_t>(r.left() / least)) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, " at byte ", r.at() - 8, ": an array of ", *n,
            " elements does not fit in the ", r.left(), " bytes left"));
      }
      std::vector<GgufValue> items;
      items.reserve(*n);
      for (uint64_t i = 0; i < *n; ++i) {
        auto item = ReadValue(r, *et, absl::StrCat(what, "[", i, "]"), depth + 1);
        if (!item.ok()) return item.status();
        items.push_back(*std::move(item));
      }
      v.value = std::move(items);
      break;
    }
  }
  return v;
}

std::string AsText(const GgufValue& v) {
  if (auto* u = std::get_if<uint64_t>(&v.value)) return absl::StrCat(*u);
  if (auto* i = std::get_if<int64_t>(&v.value)) return absl::StrCat(*i);
  if (auto* d = std::get_if<double>(&v.value)) return absl::StrCat(*d);
  if (auto* b = std::get_if<bool>(&v.value)) return *b ? "true" : "false";
  if (auto* s = std::get_if<std::string>(&v.value)) return *s;
  return absl::StrCat("[", std::get<std::vector<GgufValue>>(v.value).size(),
                      " values]");
}

}  // namespace

absl::StatusOr<DType> DTypeOfGgmlType(uint32_t ggml_type, std::string* name) {
  for (const GgmlType& t : kGgmlTypes) {
    if (t.id == ggml_type) {
      if (name != nullptr) *name = t.name;
      return t.dtype;
    }
  }
  return absl::NotFoundError(absl::StrCat(
      "ggml type ", ggml_type, " is not read by ferry (known: F32 F16 BF16 "
      "Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K)"));
}

absl::StatusOr<GgufFile> ReadGguf(const std::string& path) {
  absl::StatusOr<std::shared_ptr<const MappedFile>> mapped = MappedFile::Open(path);
  if (!mapped.ok()) return mapped.status();
  const MappedFile& f = **mapped;
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
  };
  Reader r(f);
  GgufFile out;
  out.checkpoint.files.push_back(*mapped);
  if (f.size() < 4 || std::memcmp(f.data(), "GGUF", 4) != 0) {
    return bad("not a GGUF file (the first 4 bytes are not \"GGUF\")");
  }
  (void)r.Read<uint32_t>("magic");
  absl::StatusOr<uint32_t> version = r.Read<uint32_t>("the version");
  if (!version.ok()) return version.status();
  if (*version != 2 && *version != 3) {
    return bad(absl::StrCat("GGUF version ", *version,
                            " at byte 4; ferry reads versions 2 and 3"));
  }
  out.version = *version;
  absl::StatusOr<uint64_t> tensors = r.Read<uint64_t>("the tensor count");
  if (!tensors.ok()) return tensors.status();
  absl::StatusOr<uint64_t> kvs = r.Read<uint64_t>("the key/value count");
  if (!kvs.ok()) return kvs.status();
  // A tensor info takes at least 8 + 4 + 8 + 4 + 8 bytes, a key/value 8 + 4.
  if (*tensors > static_cast<uint64_t>(r.left() / 32) ||
      *kvs > static_cast<uint64_t>(r.left() / 12)) {
    return bad(absl::StrCat(*tensors, " tensors and ", *kvs,
                            " key/values (bytes 8..24) cannot fit in the ",
                            f.size(), "-byte file"));
  }
  for (uint64_t i = 0; i < *kvs; ++i) {
    const int64_t at = r.at();
    absl::StatusOr<std::string> key = r.String(absl::StrCat("key ", i));
    if (!key.ok()) return key.status();
    absl::StatusOr<uint32_t> type =
        r.Read<uint32_t>(absl::StrCat("the type of key ", Quote(*key)));
    if (!type.ok()) return type.status();
    absl::StatusOr<GgufValue> value =
        ReadValue(r, *type, absl::StrCat(path, ": key ", Quote(*key)), 0);
    if (!value.ok()) return value.status();
    if (out.metadata.count(*key)) {
      return bad(absl::StrCat("key ", Quote(*key), " at byte ", at,
                              " appears twice"));
    }
    out.checkpoint.metadata[*key] = AsText(*value);
    out.metadata[*key] = *std::move(value);
  }
  auto align = out.metadata.find("general.alignment");
  if (align != out.metadata.end()) {
    const auto* a = std::get_if<uint64_t>(&align->second.value);
    if (a == nullptr || *a == 0 || (*a & (*a - 1)) != 0 || *a > (1u << 20)) {
      return bad(absl::StrCat("general.alignment ", AsText(align->second),
                              " is not a power of two up to 1 MiB"));
    }
    out.alignment = static_cast<int64_t>(*a);
  }
  struct Info {
    CheckpointTensor t;
    uint64_t relative = 0;
    int64_t info_at = 0;
  };
  std::vector<Info> infos;
  std::set<std::string> names;
  for (uint64_t i = 0; i < *tensors; ++i) {
    Info info;
    info.info_at = r.at();
    absl::StatusOr<std::string> name = r.String(absl::StrCat("tensor info ", i));
    if (!name.ok()) return name.status();
    info.t.name = *name;
    const std::string at = absl::StrCat("tensor ", Quote(*name), " (info at byte ",
                                        info.info_at, ")");
    if (!names.insert(*name).second) return bad(absl::StrCat(at, ": name appears twice"));
    absl::StatusOr<uint32_t> n_dims = r.Read<uint32_t>(at + ": n_dims");
    if (!n_dims.ok()) return n_dims.status();
    if (*n_dims == 0 || *n_dims > 4) {
      return bad(absl::StrCat(at, ": ", *n_dims, " dims; 1 to 4 are allowed"));
    }
    Dims ne;
    for (uint32_t d = 0; d < *n_dims; ++d) {
      absl::StatusOr<uint64_t> x = r.Read<uint64_t>(absl::StrCat(at, ": ne[", d, "]"));
      if (!x.ok()) return x.status();
      if (*x > static_cast<uint64_t>(INT64_MAX)) {
        return bad(absl::StrCat(at, ": ne[", d, "] = ", *x, " overflows"));
      }
      ne.push_back(static_cast<int64_t>(*x));
    }
    absl::StatusOr<uint32_t> type = r.Read<uint32_t>(at + ": ggml type");
    if (!type.ok()) return type.status();
    absl::StatusOr<DType> dtype = DTypeOfGgmlType(*type, &info.t.file_type);
    if (!dtype.ok()) return bad(absl::StrCat(at, ": ", dtype.status().message()));
    info.t.dtype = *dtype;
    absl::StatusOr<uint64_t> offset = r.Read<uint64_t>(at + ": offset");
    if (!offset.ok()) return offset.status();
    info.relative = *offset;
    const int64_t block = BlockElems(*dtype);
    if (ne[0] % block != 0) {
      return bad(absl::StrCat(at, ": ne[0] = ", ne[0], " is not a whole number of ",
                              info.t.file_type, " blocks (", block, " elements)"));
    }
    int64_t units = ne[0] / block, bytes;
    for (size_t d = 1; d < ne.size(); ++d) {
      if (!CheckedMul(units, ne[d], &units)) {
        return bad(absl::StrCat(at, ": its size overflows 64 bits"));
      }
    }
    if (!CheckedMul(units, UnitBytes(*dtype), &bytes)) {
      return bad(absl::StrCat(at, ": its size overflows 64 bits"));
    }
    info.t.bytes = bytes;
    info.t.shape.assign(ne.rbegin(), ne.rend());  // ne[0] innermost
    infos.push_back(std::move(info));
  }
  const int64_t a = out.alignment;
  out.data_offset = (r.at() + a - 1) / a * a;
  if (out.data_offset > f.size()) {
    return bad(absl::StrCat("the data section would start at byte ",
                            out.data_offset, ", past the end of the file (",
                            f.size(), " bytes)"));
  }
  for (Info& info : infos) {
    const std::string at = absl::StrCat("tensor ", Quote(info.t.name),
                                        " (info at byte ", info.info_at, ")");
    if (info.relative % static_cast<uint64_t>(a) != 0) {
      return bad(absl::StrCat(at, ": data offset ", info.relative,
                              " is not a multiple of the alignment ", a));
    }
    int64_t begin, end;
    if (info.relative > static_cast<uint64_t>(INT64_MAX) ||
        !CheckedAdd(out.data_offset, static_cast<int64_t>(info.relative), &begin) ||
        !CheckedAdd(begin, info.t.bytes, &end) || end > f.size()) {
      return bad(absl::StrCat(at, ": data [", out.data_offset, " + ",
                              info.relative, ", +", info.t.bytes,
                              ") runs past the end of the file (", f.size(),
                              " bytes)"));
    }
    info.t.offset = begin;
  }
  std::vector<const Info*> by_offset;
  for (const Info& info : infos) by_offset.push_back(&info);
  std::sort(by_offset.begin(), by_offset.end(), [](const Info* x, const Info* y) {
    return x->t.offset < y->t.offset;
  });
  const Info* far = nullptr;
  for (const Info* info : by_offset) {
    if (info->t.bytes == 0) continue;
    if (far != nullptr && info->t.offset < far->t.offset + far->t.bytes) {
      return bad(absl::StrCat("tensors ", Quote(far->t.name), " and ",
                              Quote(info->t.name), " share bytes from byte ",
                              info->t.offset));
    }
    if (far == nullptr ||
        info->t.offset + info->t.bytes > far->t.offset + far->t.bytes) {
      far = info;
    }
  }
  for (Info& info : infos) out.checkpoint.tensors.push_back(std::move(info.t));
  return out;
}

}  // namespace ferry

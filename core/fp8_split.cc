#include "core/fp8_split.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/fp8_blocks.h"
#include "core/region_copy.h"

namespace ferry {

absl::StatusOr<std::vector<QuantizedPart>> ChooseParts(
    const ModelSpec& model, int32_t param, const std::vector<HeldPiece>& held,
    const std::vector<RankLayout>& sources,
    const std::map<std::string, int64_t>& bytes,
    const std::map<std::string, int64_t>& load, const std::string& home) {
  const ParamSpec& c = model.params[param];
  const int64_t total = Volume(FullBox(c.shape));
  std::vector<std::string> nodes;
  for (const auto& [node, b] : bytes) {
    if (node != home) nodes.push_back(node);
  }
  auto load_of = [&](const std::string& n) {
    auto it = load.find(n);
    return it == load.end() ? int64_t{0} : it->second;
  };
  std::sort(nodes.begin(), nodes.end(),
            [&](const std::string& a, const std::string& b) {
              const int64_t ba = bytes.at(a), bb = bytes.at(b);
              if (ba != bb) return ba > bb;
              if (load_of(a) != load_of(b)) return load_of(a) < load_of(b);
              return a < b;
            });
  nodes.insert(nodes.begin(), home);
  std::vector<QuantizedPart> parts;
  int64_t covered = 0;
  for (const std::string& node : nodes) {
    for (const HeldPiece& h : held) {
      if (sources[h.rank].node != node) continue;
      const Box& box = h.piece->box;
      bool taken = false;
      for (const QuantizedPart& p : parts)
        taken = taken || Overlaps(p.box, box);
      if (taken) continue;
      QuantizedPart part;
      part.node = node;
      part.box = box;
      parts.push_back(std::move(part));
      covered += Volume(box);
    }
    if (covered == total) break;
  }
  if (covered != total) {
    // Where the first element none of the parts holds is.
    std::vector<uint8_t> in(static_cast<size_t>(total), 0);
    for (const QuantizedPart& p : parts) {
      for (int64_t i = 0; i < p.box.extent[0]; ++i) {
        std::memset(&in[(p.box.offset[0] + i) * c.shape[1] + p.box.offset[1]],
                    1, static_cast<size_t>(p.box.extent[1]));
      }
    }
    const int64_t k =
        static_cast<const uint8_t*>(std::memchr(in.data(), 0, in.size())) -
        in.data();
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint parameter ", c.name,
        " is quantized in flight, but its "
        "trainer ranks' pieces cannot be split into parts without overlap "
        "that cover it: element [",
        k / c.shape[1], ", ", k % c.shape[1],
        "] is in none (replicas cut differently on different nodes?)"));
  }
  for (const QuantizedPart& p : parts) {
    if (p.node != home) return parts;
  }
  return std::vector<QuantizedPart>{};
}

namespace {

// A readable piece that holds `box`, or null.
const HeldPiece* Holder(const Box& box, const std::vector<HeldPiece>& held,
                        const std::function<bool(const HeldPiece&)>& readable) {
  for (const HeldPiece& h : held) {
    if (Contains(h.piece->box, box) && readable(h)) return &h;
  }
  return nullptr;
}

const HeldPiece* Holder(const Box& box, const std::vector<HeldPiece>& held,
                        const std::vector<std::vector<const uint8_t*>>& bases) {
  return Holder(box, held, [&](const HeldPiece& x) {
    return BaseOf(x, bases) != nullptr;
  });
}

// Where part `p` lies in its holder's memory when it is whole rows of P
// held row-major and contiguous (an FSDP shard's middle, a TP row shard):
// read there, no copy. Null otherwise.
const uint8_t* InPlace(const ModelSpec& model, const QuantizedParam& q,
                       const QuantizedPart& p,
                       const std::vector<HeldPiece>& held,
                       const std::vector<std::vector<const uint8_t*>>& bases) {
  const ParamSpec& c = model.params[q.param];
  const int64_t cols = c.shape[1];
  if (p.box.offset[1] != 0 || p.box.extent[1] != cols) return nullptr;
  const HeldPiece* h = Holder(p.box, held, bases);
  if (h == nullptr || h->piece->strides != Dims{cols, 1}) return nullptr;
  const int64_t row = p.box.offset[0] - h->piece->box.offset[0];
  return BaseOf(*h, bases) + h->piece->byte_offset +
         row * cols * UnitBytes(c.dtype);
}

// The parts on `at` that are not read in place, and the rows of P from
// the first of them to the end of the last.
struct Band {
  int64_t r0 = 0, r1 = 0;
  std::vector<const QuantizedPart*> parts;
};

Band BandOn(const ModelSpec& model, const QuantizedParam& q,
            const std::string& at, const std::vector<HeldPiece>& held,
            const std::vector<std::vector<const uint8_t*>>& bases) {
  Band band;
  band.r0 = model.params[q.param].shape[0];
  for (const QuantizedPart& p : q.parts) {
    if (p.node != at || InPlace(model, q, p, held, bases) != nullptr) continue;
    band.parts.push_back(&p);
    band.r0 = std::min(band.r0, p.box.offset[0]);
    band.r1 = std::max(band.r1, p.box.offset[0] + p.box.extent[0]);
  }
  if (band.parts.empty()) band.r0 = band.r1 = 0;
  return band;
}

// The band's rows of P, row-major, its parts filled in and every other
// element zero (a zero never raises a block's max |x|).
std::vector<uint8_t> BandValues(
    const ModelSpec& model, const QuantizedParam& q, const Band& band,
    const std::vector<HeldPiece>& held,
    const std::vector<std::vector<const uint8_t*>>& bases) {
  const ParamSpec& c = model.params[q.param];
  const Box rows{{band.r0, 0}, {band.r1 - band.r0, c.shape[1]}};
  std::vector<uint8_t> values(BoxBytes(rows, c.dtype), 0);
  const Piece target = Piece::Contiguous(q.param, rows, 0, 0, c.dtype);
  for (const QuantizedPart* p : band.parts) {
    const HeldPiece* h = Holder(p->box, held, bases);
    CopyBoxBetweenPieces(BaseOf(*h, bases), *h->piece, values.data(), target,
                         p->box, c.dtype);
  }
  return values;
}

Fp8BlockShape WholeShape(const ModelSpec& model, const QuantizedParam& q) {
  const Dims& shape = model.params[q.param].shape;
  return Fp8BlockShape{shape[0], shape[1], q.block_rows, q.block_cols};
}

}  // namespace

absl::Status CheckPartsReadable(
    const ModelSpec& model, const QuantizedParam& q, const std::string& at,
    const std::vector<HeldPiece>& held,
    const std::function<bool(const HeldPiece&)>& readable) {
  for (const QuantizedPart& p : q.parts) {
    if (p.node != at || Holder(p.box, held, readable) != nullptr) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "quantizing ", model.params[q.param].name, " on ", at, ": its part ",
        BoxToString(p.box),
        " is on no trainer rank readable there (in GPU memory where this "
        "ferryd has no GPUs, or gone)"));
  }
  return absl::OkStatus();
}

absl::Status PartialAmax(const ModelSpec& model, const QuantizedParam& q,
                         const std::string& at,
                         const std::vector<HeldPiece>& held,
                         const std::vector<std::vector<const uint8_t*>>& bases,
                         uint32_t* max_bits) {
  const DType dtype = model.params[q.param].dtype;
  const Fp8BlockShape whole = WholeShape(model, q);
  for (const QuantizedPart& p : q.parts) {
    if (p.node != at) continue;
    const uint8_t* rows = InPlace(model, q, p, held, bases);
    if (rows == nullptr) continue;
    absl::Status s = RaiseRowsAbsMaxBits(rows, dtype, whole, p.box.offset[0],
                                         p.box.extent[0], max_bits);
    if (!s.ok()) return s;
  }
  const Band band = BandOn(model, q, at, held, bases);
  if (band.parts.empty()) return absl::OkStatus();
  const std::vector<uint8_t> values = BandValues(model, q, band, held, bases);
  return RaiseRowsAbsMaxBits(values.data(), dtype, whole, band.r0,
                             band.r1 - band.r0, max_bits);
}

absl::Status QuantizeParts(
    const ModelSpec& model, const QuantizedParam& q, const std::string& at,
    const std::vector<HeldPiece>& held,
    const std::vector<std::vector<const uint8_t*>>& bases,
    const uint32_t* max_bits, uint8_t* fp8_buffer, uint8_t* scale_buffer) {
  const DType dtype = model.params[q.param].dtype;
  const Fp8BlockShape whole = WholeShape(model, q);
  if (scale_buffer != nullptr) {
    float* scales = reinterpret_cast<float*>(scale_buffer + q.scale_offset);
    const int64_t n = whole.block_grid_rows() * whole.block_grid_cols();
    for (int64_t k = 0; k < n; ++k)
      scales[k] = Fp8ScaleInv(max_bits[k], q.format);
  }
  // Whole rows held row-major: quantized from where they are straight
  // into the part's place (row-major over its box: the same rows).
  for (const QuantizedPart& p : q.parts) {
    if (p.node != at) continue;
    const uint8_t* rows = InPlace(model, q, p, held, bases);
    if (rows == nullptr) continue;
    absl::Status s =
        QuantizeRows(rows, dtype, whole, p.box.offset[0], p.box.extent[0],
                     q.format, max_bits, fp8_buffer + p.fp8_offset, nullptr);
    if (!s.ok()) return s;
  }
  // The others copied into a band first.
  const Band band = BandOn(model, q, at, held, bases);
  if (band.parts.empty()) return absl::OkStatus();
  const std::vector<uint8_t> values = BandValues(model, q, band, held, bases);
  const Box rows{{band.r0, 0}, {band.r1 - band.r0, whole.cols}};
  std::vector<uint8_t> codes(static_cast<size_t>(Volume(rows)));
  absl::Status s =
      QuantizeRows(values.data(), dtype, whole, band.r0, band.r1 - band.r0,
                   q.format, max_bits, codes.data(), nullptr);
  if (!s.ok()) return s;
  const Piece from = Piece::Contiguous(q.fp8_param, rows, 0, 0, q.format);
  for (const QuantizedPart* p : band.parts) {
    const Piece to =
        Piece::Contiguous(q.fp8_param, p->box, 0, p->fp8_offset, q.format);
    CopyBoxBetweenPieces(codes.data(), from, fp8_buffer, to, p->box, q.format);
  }
  return absl::OkStatus();
}

std::string PackMaxBits(const std::vector<uint32_t>& bits) {
  std::string out(bits.size() * 4, '\0');
  for (size_t k = 0; k < bits.size(); ++k) {
    for (int j = 0; j < 4; ++j) {
      out[4 * k + j] = static_cast<char>(bits[k] >> (8 * j));
    }
  }
  return out;
}

absl::StatusOr<std::vector<uint32_t>> UnpackMaxBits(const std::string& packed,
                                                    int64_t blocks) {
  if (blocks < 0 || static_cast<int64_t>(packed.size()) != blocks * 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_bits of ", packed.size(), " bytes for a grid of ",
                     blocks, " blocks (4 bytes each)"));
  }
  std::vector<uint32_t> out(static_cast<size_t>(blocks));
  const auto* x = reinterpret_cast<const uint8_t*>(packed.data());
  for (size_t k = 0; k < out.size(); ++k, x += 4) {
    out[k] = uint32_t{x[0]} | uint32_t{x[1]} << 8 | uint32_t{x[2]} << 16 |
             uint32_t{x[3]} << 24;
  }
  return out;
}

}  // namespace ferry

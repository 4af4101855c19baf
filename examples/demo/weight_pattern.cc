#include "examples/demo/weight_pattern.h"

#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ferry {
namespace {

inline uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline uint64_t Word(uint64_t seed, int64_t word_index) {
  return Mix(seed ^ (static_cast<uint64_t>(word_index) * 0xd6e8feb86659fd93ull));
}

inline uint8_t ByteAt(uint64_t seed, int64_t global_byte) {
  return static_cast<uint8_t>(Word(seed, global_byte / 8) >>
                              (8 * (global_byte % 8)));
}

// Calls fn(local_byte_offset, global_byte, bytes) for each contiguous run of
// the piece: local offsets from the piece's buffer base, global bytes in the
// parameter's row-major byte stream.
void ForEachRun(const ParamSpec& param, const Piece& piece,
                const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  const int64_t unit = UnitBytes(param.dtype);
  const Box sbox = StorageBox(piece.box, param.dtype);
  const Dims gshape = StorageShape(param.shape, param.dtype);
  const Dims gstrides = RowMajorStrides(gshape);
  const Dims strides = piece.strides.empty()
                           ? RowMajorStrides(sbox.extent)
                           : piece.strides;
  const size_t rank = sbox.rank();
  if (rank == 0) {
    fn(piece.byte_offset, 0, unit);
    return;
  }
  for (int64_t e : sbox.extent) {
    if (e == 0) return;
  }
  const int64_t row = sbox.extent[rank - 1];
  const bool contiguous = strides[rank - 1] == 1;
  Dims index(rank, 0);  // over all dims but the last
  while (true) {
    int64_t global = sbox.offset[rank - 1];
    int64_t local = 0;
    for (size_t d = 0; d + 1 < rank; ++d) {
      global += (sbox.offset[d] + index[d]) * gstrides[d];
      local += index[d] * strides[d];
    }
    if (contiguous) {
      fn(piece.byte_offset + local * unit, global * unit, row * unit);
    } else {
      for (int64_t i = 0; i < row; ++i) {
        fn(piece.byte_offset + (local + i * strides[rank - 1]) * unit,
           (global + i) * unit, unit);
      }
    }
    // Next index, last-but-one dim fastest.
    size_t d = rank - 1;
    while (d > 0) {
      --d;
      if (++index[d] < sbox.extent[d]) break;
      index[d] = 0;
      if (d == 0) return;
    }
    if (rank == 1) return;
  }
}

}  // namespace

uint64_t PatternSeed(int64_t version, absl::string_view parameter) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a of the name
  for (char c : parameter) {
    h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
  }
  return Mix(h ^ Mix(static_cast<uint64_t>(version)));
}

void FillPattern(uint64_t seed, int64_t global_byte, uint8_t* out, int64_t n) {
  int64_t i = 0;
  // Head up to a word boundary, then whole words (little-endian), then tail.
  while (i < n && (global_byte + i) % 8 != 0) {
    out[i] = ByteAt(seed, global_byte + i);
    ++i;
  }
  for (; i + 8 <= n; i += 8) {
    const uint64_t w = Word(seed, (global_byte + i) / 8);
    std::memcpy(out + i, &w, 8);
  }
  for (; i < n; ++i) out[i] = ByteAt(seed, global_byte + i);
}

int64_t FindPatternMismatch(uint64_t seed, int64_t global_byte,
                            const uint8_t* data, int64_t n) {
  int64_t i = 0;
  while (i < n && (global_byte + i) % 8 != 0) {
    if (data[i] != ByteAt(seed, global_byte + i)) return i;
    ++i;
  }
  for (; i + 8 <= n; i += 8) {
    const uint64_t w = Word(seed, (global_byte + i) / 8);
    if (std::memcmp(data + i, &w, 8) != 0) {
      for (int64_t j = i; j < i + 8; ++j) {
        if (data[j] != ByteAt(seed, global_byte + j)) return j;
      }
    }
  }
  for (; i < n; ++i) {
    if (data[i] != ByteAt(seed, global_byte + i)) return i;
  }
  return -1;
}

void FillPiece(int64_t version, const ParamSpec& param, const Piece& piece,
               uint8_t* buffer) {
  const uint64_t seed = PatternSeed(version, param.name);
  ForEachRun(param, piece, [&](int64_t local, int64_t global, int64_t n) {
    FillPattern(seed, global, buffer + local, n);
  });
}

absl::Status CheckPiece(int64_t version, const ParamSpec& param,
                        const Piece& piece, const uint8_t* buffer) {
  const uint64_t seed = PatternSeed(version, param.name);
  int64_t first_global = -1, bad_runs = 0;
  uint8_t expected = 0, actual = 0;
  ForEachRun(param, piece, [&](int64_t local, int64_t global, int64_t n) {
    const int64_t at = FindPatternMismatch(seed, global, buffer + local, n);
    if (at < 0) return;
    ++bad_runs;
    if (first_global < 0) {
      first_global = global + at;
      expected = ByteAt(seed, global + at);
      actual = buffer[local + at];
    }
  });
  if (first_global < 0) return absl::OkStatus();
  return absl::DataLossError(absl::StrFormat(
      "%s box %s at version %d: byte %d of the tensor is 0x%02x, expected "
      "0x%02x (%d of the piece's rows differ)",
      param.name, BoxToString(piece.box), version, first_global, actual,
      expected, bad_runs));
}

}  // namespace ferry

// The demo's weights: deterministic bytes that the trainer writes and the
// engine checks, each computing them on its own.
//
// Byte b of the row-major byte stream of parameter `name` at version v is
// a pure function of (v, name, b): the low bytes of a 64-bit mix of the
// seed and b / 8. So the engine can verify every byte it received without
// seeing the trainer's memory, and a byte that lands in the wrong place,
// the wrong tensor or the wrong version is caught (each differs with
// probability 255/256 per byte).
//
// Pieces are walked in storage units (core/piece.h): a piece's box maps to
// runs of the parameter's global byte stream, one run per innermost row.
#ifndef FERRY_EXAMPLES_DEMO_WEIGHT_PATTERN_H_
#define FERRY_EXAMPLES_DEMO_WEIGHT_PATTERN_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/piece.h"

namespace ferry {

// The seed of one parameter at one version.
uint64_t PatternSeed(int64_t version, absl::string_view parameter);

// Writes bytes [global_byte, global_byte + n) of the stream to `out`.
void FillPattern(uint64_t seed, int64_t global_byte, uint8_t* out, int64_t n);
// The index (0-based, within the n bytes) of the first byte of `data` that
// differs from the stream at global_byte, or -1 when all n match.
int64_t FindPatternMismatch(uint64_t seed, int64_t global_byte,
                            const uint8_t* data, int64_t n);

// Writes the pattern of `param` at `version` into the bytes of `piece` in
// `buffer` (the base of the piece's buffer). REQUIRES: a validated piece.
void FillPiece(int64_t version, const ParamSpec& param, const Piece& piece,
               uint8_t* buffer);
// DATA_LOSS naming the parameter, the piece's box, the first differing
// global byte, expected and actual, and how many bytes differ.
absl::Status CheckPiece(int64_t version, const ParamSpec& param,
                        const Piece& piece, const uint8_t* buffer);

}  // namespace ferry

#endif  // FERRY_EXAMPLES_DEMO_WEIGHT_PATTERN_H_

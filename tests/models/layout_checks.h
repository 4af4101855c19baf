// Checks on whole layouts (all ranks of a trainer or an instance) shared by
// the layout tests.
#ifndef FERRY_TESTS_MODELS_LAYOUT_CHECKS_H_
#define FERRY_TESTS_MODELS_LAYOUT_CHECKS_H_

#include <string>
#include <vector>

#include "core/piece.h"

namespace ferry {

// Empty when the layout is sound, else the first problem, naming the
// parameter, rank and box:
// - every piece's box lies inside its parameter and is block-aligned;
// - every piece lies inside its rank's buffer and occupies exactly its own
//   bytes (the synthetic layouts store each piece contiguously), and no two
//   pieces of a rank share a byte;
// - for each parameter, the distinct boxes over all ranks (identical boxes
//   are replicas) are pairwise disjoint and their volumes sum to the
//   parameter's: together they tile it exactly once.
std::string CheckTiling(const ModelSpec& model,
                        const std::vector<RankLayout>& ranks);

}  // namespace ferry

#endif  // FERRY_TESTS_MODELS_LAYOUT_CHECKS_H_

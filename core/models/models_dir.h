// Where the model schema files (shared/models/*.json) live.
//
// The repository is cloned at some path P and the schemas live beside the
// clone, at P/../shared/models (CI copies shared/ beside its clone the same
// way). Bazel runs tests and binaries from a runfiles tree inside its output
// base, far from P, so the search also starts from the real path of a source
// file in the runfiles tree, which leads back into the clone.
#ifndef FERRY_CORE_MODELS_MODELS_DIR_H_
#define FERRY_CORE_MODELS_MODELS_DIR_H_

#include <string>

#include "absl/status/statusor.h"

namespace ferry {

// The models directory, in this order:
//   1. $FERRY_MODELS_DIR (an error if it is set but not a directory);
//   2. the first `shared/models` found walking up from the current
//      directory (so P/shared/models and P/../shared/models both match);
//   3. the same walk from the runfiles directory ($RUNFILES_DIR,
//      $TEST_SRCDIR or <executable>.runfiles) and from the real path of
//      this package's header inside it.
// NOT_FOUND lists where it looked.
absl::StatusOr<std::string> FindModelsDir();

}  // namespace ferry

#endif  // FERRY_CORE_MODELS_MODELS_DIR_H_

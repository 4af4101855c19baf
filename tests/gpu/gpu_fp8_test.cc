// The FP8 block kernel (cuda/kernels/fp8_block_quantizer.h) against the
// oracle written from the rule (tests/core/fp8_oracle.h): every e4m3 and
// e5m2 byte and every scale of bf16, f16 and f32 tensors with outliers,
// zeros, negative zeros, subnormal results and short last blocks. The CPU
// routine meets the same oracle in tests/core/fp8_blocks_test.cc, so the
// two give the same bytes. Skips visibly without a GPU.
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <random>
#include <vector>

#include "core/fp8_blocks.h"
#include "cuda/kernels/fp8_block_quantizer.h"
#include "tests/core/fp8_oracle.h"
#include "tests/gpu/device_buffers.h"

namespace ferry {
namespace {

using namespace fp8_oracle;  // NOLINT: the oracle is this test's subject
using gpu_testing::DeviceBuffer;

// A bf16 tensor with the cases the rule must get right.
std::vector<uint16_t> Tensor(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, 0.02f);
  std::vector<uint16_t> x(rows * cols);
  for (uint16_t& v : x) v = ToBf16Truncated(normal(rng));
  for (int64_t c = 0; c < std::min<int64_t>(cols, 128); ++c) {
    x[c] = c % 2 ? 0x8000 : 0;  // zeros and negative zeros
  }
  if (rows > 130) x[130 * cols + 7] = ToBf16Truncated(-3000.0f);  // outlier
  return x;
}

void Check(const std::vector<uint16_t>& x, const Fp8BlockShape& shape,
           DType fp8) {
  DeviceBuffer src(x.size() * 2), out(x.size()),
      scales(shape.block_grid_rows() * shape.block_grid_cols() * 4);
  FERRY_CUDA_CHECK(cudaMemcpy(src.get(), x.data(), x.size() * 2,
                              cudaMemcpyHostToDevice));
  absl::Status s = gpu::QuantizeBlocksOnGpu(
      src.get(), DType::kBF16, shape, fp8, out.get(),
      reinterpret_cast<float*>(scales.get()), nullptr);
  INFO(s.ToString());
  REQUIRE(s.ok());
  FERRY_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint8_t> got(x.size());
  std::vector<float> got_scales(shape.block_grid_rows() * shape.block_grid_cols());
  FERRY_CUDA_CHECK(cudaMemcpy(got.data(), out.get(), got.size(),
                              cudaMemcpyDeviceToHost));
  FERRY_CUDA_CHECK(cudaMemcpy(got_scales.data(), scales.get(),
                              got_scales.size() * 4, cudaMemcpyDeviceToHost));
  INFO(DTypeName(fp8) << " [" << shape.rows << ", " << shape.cols << "]");
  CHECK(DifferenceFromRule(x, shape, fp8, got, got_scales) == "");
}

TEST_CASE("the FP8 block kernel gives the rule's bytes and scales",
          "[gpu][fp8]") {
  FERRY_SKIP_WITHOUT_GPU();
  for (DType fp8 : {DType::kF8E4M3, DType::kF8E5M2}) {
    Fp8BlockShape shape{300, 200, 128, 128};  // short last blocks
    Check(Tensor(shape.rows, shape.cols, 3), shape, fp8);
    Fp8BlockShape big{2048, 1536, 128, 128};
    Check(Tensor(big.rows, big.cols, 5), big, fp8);
  }
}

}  // namespace
}  // namespace ferry

// Helper process for gpu_ipc_test and the update benchmark: allocates
// `bytes` (argv[1], default 1 MiB) on device 0, fills byte i with
// (i * 7 + 3) mod 256, prints the allocation's CUDA IPC handle as hex on
// one line, and keeps the allocation alive until stdin closes.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/ipc/ipc_memory_cache.h"

int main(int argc, char** argv) {
  const size_t bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1 << 20;
  void* p = nullptr;
  if (cudaSetDevice(0) != cudaSuccess || cudaMalloc(&p, bytes) != cudaSuccess) {
    std::printf("ERROR cudaMalloc\n");
    return 1;
  }
  std::vector<unsigned char> host(bytes);
  for (size_t i = 0; i < bytes; ++i) host[i] = static_cast<unsigned char>(i * 7 + 3);
  if (cudaMemcpy(p, host.data(), bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
    std::printf("ERROR cudaMemcpy\n");
    return 1;
  }
  absl::StatusOr<std::string> h = ferry::gpu::ExportCudaIpcHandle(p);
  if (!h.ok()) {
    std::printf("ERROR %s\n", h.status().ToString().c_str());
    return 1;
  }
  for (unsigned char c : *h) std::printf("%02x", c);
  std::printf("\n");
  std::fflush(stdout);
  char buf[64];
  while (std::fread(buf, 1, sizeof(buf), stdin) > 0) {
  }
  cudaFree(p);
  return 0;
}

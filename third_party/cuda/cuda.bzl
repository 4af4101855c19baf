"""Macros for CUDA targets: nvcc-compiled libraries and the compatibility
constraint that makes CUDA targets SKIPPED where there is no toolkit."""

load("@local_cuda//:defs.bzl", "CUDA_FOUND", "NVCC")

def cuda_compatible():
    """target_compatible_with value for anything that needs CUDA."""
    if not CUDA_FOUND:
        return ["@platforms//:incompatible"]
    return select({
        "//third_party/cuda:cuda_enabled": [],
        "//conditions:default": ["@platforms//:incompatible"],
    })

def cuda_library(name, srcs, hdrs = [], deps = [], **kwargs):
    """Compiles .cu files with nvcc (sm_90 SASS + compute_90 PTX) into a
    static library and wraps it for cc_ rules."""
    objs = []
    for src in srcs:
        obj = name + "_" + src.replace("/", "_").replace(".cu", ".o")
        native.genrule(
            name = obj + "_nvcc",
            srcs = [src] + hdrs + ["@local_cuda//:cuda_headers"],
            outs = [obj],
            cmd = ("{nvcc} -std=c++17 -O3 -Xcompiler -fPIC " +
                   "-gencode arch=compute_90,code=sm_90 " +
                   "-gencode arch=compute_90,code=compute_90 " +
                   "-I. -I$(GENDIR) -c $(location {src}) -o $@").format(nvcc = NVCC, src = src),
            target_compatible_with = cuda_compatible(),
        )
        objs.append(obj)
    native.genrule(
        name = name + "_ar",
        srcs = objs,
        outs = ["lib" + name + "_kernels.a"],
        cmd = "ar rcs $@ $(SRCS)",
        target_compatible_with = cuda_compatible(),
    )
    native.cc_import(
        name = name + "_import",
        static_library = "lib" + name + "_kernels.a",
        alwayslink = True,
        # Bazel 4.2.3's cc_import has no target_compatible_with; it is
        # incompatible through the genrule it imports.
    )
    native.cc_library(
        name = name,
        hdrs = hdrs,
        deps = [name + "_import", "@local_cuda//:cudart"] + deps,
        target_compatible_with = cuda_compatible(),
        **kwargs
    )

def if_cuda(if_true, if_false = []):
    """`if_true` where CUDA targets build (a toolkit, not --config=nocuda),
    else `if_false`: for the few places that pick a CUDA or host-only
    implementation, such as ferryd's GPUs."""
    if not CUDA_FOUND:
        return if_false
    return select({
        "//third_party/cuda:cuda_enabled": if_true,
        "//conditions:default": if_false,
    })

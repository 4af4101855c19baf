"""Finds a local CUDA toolkit (with NCCL) without downloading anything.

Looks at $CUDA_PATH, then /usr/local/cuda. When found, the repository
exposes `:cuda_headers`, `:cudart`, `:nccl` and the nvcc path in
`defs.bzl`; when not, the same names exist but `CUDA_FOUND` is False and
every CUDA target is incompatible (reported SKIPPED by `bazel test`).
Headers are linked into the repository because Bazel refuses absolute
include paths outside the workspace.
"""

def _cuda_configure_impl(ctx):
    cuda_path = ctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    root = ctx.path(cuda_path)
    found = (root.get_child("include").get_child("cuda_runtime.h").exists and
             root.get_child("include").get_child("nccl.h").exists and
             root.get_child("bin").get_child("nvcc").exists)
    if found:
        ctx.symlink(root.get_child("include"), "include")
        ctx.symlink(root.get_child("lib64"), "lib64")
        ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "cuda_headers",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.inl"]),
    # Extension-less headers: nccl.h includes cuda_fp16.h, which includes
    # <nv/target> (and CCCL's <cuda/std/...>).
    textual_hdrs = glob(
        ["include/**"],
        exclude = ["include/**/*.h", "include/**/*.hpp", "include/**/*.inl"],
    ),
    includes = ["include"],
)

cc_library(
    name = "cudart",
    linkopts = ["-L{root}/lib64", "-Wl,-rpath,{root}/lib64", "-lcudart"],
    deps = [":cuda_headers"],
)

cc_library(
    name = "nccl",
    linkopts = ["-L{root}/lib64", "-Wl,-rpath,{root}/lib64", "-lnccl"],
    deps = [":cuda_headers"],
)
""".format(root = cuda_path))
    else:
        ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

cc_library(name = "cuda_headers")
cc_library(name = "cudart")
cc_library(name = "nccl")
""")
    ctx.file("defs.bzl", "CUDA_FOUND = {}\nNVCC = \"{}\"\nCUDA_ROOT = \"{}\"\n".format(
        found,
        cuda_path + "/bin/nvcc" if found else "",
        cuda_path if found else "",
    ))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH"],
    local = True,
)

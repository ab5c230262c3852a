# tierckpt: `make demo` (the main job on embedded defaults) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv demo-venv test test-long faults lint typecheck demo proto bench clean

venv: $(VENV)/.installed
demo-venv: $(VENV)/.demo-installed

# What the demo needs and nothing more: the daemon and torch (the CPU build, pinned once, in
# requirements-test.txt), ~1 minute and ~1 GB on a fresh machine; pip shows what it fetches.
$(VENV)/.demo-installed: pyproject.toml requirements-test.txt
	@echo "== make demo: installing what it needs into $(VENV)/ (about a minute on a fresh machine) =="
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q --upgrade pip
	@echo "== [1/2] torch, the CPU build (the largest part) =="
	$(PY) -m pip install --disable-pip-version-check --progress-bar on "$$(grep -m1 '^torch==' requirements-test.txt)"
	@echo "== [2/2] the daemon and the client (tierckpt[daemon,torch], editable; setuptools' banner hidden) =="
	PYTHONWARNINGS=ignore $(PY) -m pip install --disable-pip-version-check -q -e '.[daemon,torch]'
	touch $@

$(VENV)/.installed: pyproject.toml requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-test.txt
	PYTHONWARNINGS=ignore $(PY) -m pip install -q -e '.[daemon,s3,gcs,torch,dev]'  # no setuptools editable-install banner
	touch $@

test: venv
	$(PY) -m pytest -q -m "not long" --durations=25 $(PYTEST_ARGS)

# The longer variants (real network namespaces, repeated kill -9) and a 5,000-example fuzz run.
test-long: venv
	$(PY) -m pytest -q -m long $(PYTEST_ARGS)
	TIERCKPT_FUZZ_EXAMPLES=5000 $(PY) -m pytest -q tests/faults/test_fuzz.py $(PYTEST_ARGS)

# The fault matrix and the fuzz suite, then the matrix with pass/fail and the counts.
FAULTS_RESULTS ?= .faults-results.json
faults: venv
	TIERCKPT_FAULTS_RESULTS=$(FAULTS_RESULTS) $(PY) -m pytest -q -m "not long" tests/faults $(PYTEST_ARGS); \
	rc=$$?; $(PY) tests/faults/report.py $(FAULTS_RESULTS); exit $$rc

# Static checks, run by .ci/run before the tests.
lint: venv
	$(VENV)/bin/ruff check client daemon tests bench examples

typecheck: venv
	$(VENV)/bin/mypy

demo: demo-venv
	@echo "== make demo: three daemons and four trainers on loopback, four failures (a few minutes) =="
	$(PY) examples/demo.py

# Regenerate the committed gRPC code from protos/ (a test fails if it is stale).
proto: venv
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=client --pyi_out=client --grpc_python_out=client protos/tierckpt/v1/*.proto

bench: venv
	$(PY) bench/local_tier.py

clean:
	rm -rf .demo .pytest_cache build *.egg-info .faults-results.json

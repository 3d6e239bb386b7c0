# The two commands of the README do all set-up themselves: they create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo audit test test-all lint protos clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

PRIVACY ?= secagg
demo: $(STAMP)
	$(PY) -m aggregator demo --dir runs/consortium-demo --privacy $(PRIVACY)

# The privacy audit (configs/audit.toml): report in runs/audit; exits 1 if an audited mode leaks.
audit: $(STAMP)
	$(PY) -m attacks.evaluate --out runs/audit

TOOLS := .tools/node_modules/.bin
# buf is pinned exactly in .tools/package.json; no lock file, because npm records only this platform's binary.
$(TOOLS)/buf: .tools/package.json
	cd .tools && npm install --no-audit --no-fund --no-package-lock --loglevel=error
	touch $@

lint: $(STAMP) $(TOOLS)/buf
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(TOOLS)/buf lint
	$(TOOLS)/buf format --diff --exit-code

# Regenerate the committed stubs after editing protos/ (tests/test_protos.py checks they are current).
protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/fedlt/v1/*.proto

test: lint
	$(PY) -m pytest -m "not slow" -q

# Two workers: most slow tests keep one core busy (a serial run took 65 min on 2 cores, 106% CPU).
test-all: lint
	$(PY) -m pytest -q -n 2 --durations=25

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis .tools/node_modules

# The two commands a newcomer runs: `make run` (the relay end to end, locally)
# and `make test` (everything CI checks). Both install what they need first.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PYPROJECT_SUM := $(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# Two stamps, one venv: `make run` installs the `local` extra only (the demo,
# `outbox worker`, `outbox invoke`); `make test` adds the dev tools (the PEP 735
# group `dev` of pyproject.toml) on top.
RUN_STAMP := $(VENV)/.installed-run-$(PYPROJECT_SUM)
STAMP     := $(VENV)/.installed-dev-$(PYPROJECT_SUM)
# `make docs` and `make wheel` need only their own groups (MkDocs; build), not
# the dev tools: each has a stamp of its own (the dev group includes both).
DOCS_STAMP  := $(VENV)/.installed-docs-$(PYPROJECT_SUM)
BUILD_STAMP := $(VENV)/.installed-build-$(PYPROJECT_SUM)

# What a producer installs (SQLAlchemy, fastjsonschema, a driver), the
# command's extra and the worker's, kept as wheels: the packaging test installs
# the built wheel from them into fresh venvs, offline.
WHEELHOUSE_REQUIREMENTS := 'sqlalchemy>=2.0,<2.2' 'fastjsonschema>=2.19,<3' 'pg8000>=1.31,<2' \
	'click>=8.1' 'rich>=13' 'alembic>=1.13,<2' \
	'aws-lambda-powertools>=3.0,<4' 'python-dateutil>=2.8.2,<3' 'boto3>=1.34'
WHEELHOUSE := $(VENV)/wheelhouse/.complete-$(shell echo "$(WHEELHOUSE_REQUIREMENTS)" | cksum | cut -d' ' -f1)

.PHONY: run test test-embedded lint typecheck pytest sam-check build deploy-try bench clean venv requirements requirements-check wheel docs schema \
	template

venv: $(STAMP) $(WHEELHOUSE)

# pip 25.1 or newer reads dependency groups (--group); the venv's pip is upgraded first.
$(RUN_STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "Python 3.11 or newer is needed (found $$($(PYTHON) --version))"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# An editable install of releases before 0.1.0 left its metadata in the layer's folder.
	rm -rf layers/outbox/outbox_relay.egg-info
	$(BIN)/python -m pip install -q -e '.[local]'
	rm -f $(VENV)/.installed-*
	touch $@

$(STAMP): $(RUN_STAMP)
	$(BIN)/python -m pip install -q -e '.[local]' --group dev
	rm -f $(VENV)/.installed-dev-*
	touch $@

$(DOCS_STAMP): $(RUN_STAMP)
	$(BIN)/python -m pip install -q -e '.[local]' --group docs
	touch $@

$(BUILD_STAMP): $(RUN_STAMP)
	$(BIN)/python -m pip install -q --group build
	touch $@

$(WHEELHOUSE): $(STAMP)
	rm -rf $(VENV)/wheelhouse
	$(BIN)/python -m pip download -q -d $(VENV)/wheelhouse $(WHEELHOUSE_REQUIREMENTS)
	touch $@

run: $(RUN_STAMP)
	$(BIN)/python -m outbox_cli.local

test: lint typecheck docs pytest sam-check

# The documentation site (mkdocs.yml) into site/. Strict: a broken link or
# anchor, or a generated page that fails, fails the build. `mkdocs serve` (in
# the venv) serves it while you edit. Not --quiet: it hides the warnings that
# --strict turns into a failure, and the build then passes.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: $(STAMP) requirements-check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The layer's pinned requirements, compiled from pyproject.toml's `lambda` extra
# for the Lambda runtime (Python 3.12 on Linux). Never edit the file by hand:
# change pyproject.toml and run `make requirements`. The check compiles again
# (the current pins are uv's preferences, so only a changed pyproject.toml moves
# them) and fails when the file differs.
LAYER_REQUIREMENTS := layers/outbox/requirements.txt
UV_COMPILE = $(BIN)/uv pip compile --quiet pyproject.toml --extra lambda \
	--python-version 3.12 --python-platform x86_64-manylinux_2_28 \
	--custom-compile-command "make requirements"

requirements: $(STAMP)
	$(UV_COMPILE) -o $(LAYER_REQUIREMENTS)

requirements-check: $(STAMP)
	@tmp="$$(mktemp -d)"; cp $(LAYER_REQUIREMENTS) "$$tmp/requirements.txt"; \
	$(UV_COMPILE) -o "$$tmp/requirements.txt" && \
	diff -u $(LAYER_REQUIREMENTS) "$$tmp/requirements.txt" || \
	{ echo "$(LAYER_REQUIREMENTS) is out of step with pyproject.toml: run make requirements"; \
	  rm -rf "$$tmp"; exit 1; }; rm -rf "$$tmp"

# layers/outbox/outbox/store/schema.sql, the head schema for a reader, from the
# migration chain (migrated into a throwaway database, then pg_dump). Run it
# after adding a migration; tests/integration/test_schema_sql.py checks it.
schema: $(STAMP)
	$(BIN)/python -m outbox_cli.schema

# template.yaml from templategen/: one declaration per channel
# (templategen/channels.yaml) and the rest of the template
# (templategen/template.yaml.j2). Run it after editing either; never edit
# template.yaml by hand. tests/template/test_generated.py checks it.
template: $(STAMP)
	$(BIN)/python -m templategen

# The distribution (wheel and sdist) in dist/.
wheel: $(BUILD_STAMP)
	$(BIN)/python -m build --outdir dist .

typecheck: $(STAMP)
	$(BIN)/mypy

# checkov, for tests/template/test_scanners.py. It pins boto3, packaging and
# networkx to versions of its own, so it lives in its own venv, as the SAM CLI does.
CHECKOV_VENV  := .tools/checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed

$(CHECKOV_STAMP):
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q --upgrade pip
	$(CHECKOV_VENV)/bin/python -m pip install -q 'checkov>=3.2,<4'
	touch $@

pytest: $(STAMP) $(WHEELHOUSE) $(CHECKOV_STAMP)
	$(BIN)/pytest

# The state machine's SQL once more on the embedded Postgres (pgserver), as a
# machine without a Postgres runs it; .ci/run runs it after `make test`.
EMBEDDED_TESTS := tests/integration/test_claim.py tests/integration/test_reaper.py \
	tests/integration/test_sql_enqueue.py tests/integration/test_tenants.py \
	tests/integration/test_schema_sql.py tests/integration/test_migrate.py \
	tests/integration/test_grants.py tests/integration/test_least_privilege.py \
	tests/integration/test_search_path.py tests/integration/test_planted_builtins.py \
	tests/integration/test_ordering.py tests/integration/test_dedupe.py \
	tests/integration/test_cooldown.py tests/integration/test_receipt.py \
	tests/integration/test_release_fence.py tests/integration/test_history.py \
	tests/integration/test_sender.py tests/integration/test_prepared_claim.py

test-embedded: $(STAMP)
	OUTBOX_DEV_DB=embedded $(BIN)/pytest -q $(EMBEDDED_TESTS)

# --- sam-check: sam validate --lint, sam build, then the built-artifact test ----
# The SAM CLI pins many packages, so it lives in its own venv, not the project's.
# sam build and the built-artifact test need the Lambda runtime's Python (3.12):
# from pyenv when present, else python3.12 on PATH.
SAM_VENV   := .tools/sam
SAM        := $(SAM_VENV)/bin/sam
SAM_STAMP  := $(SAM_VENV)/.installed
RT312      := .tools/runtime312
RT312_STAMP := $(RT312)/.installed
FIND_PY312 := for p in "$$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 \
	"$$(command -v python3.12 2>/dev/null)"; do \
	  [ -x "$$p" ] && "$$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' \
	    2>/dev/null && { echo "$$p"; break; }; \
	done

$(SAM_STAMP):
	$(PYTHON) -m venv $(SAM_VENV)
	$(SAM_VENV)/bin/python -m pip install -q --upgrade pip
	$(SAM_VENV)/bin/python -m pip install -q 'aws-sam-cli>=1.120,<2'
	touch $@

# What the Lambda Python runtime provides, and nothing else: boto3.
$(RT312_STAMP):
	@py312="$$($(FIND_PY312))"; \
	if [ -z "$$py312" ]; then \
	  echo "sam-check needs Python 3.12 (the Lambda runtime): install it (pyenv install 3.12)" \
	       "or put python3.12 on PATH"; exit 1; fi; \
	echo "Python 3.12 for the runtime venv: $$py312"; \
	"$$py312" -m venv --clear $(RT312) && \
	$(RT312)/bin/python -m pip install -q --upgrade pip && \
	$(RT312)/bin/python -m pip install -q boto3
	touch $@

sam-check: $(STAMP) $(SAM_STAMP) $(RT312_STAMP)
	SAM_CLI_TELEMETRY=0 $(SAM) validate --lint --region us-east-1
	@# The optional sample database stack (README: deploy to a test account).
	SAM_CLI_TELEMETRY=0 $(SAM) validate --lint --region us-east-1 -t examples/database.yaml
	$(MAKE) --no-print-directory build
	$(BIN)/pytest -m build tests/template/test_built.py

# sam build with the Lambda runtime's Python (3.12, found as above; a plain
# `sam build` fails with "Binary validation failed for python" unless 3.12 is
# first on PATH), then bytecode: /opt and /var/task are read-only in Lambda, so
# without it every cold start compiles the layer again (about 3x slower
# imports). Hash-checked, because zip packaging does not keep the sources'
# timestamps. Then `sam deploy` ships .aws-sam/build.
build: $(SAM_STAMP)
	@py312="$$($(FIND_PY312))"; \
	if [ -z "$$py312" ]; then \
	  echo "sam build needs Python 3.12 (the Lambda runtime): install it (pyenv install 3.12)" \
	       "or put python3.12 on PATH"; exit 1; fi; \
	echo "sam build with $$py312"; \
	PATH="$$(dirname "$$py312"):$$PATH" SAM_CLI_TELEMETRY=0 $(SAM) build --cached --parallel && \
	"$$py312" -m compileall -q --invalidation-mode unchecked-hash \
		.aws-sam/build/OutboxLayer/python .aws-sam/build/*Function

# The quick path (docs/how-to/deploy.md): samconfig.toml's try environment,
# which reserves no concurrency, plus your database's PARAMETERS.
deploy-try: build
	@test -n "$(PARAMETERS)" || { echo 'name your database: make deploy-try' \
	  'PARAMETERS="DatabaseSecretArn=<arn> MigrateDatabaseSecretArn=<arn>"' >&2; exit 2; }
	SAM_CLI_TELEMETRY=0 $(SAM) deploy --config-env try \
	  --parameter-overrides "$$($(PYTHON) -m docgen.quick_path) $(PARAMETERS)"

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .aws-sam .tools .pytest_cache .mypy_cache .ruff_cache site

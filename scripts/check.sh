#!/usr/bin/env bash
# What CI runs: lint, type-check both packages, then the test suite (benchmarks run from `loopserve bench`, not here).
set -uo pipefail
cd "$(dirname "$0")/.."
set -e
.venv/bin/ruff check loopserve loopserve_lab tests
.venv/bin/mypy loopserve loopserve_lab
set +e
# two workers, a test file on one of them (its module-scoped servers start once): most of the suite's time is
# servers and subprocesses waiting, so the two cores take about 1.7x less wall time than one run
.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit $rc

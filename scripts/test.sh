#!/usr/bin/env bash
# The README's test command: set up (idempotent) and run the whole CPU test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -m "not vllm").
# The summary lists the 25 slowest tests (--durations) and every skip with its reason (-rs): a fault
# episode of tests/test_reliability.py that the machine was too slow to observe is a skip with the
# reason "machine too slow to observe recovery: N requests in the episode", never a silent pass.
set -uo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
scripts/bootstrap.sh || exit 1
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 -rfEs "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "test.sh: pytest collected no tests — treating as a failure" >&2
  exit 1
fi
exit $rc

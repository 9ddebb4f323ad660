#!/usr/bin/env bash
# Lint and format checks: ruff (Python lint + format, config in pyproject.toml) and clang-format
# (csrc/, config in .clang-format). Checks only, changes nothing; exit status non-zero on a finding.
# Tools: pip install -e '.[lint]' (pinned ruff and clang-format), or set RUFF / CLANG_FORMAT.
# Usage: scripts/lint.sh            all checks
#        scripts/lint.sh --fix      apply ruff's safe fixes and both formatters instead of checking
set -uo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
pick() {  # first of: $1 (env override), the venv's, PATH's
  local override=$1 name=$2
  if [ -n "$override" ]; then echo "$override"; return; fi
  for c in "$top/.venv/bin/$name" "$(command -v "$name" 2>/dev/null)"; do
    if [ -n "$c" ] && [ -x "$c" ]; then echo "$c"; return; fi
  done
  echo "lint.sh: $name not found; pip install -e '.[lint]' (or set ${3})" >&2
  exit 2
}
ruff=$(pick "${RUFF:-}" ruff RUFF) || exit 2
clang_format=$(pick "${CLANG_FORMAT:-}" clang-format CLANG_FORMAT) || exit 2
mapfile -t cxx < <(git ls-files 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.h' 'csrc/*.cuh')

if [ "${1:-}" = "--fix" ]; then
  "$ruff" check --fix .
  "$ruff" format .
  "$clang_format" -i "${cxx[@]}"
  exit 0
fi

rc=0
echo "== ruff check"
"$ruff" check . || rc=1
echo "== ruff format --check"
"$ruff" format --check . || rc=1
echo "== clang-format --dry-run -Werror (${#cxx[@]} files)"
"$clang_format" --dry-run -Werror "${cxx[@]}" || rc=1
exit $rc

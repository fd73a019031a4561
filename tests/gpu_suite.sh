#!/usr/bin/env bash
# The GPU suite, each test file in its own pytest process, JOBS at a time (compiling kernels is CPU-bound; one
# process per file uses the cores). Usage: tests/gpu_suite.sh [LOGDIR] [FILE ...]; default: every tests/*_gpu.py
# plus the files whose GPU tests live beside CPU ones. Env: JOBS (default 8), PER_FILE_TIMEOUT (s, default 540),
# PYTEST_ARGS (extra arguments), SPLIT (files run one process per test id, default tests/test_dsl_gpu.py: its
# tests compile many kernels each). FILE may be a test id (file::test[param]): one process per id. Prints one line
# per file or id (passed/failed counts), writes the failing files' assertion lines to LOGDIR/0_failures.txt and exits
# non-zero if any failed.
set -u
LOGDIR=${1:-gpu-suite-logs}; shift || true
mkdir -p "$LOGDIR"
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then FILES=("$@"); else
  mapfile -t FILES < <(ls tests/test_*_gpu.py; grep -l "mark.gpu" tests/test_*.py | grep -v "_gpu.py")
fi
SPLIT=${SPLIT-tests/test_dsl_gpu.py}
ITEMS=()
for f in "${FILES[@]}"; do
  if [[ " $SPLIT " == *" $f "* ]]; then  # one entry per GPU test id of this file
    mapfile -t -O "${#ITEMS[@]}" ITEMS < <(python -m pytest --collect-only -q -m gpu -p no:cacheprovider "$f" \
      2>/dev/null | grep "::")
  else
    ITEMS+=("$f")
  fi
done
JOBS=${JOBS:-8}
run_one() {
  local f=$1 name; name=$(basename "$f" .py | tr -c "A-Za-z0-9_.\n-" "_")
  local t0=$SECONDS
  timeout "${PER_FILE_TIMEOUT:-540}" python -m pytest -q -m gpu -p no:cacheprovider ${PYTEST_ARGS:-} "$f" \
    >"$LOGDIR/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s $(tail -n 1 "$LOGDIR/$name.log")"
}
export -f run_one; export LOGDIR
printf '%s\n' "${ITEMS[@]}" | sort -u | xargs -P "$JOBS" -d '\n' -I{} bash -c 'run_one "$1"' _ {} | tee "$LOGDIR/summary.txt"
# the failing files' assertion lines in one file that sorts first (a device call returns only its first files)
grep -v " rc=0 \| rc=5 " "$LOGDIR/summary.txt" | cut -d' ' -f1 | while read -r name; do
  echo "=== $name"; grep -E "^(E  |FAILED|ERROR)|Error:" "$LOGDIR/$name.log" | head -40
done > "$LOGDIR/0_failures.txt"
! grep -qv " rc=0 \| rc=5 " "$LOGDIR/summary.txt"

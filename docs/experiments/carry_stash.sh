#!/bin/bash
# Before a device call: the bundle (.device/cutlass-dsl-*, ~61 MiB) and the working tree travel together under a
# 64 MiB limit, so the largest tracked files that no GPU command reads (docs/ reports, plots, NOTES, DESIGN) wait in
# a stash directory outside the tree during the call. Usage: carry_stash.sh out [EXTRA_MB] | in | status.
#   out: moves docs/ files, largest first, until tree + bundle (+ EXTRA_MB carried besides, e.g. a wheel) fit with
#        512 KiB to spare (never the experiment scripts: the device runs them), then, with STASH_TESTS=1 (a call that
#        runs no test: the Liger wheel, 0.9 MB, fits no other way since session 52), tests/ files; in: moves them back. Never commit while files are out (git would record them deleted).
set -eu
cd "$(dirname "$0")/../.."
STASH=${CARRY_STASH:-/tmp/coda-carry-stash}
LIMIT=$((64 * 1024 * 1024 - 512 * 1024))
case "${1:-status}" in
out)
  extra=$(( ${2:-0} * 1024 * 1024 ))
  bundle=$(du -sb .device/cutlass-dsl-* 2>/dev/null | awk '{s += $1} END {print s + 0}')
  tree=$(git ls-files -z | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
  total=$((bundle + tree + extra))
  while read -r size f; do
    [ "$total" -le "$LIMIT" ] && break
    mkdir -p "$STASH/$(dirname "$f")" && mv "$f" "$STASH/$f" && total=$((total - size))
  done < <(git ls-files -z docs $([ "${STASH_TESTS:-0}" = 1 ] && echo tests) | grep -zv '^docs/experiments/.*\.sh$' | \
           while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done | xargs -0 -r stat -c '%s %n' | sort -rn)
  echo "carried: $((total / 1024)) KiB of $((LIMIT / 1024)) KiB"
  [ "$total" -le "$LIMIT" ] || { echo "still over the limit" >&2; exit 1; } ;;
in)
  [ -d "$STASH" ] && (cd "$STASH" && find . -type f -print0) | while IFS= read -r -d '' f; do
    mkdir -p "$(dirname "$f")" && mv "$STASH/$f" "$f"; done
  rm -rf "$STASH"; git status --short | head ;;
status)
  git status --short | grep '^ D' || echo "nothing stashed" ;;
esac

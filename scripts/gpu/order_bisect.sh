#!/usr/bin/env bash
# Which earlier CUDA test file makes a later one fail (an order-dependent failure): runs each file
# before TARGET in its own process, 8 at a time, and prints PASS/FAIL per file.
#   bash scripts/gpu/order_bisect.sh 'tests/core/test_retirement.py::test_changes_rerecord_and_replay_resumes[cuda-param_data]'
TARGET="$1"
run_one() {
  local f=$1
  if timeout 120 python3 -m pytest -q -m cuda -p no:cacheprovider -x "$f" "$TARGET" > /tmp/ob_$(basename "$f").log 2>&1; then
    echo "PASS $f"
  else
    echo "FAIL $f: $(grep -E '^E ' /tmp/ob_$(basename "$f").log | head -1 | cut -c1-160)"
  fi
}
export -f run_one
export TARGET
ls tests/core/test_*.py | awk -v t="${TARGET%%::*}" '$0 < t' | xargs -P 8 -I{} bash -c 'run_one {}'

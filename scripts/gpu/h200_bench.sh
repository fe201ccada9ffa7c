#!/usr/bin/env bash
# Timing on the H200, each alone (nothing beside it): the recurrent nets' table (cuDNN dropout
# recorded under both entry points), the whole step against a raw graph at the launch-bound size
# (this tree, then OLD_TREE when given: a folder with an older checkout, run the same way), and the
# cuDNN-dropout exactness check. Run from the repository root on the device; logs under $OUT/bench/.
export PYTHONUNBUFFERED=1
O="${OUT:-/tmp/out}/bench"; mkdir -p "$O"
HERE=$PWD; OLD_TREE="${1:-}"
one() { local name=$1 t=$2; shift 2; local s; s=$(date +%s)
  timeout "$t" "$@" > "$O/$name.log" 2>&1; echo "rc $? in $(( $(date +%s) - s )) s" >> "$O/$name.log"; tail -1 "$O/$name.log" | sed "s/^/$name: /"; }
export PYTHONPATH="$HERE"
one rnn_dropout 90 python3 scripts/gpu/rnn_dropout_try.py
one rnn 300 python3 scripts/gpu/rnn_bench.py
one step_vs_raw 100 python3 scripts/gpu/step_vs_raw.py
if [ -n "$OLD_TREE" ]; then
  (cd "$OLD_TREE" && PYTHONPATH="$OLD_TREE" one old_step_vs_raw 100 python3 "$HERE/scripts/gpu/step_vs_raw.py")
  one new_step_vs_raw_again 100 python3 scripts/gpu/step_vs_raw.py
fi

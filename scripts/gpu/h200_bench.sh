#!/usr/bin/env bash
# Timing on the H200, each alone (nothing beside it): the recurrent nets' table, the whole step
# against a raw graph at the launch-bound size, the switches' key, the call state's cost.
# Run from the repository root on the device; logs under $OUT/bench/.
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
O="${OUT:-/tmp/out}/bench"; mkdir -p "$O"
one() { local name=$1 t=$2; shift 2; local s; s=$(date +%s)
  timeout "$t" "$@" > "$O/$name.log" 2>&1; echo "rc $? in $(( $(date +%s) - s )) s" >> "$O/$name.log"; tail -1 "$O/$name.log" | sed "s/^/$name: /"; }
one rnn_diag 90 python3 scripts/gpu/rnn_diag.py
one rnn 240 python3 scripts/gpu/rnn_bench.py
one step_vs_raw 120 python3 scripts/gpu/step_vs_raw.py
one switches 90 python3 scripts/gpu/switches_key.py
one call_state 60 python3 scripts/gpu/call_state_cost.py --device cuda

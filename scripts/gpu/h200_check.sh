#!/usr/bin/env bash
# Correctness on the H200 after a core change, side by side (every run under a timeout): the CUDA
# tests, hazards.ipynb on cuda with the unsafe arms, parity.ipynb's full matrix, and the four
# notebooks through the Colab path then evidence. ARCHIVE: a `pack` archive of the tree (the runs
# name its commit). Logs under $OUT/check/, run folders under /tmp/n.
export PYTHONUNBUFFERED=1
O="${OUT:-/tmp/out}/check"; mkdir -p "$O" /tmp/n
A="$1"
T="${2:-540}"  # each run's timeout (s)
bg() { local name=$1 t=$2; shift 2
  ( s=$(date +%s); timeout "$t" "$@" > "$O/$name.log" 2>&1; echo "rc $? in $(( $(date +%s) - s )) s" >> "$O/$name.log" ) & }
bg cuda_tests "$T" python3 -m pytest -q -m cuda -p no:cacheprovider tests/core tests/lightning tests/integrations tests/testing
bg hazards "$T" python3 scripts/run_notebook.py notebooks/hazards.ipynb -p tree "$A" -y '{"backends": ["cuda"]}' --runs-dir /tmp/n/hz
bg parity "$T" python3 scripts/run_notebook.py notebooks/parity.ipynb -p tree "$A" -p device cuda --runs-dir /tmp/n/par -y '{"models": [], "tasks": ["detection", "pose", "oriented", "segmentation"], "precisions": ["32", "16-mixed", "bf16-mixed"], "accumulations": [1, 2, 3], "layouts": ["contiguous", "channels_last"], "partial_layouts": ["partial_last", "partial_between"]}'
bg colab "$T" python3 -m replaykit.workflow.colab "$A" --out /tmp/n/colab
bg review7 "$T" python3 -m pytest -q -p no:cacheprovider tests/core/test_review7.py tests/core/test_recurrent.py tests/core/test_switches.py tests/core/test_call_state.py
bg forward_globals 120 python3 scripts/gpu/forward_globals.py
# this session's additions: DDP's stand-in (two gloo ranks on cuda:0), host state and outputs that
# replay now, cuDNN's RNN dropout under a whole step (each script runs its cases under deadlines)
[ -f scripts/gpu/ddp_check.py ] && bg ddp "$T" python3 scripts/gpu/ddp_check.py --out "$O/ddp_check"
[ -f scripts/gpu/state_check.py ] && bg state "$T" env PYTHONPATH=. python3 scripts/gpu/state_check.py --backend cuda
[ -f scripts/gpu/outputs_check.py ] && bg outputs "$T" python3 scripts/gpu/outputs_check.py
[ -f scripts/gpu/rnn_dropout_try.py ] && bg rnn_dropout 200 python3 scripts/gpu/rnn_dropout_try.py
wait
for f in "$O"/*.log; do echo "== $(basename "$f"): $(tail -1 "$f")"; done
tail -3 "$O/cuda_tests.log"; tail -2 "$O/hazards.log" "$O/parity.log"; tail -8 "$O/colab.log"
for f in ddp state outputs rnn_dropout; do [ -f "$O/$f.log" ] && { echo "== $f"; grep -E "FAIL|PASS in|/[0-9]+ PASS|passed|failed" "$O/$f.log" | tail -6; }; done

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
wait
for f in "$O"/*.log; do echo "== $(basename "$f"): $(tail -1 "$f")"; done
tail -3 "$O/cuda_tests.log"; tail -2 "$O/hazards.log" "$O/parity.log"; tail -15 "$O/colab.log"

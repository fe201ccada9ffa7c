#!/usr/bin/env bash
# Correctness on the H200 after a core change, side by side (every run under a timeout): the four
# notebooks through the Colab path (Colab's own defaults, in three processes so that one call holds
# them: hazards, whose `auto` backends run emulated and cuda with the unsafe arms; parity and
# benchmark; verify, which runs `pytest -m cuda` over the tree), parity.ipynb's full matrix, and the
# outputs / host-state / cuDNN-dropout scripts. ARCHIVE: a `pack` archive of the tree (the runs name
# its commit). Logs under $OUT/check/, run folders under /tmp/n; everything in $OUT/check.tgz.
export PYTHONUNBUFFERED=1
O=/tmp/check; mkdir -p "$O" /tmp/n
A="$1"
T="${2:-540}"  # each run's timeout (s)
bg() { local name=$1 t=$2; shift 2
  ( s=$(date +%s); timeout "$t" "$@" > "$O/$name.log" 2>&1; echo "rc $? in $(( $(date +%s) - s )) s" >> "$O/$name.log" ) & }
bg colab_hazards "$T" python3 -m replaykit.workflow.colab "$A" --out /tmp/n/colab_hz --notebook hazards
bg colab_parity_bench "$T" python3 -m replaykit.workflow.colab "$A" --out /tmp/n/colab_pb --notebook parity --notebook benchmark --upload parity
bg colab_verify "$T" python3 -m replaykit.workflow.colab "$A" --out /tmp/n/colab_v --notebook verify --upload verify
bg parity "$T" python3 scripts/run_notebook.py notebooks/parity.ipynb -p tree "$A" -p device cuda --runs-dir /tmp/n/par -y '{"models": [], "tasks": ["detection", "pose", "oriented", "segmentation"], "precisions": ["32", "16-mixed", "bf16-mixed"], "accumulations": [1, 2, 3], "layouts": ["contiguous", "channels_last"], "partial_layouts": ["partial_last", "partial_between"]}'
bg state "$T" env PYTHONPATH=. python3 scripts/gpu/state_check.py --backend cuda
bg outputs "$T" env PYTHONPATH=. python3 scripts/gpu/outputs_check.py
bg rnn_dropout 200 env PYTHONPATH=. python3 scripts/gpu/rnn_dropout_try.py
bg host_feeds 300 env PYTHONPATH=. python3 scripts/gpu/host_feeds_check.py
wait
for f in "$O"/*.log; do echo "== $(basename "$f"): $(tail -1 "$f")"; done
for f in colab_hazards colab_parity_bench colab_verify; do echo "== $f"; tail -6 "$O/$f.log"; done
tail -2 "$O/parity.log"
for f in state outputs rnn_dropout host_feeds; do echo "== $f"; grep -E "FAIL|PASS in|/[0-9]+ PASS|passed|failed" "$O/$f.log" | tail -4; done
tar czf "${OUT:-/tmp/out}/check.tgz" -C /tmp check n --exclude='*.tar.gz' 2>/dev/null

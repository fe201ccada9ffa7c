#!/usr/bin/env bash
# A second, shorter correctness pass on the H200 after fixes (every run under a timeout, all at
# once): hazards.ipynb on cuda, the CUDA tests of the files this session changed, parity's full
# matrix, and the outputs / host-state / cuDNN-dropout scripts. ARCHIVE: a `pack` archive.
# Everything lands in one tarball ($OUT/recheck.tgz): the device returns only a few files.
export PYTHONUNBUFFERED=1
O=/tmp/recheck; mkdir -p "$O" /tmp/n
A="$1"; T="${2:-300}"
bg() { local name=$1 t=$2; shift 2
  ( s=$(date +%s); timeout "$t" "$@" > "$O/$name.log" 2>&1; echo "rc $? in $(( $(date +%s) - s )) s" >> "$O/$name.log" ) & }
bg hazards "$T" python3 scripts/run_notebook.py notebooks/hazards.ipynb -p tree "$A" -y '{"backends": ["cuda"]}' --runs-dir /tmp/n/hz
bg cuda_tests "$T" python3 -m pytest -q -m cuda -p no:cacheprovider tests/core/test_guards.py tests/core/test_recurrent.py tests/core/test_retirement.py tests/core/test_live_outputs.py tests/core/hazards/test_kept_outputs.py tests/core/test_review7.py tests/core/test_call_state.py tests/core/test_ddp_step.py tests/core/test_eager_runs_here.py
bg parity "$T" python3 scripts/run_notebook.py notebooks/parity.ipynb -p tree "$A" -p device cuda --runs-dir /tmp/n/par -y '{"models": [], "tasks": ["detection", "pose", "oriented", "segmentation"], "precisions": ["32", "16-mixed", "bf16-mixed"], "accumulations": [1, 2, 3], "layouts": ["contiguous", "channels_last"], "partial_layouts": ["partial_last", "partial_between"]}'
bg outputs "$T" env PYTHONPATH=. python3 scripts/gpu/outputs_check.py
bg state "$T" env PYTHONPATH=. python3 scripts/gpu/state_check.py --backend cuda
bg rnn_dropout 200 env PYTHONPATH=. python3 scripts/gpu/rnn_dropout_try.py
wait
for f in "$O"/*.log; do echo "== $(basename "$f"): $(tail -1 "$f")"; done
tail -2 "$O/cuda_tests.log"; tail -2 "$O/hazards.log" "$O/parity.log"
for f in outputs state rnn_dropout; do echo "== $f"; grep -E "FAIL|PASS" "$O/$f.log" | tail -4; done
tar czf "${OUT:-/tmp/out}/recheck.tgz" -C /tmp recheck n --exclude='*.tar.gz' 2>/dev/null

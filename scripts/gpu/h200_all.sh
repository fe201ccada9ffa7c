#!/usr/bin/env bash
# One device call for a session's last tree: the eager-optimizer-step bench alone first (timings
# want a quiet host), then side by side h200_check.sh (the Colab path, the parity matrix, the
# outputs / state / dropout scripts) and the one-GPU DDP stand-in's three matrices (TrainStep,
# Lightning's whole step, Lightning's automatic step). ARCHIVE: a `pack` archive of the tree;
# T: h200_check's per-run timeout. Everything lands under $OUT (check.tgz, ddp/, lddp/, auto/).
export PYTHONUNBUFFERED=1
A="$1"
T="${2:-420}"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT/ddp" "$OUT/lddp" "$OUT/auto"
timeout 100 python3 scripts/gpu/tail_bench.py --steps 200 --rounds 5 > "$OUT/tail_bench.txt" 2>&1
echo "tail_bench rc $?" >> "$OUT/tail_bench.txt"
run() { local log=$1 t=$2; shift 2
  ( timeout "$t" env PYTHONPATH=".:${PYTHONPATH:-}" "$@" > "$log" 2>&1; echo "rc $?" >> "$log" ) & }
run "$OUT/ddp/log.txt" 300 python3 scripts/gpu/ddp_check.py --out "$OUT/ddp" --budget 220
run "$OUT/lddp/log.txt" 300 python3 scripts/gpu/lightning_ddp_check.py --out "$OUT/lddp" --jobs 3 --budget 220 --timeout 150
run "$OUT/auto/log.txt" 300 python3 -m replaykit.testing.parity.ddp --matrix --jobs 2 --device cuda --one-device --timeout 200 --json "$OUT/auto/ddp_matrix.json" --md "$OUT/auto/ddp_matrix.md"
bash scripts/gpu/h200_check.sh "$A" "$T"
wait
echo "== tail_bench"; tail -11 "$OUT/tail_bench.txt"
for d in ddp lddp auto; do echo "== $d"; tail -14 "$OUT/$d/log.txt" | cut -c1-300; done

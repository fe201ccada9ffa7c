#!/usr/bin/env bash
# One device call for new replay coverage: the CUDA tests of the changed modules, then the named
# hazard patterns on cuda, guarded and unsafe (JSON under $OUT). Args: pytest files; patterns via $PATTERNS.
OUT="${OUT:-/tmp/out}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
timeout 300 python3 -m pytest -q -m cuda -p no:cacheprovider "$@" > "$OUT/cuda_tests.txt" 2>&1
echo "pytest rc $?" >> "$OUT/cuda_tests.txt"; tail -25 "$OUT/cuda_tests.txt"
P=(); for p in $PATTERNS; do P+=(--pattern "$p"); done
timeout 200 python3 -m replaykit.testing.hazards --backend cuda "${P[@]}" --plain --json "$OUT/guarded.json" > "$OUT/guarded.txt" 2>&1
echo "guarded rc $?"; tail -25 "$OUT/guarded.txt" | cut -c1-260
timeout 150 python3 -m replaykit.testing.hazards --backend cuda "${P[@]}" --unsafe --plain --json "$OUT/unsafe.json" > "$OUT/unsafe.txt" 2>&1
echo "unsafe rc $?"; tail -25 "$OUT/unsafe.txt" | cut -c1-260

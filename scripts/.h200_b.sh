python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
A=$(ls $PWD/dist/replaykit-*.tar.gz); N=/tmp/n; mkdir -p $N
echo "== bench"; timeout 220 python3 scripts/run_notebook.py notebooks/benchmark.ipynb -p tree $A --tree $A --runs-dir $N/bench --no-progress -p device cuda -p quick False -p steps 200 -p rounds 10 -p check_every 50 -y '{"models": []}' 2>&1 | tail -1
(cd $N/bench && tar czf $OUT/runs_bench.tgz .)
echo "== zoo parity"; timeout 200 python3 scripts/run_notebook.py notebooks/parity.ipynb -p tree $A --tree $A --runs-dir $N/zpar --no-progress -p device cuda -p whole_step False -y '{"tasks": [], "models": ["all"], "precisions": ["32", "16-mixed", "bf16-mixed"], "accumulations": [1, 2]}' 2>&1 | tail -1
(cd $N/zpar && tar czf $OUT/runs_zpar.tgz .)
echo "== zoo bench"; timeout 170 python3 scripts/run_notebook.py notebooks/benchmark.ipynb -p tree $A --tree $A --runs-dir $N/zbench --no-progress -p device cuda -p quick True -p steps 20 -p rounds 4 -p whole_step False -y '{"models": ["all"], "precisions": ["32", "bf16-mixed"]}' 2>&1 | tail -1
(cd $N/zbench && tar czf $OUT/runs_zbench.tgz .)

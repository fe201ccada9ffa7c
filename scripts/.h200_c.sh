python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
A=$(ls $PWD/dist/replaykit-*.tar.gz); N=/tmp/n; mkdir -p $N
echo "== step tests"; timeout 90 python3 -m pytest -q -m cuda tests/core/test_step.py tests/lightning/test_whole_step.py 2>&1 | tail -2
echo "== bench"; timeout 170 python3 scripts/run_notebook.py notebooks/benchmark.ipynb -p tree $A --tree $A --runs-dir $N/bench --no-progress -p device cuda -p quick False -p steps 120 -p rounds 6 -y '{"models": []}' 2>&1 | tail -1
(cd $N/bench && tar czf $OUT/runs_bench.tgz .)
echo "== zoo bench vit"; timeout 60 python3 scripts/run_notebook.py notebooks/benchmark.ipynb -p tree $A --tree $A --runs-dir $N/zb --no-progress -p device cuda -p quick True -p steps 20 -p rounds 4 -p whole_step False -y '{"models": ["timm_vit"], "precisions": ["32", "bf16-mixed"]}' 2>&1 | tail -1
(cd $N/zb && tar czf $OUT/runs_zb.tgz .)

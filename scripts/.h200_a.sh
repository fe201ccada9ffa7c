python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
A=$(ls $PWD/dist/replaykit-*.tar.gz); N=/tmp/n; mkdir -p $N
echo "== verify"; timeout 260 python3 scripts/run_notebook.py notebooks/verify.ipynb -p tree $A --tree $A --runs-dir $N/verify --no-progress -p markers cuda 2>&1 | tail -1
(cd $N/verify && tar czf $OUT/runs_verify.tgz .)
echo "== hazards"; timeout 60 python3 scripts/run_notebook.py notebooks/hazards.ipynb -p tree $A --tree $A --runs-dir $N/hz --no-progress -y '{"backends": ["emulated","cuda"]}' 2>&1 | tail -1
(cd $N/hz && tar czf $OUT/runs_hz.tgz .)
echo "== parity"; timeout 250 python3 scripts/run_notebook.py notebooks/parity.ipynb -p tree $A --tree $A --runs-dir $N/par --no-progress -y '{"device":"cuda","models":[],"tasks":["detection","pose","oriented","segmentation"],"precisions":["32","16-mixed","bf16-mixed"],"accumulations":[1,2,3],"layouts":["contiguous","channels_last"],"partial_layouts":["partial_last","partial_between"]}' 2>&1 | tail -1
(cd $N/par && tar czf $OUT/runs_par.tgz .)

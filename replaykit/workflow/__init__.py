"""The notebook verification workflow (extra ``workflow``): no module here imports torch.

bootstrap     a notebook's first cell: verify and unpack an archive, install what the notebook
              needs (never torch), put the tree on sys.path. Standard library only, loadable by path.
archive       pack a tree into one verified .tar.gz (manifest, per-file sha256), wheelhouse;
              open any tree; re-exports bootstrap's verify/unpack. Standard library only.
fingerprint   what a run ran on: tree, Python, torch, CUDA, GPU, driver, papermill ...;
              where the source tree and the notebooks are (a checkout, or the wheel's copies)
folders       the runs/ layout: summary.json, index.json, slugs, fresh folders
runs          run folders under runs/: execute a notebook with papermill, its summary.json
verify        run a pytest selection against a tree (repeats, isolation, junit tables)
batch         environments x trees x notebooks x parameter sets: the plan and the runner
  environments  an existing interpreter, or a venv built from requirements (reused by hash)
  kernels       a kernelspec per environment, private to the batch (JUPYTER_PATH)
  trees         a folder, an archive or a git revision, ready to run against
  cells         one notebook run on one tree by one kernel, as an index record
  index         a batch, bisect or arms folder and its index.json / index.md
bisect        the first bad commit between a good and a bad one; arms of one commit
drill         plant a bad commit in a copy of history and check bisect names it
seal          bind a run's verdict to its executed notebook (the runner's seal, the notebook's own)
evidence      collect run, batch and bisect folders, and downloaded notebooks, into one report
colab         run the notebooks as Colab's Run all does, then their evidence
notebook      helpers the notebooks call (environment check, a widget form)
git           the one git runner (GitError); interpreters: ask an interpreter what it is
errors        WorkflowError, the root of every error above
tables        plain-text and Markdown tables from rows of dicts (the workflow's and the benches')
cli           the commands: ``replaykit-workflow`` = ``python -m replaykit.workflow``
              ``{pack,run,batch,verify,evidence,bisect} ...``; scripts/*.py are shims
"""

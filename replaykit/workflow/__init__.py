"""The notebook verification workflow (extra ``workflow``): no module here imports torch.

    archive      pack a tree into one verified .tar.gz (manifest, per-file sha256); verify; unpack.
                 Standard library only, and loadable by path (a notebook's bootstrap does that).
    fingerprint  what a run ran on: tree, Python, torch, CUDA, GPU, driver, papermill ...
    runs         run folders under runs/: execute a notebook with papermill, its summary.json
    verify       run a pytest selection against a tree (repeats, isolation, junit tables)
    batch        environments x trees x notebooks x parameter sets, with an index.json
    bisect       the first bad commit between a good and a bad one; arms of one commit
    evidence     collect run, batch and bisect folders into one report
    notebook     helpers the notebooks call (environment check, a widget form)

``python -m replaykit.workflow {pack,run,batch,verify,evidence,bisect} ...``
"""

"""Shared by the repro_*.py files: run ``body(use_rk)`` twice and compare bitwise."""

import warnings

import torch

warnings.simplefilter("ignore")


def compare(body):
    a, b = body(False), body(True)
    bad = [k for k in a["out"] if not torch.equal(a["out"][k], b["out"][k])]
    print("counts:", {k: v for k, v in b["entry"].counts.items() if v})
    print("SILENT, differs:" if bad else "equal", bad)

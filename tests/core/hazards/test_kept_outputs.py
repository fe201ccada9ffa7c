"""Outputs the caller keeps (predictions, a view of them, the model's losses, a cache object): each
pattern replays and the kept tensors keep their values; without copy-out they change."""

from __future__ import annotations

import pytest
import torch

from replaykit.testing.hazards.outcome import REPLAYED, ROUTED

from ._check import assert_safe, assert_unsafe_diverges, guarded, names

#: torch 2.4 has no ``UntypedStorage._swap_data_ptr_``: a held output cannot move to memory of its
#: own, so a call while one is held runs eagerly (``live_alias``, memory/copy_out.py)
HELD_OUTPUTS_MOVE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


@pytest.mark.parametrize("name", names("kept_outputs"))
def test_kept_outputs_patterns_replay_and_end_like_eager(backend: str, name: str) -> None:
    outcome = assert_safe(name, backend)
    if backend == "cuda" and outcome.kind != REPLAYED:
        pytest.xfail(
            f"on CUDA a kept output still routes eager (H200, 2026-12-02): {outcome.line()}"
        )
    if not HELD_OUTPUTS_MOVE and outcome.kind == ROUTED:
        assert set(outcome.journal["eager_reasons"]) == {"live_alias"}, outcome.line()
        return
    assert outcome.kind == REPLAYED, outcome.line()


@pytest.mark.parametrize("name", guarded("kept_outputs"))
def test_without_copy_out_kept_outputs_change(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)

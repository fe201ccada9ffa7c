"""Outputs the caller keeps (predictions, a view of them, the model's losses, a cache object): each
pattern replays and the kept tensors keep their values; without copy-out they change. Both ways
copy-out keeps them: moving a held output to memory of its own (torch with
``UntypedStorage._swap_data_ptr_``), and handing out copies (torch without it: 2.11, Colab's)."""

from __future__ import annotations

import pytest
import torch

from replaykit.memory import copy_out
from replaykit.testing.hazards.outcome import REPLAYED

from ._check import assert_safe, assert_unsafe_diverges, guarded, names

#: how copy-out keeps a held output: "move" needs torch's storage swap, "copies" runs everywhere
WAYS = ("move", "copies")


@pytest.fixture(params=WAYS)
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "move" and not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        pytest.skip("this torch cannot move a held storage: it hands out copies")
    if request.param == "copies":  # as a torch without the swap
        monkeypatch.setattr(copy_out, "_swap", None)
    return request.param


@pytest.mark.parametrize("name", names("kept_outputs"))
def test_kept_outputs_patterns_replay_and_end_like_eager(backend: str, name: str, way: str) -> None:
    outcome = assert_safe(name, backend)
    assert outcome.kind == REPLAYED, outcome.line()


@pytest.mark.parametrize("name", guarded("kept_outputs"))
def test_without_copy_out_kept_outputs_change(backend: str, name: str, way: str) -> None:
    assert_unsafe_diverges(name, backend)

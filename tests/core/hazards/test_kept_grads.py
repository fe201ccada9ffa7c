"""Gradients the caller keeps (a gradient-norm history of views, an optimizer holding ``.grad``'s
data, the running gradient between micro-batches): each pattern ends like eager, and replays where
torch can move a held storage; without that, the captured network's patterns replay too (the held
gradient given away once, ``grads_given_away``) and the whole step's routes eagerly. Without
copy-out the kept gradients differ."""

from __future__ import annotations

import pytest

from replaykit.memory import copy_out
from replaykit.testing.hazards.outcome import REPLAYED

from ._check import assert_safe, assert_unsafe_diverges, guarded, names, of

#: how copy-out keeps a held gradient: "move" needs torch's storage swap; "eager" is a torch
#: without it, where a holder copy-out cannot reach is given away (capture) or keeps the call eager
WAYS = ("move", "eager")


@pytest.fixture(params=WAYS)
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "move" and not copy_out.holders_move():
        pytest.skip("this torch cannot move a held storage")
    if request.param == "eager":
        monkeypatch.setattr(copy_out, "_swap", None)
    return request.param


@pytest.mark.parametrize("name", names("kept_grads"))
def test_kept_grads_patterns_end_like_eager(backend: str, name: str, way: str) -> None:
    outcome = assert_safe(name, backend)
    if way == "move" or of(name).api == "capture":
        assert outcome.kind == REPLAYED, outcome.line()
    if way == "eager" and of(name).api == "capture":  # given away once, then replayed
        assert outcome.journal["rerecord"] == 1 and not outcome.journal["eager_reasons"]
        assert outcome.journal["replay"] > 0, outcome.journal


@pytest.mark.parametrize("name", guarded("kept_grads"))
def test_without_copy_out_kept_grads_differ(backend: str, name: str, way: str) -> None:
    assert_unsafe_diverges(name, backend)

"""The DDP parity matrix's CLI on CPU processes (gloo, emulated backend): a tiny matrix, a late job."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from replaykit.testing.parity.ddp import main, run_matrix
from replaykit.testing.parity.ddp_matrix import UNSAFE_ARM, ddp_scenarios


@pytest.mark.e2e  # a child-process run of the harness: `make e2e` (CI runs it)
@pytest.mark.ddp
def test_ddp_matrix_replay_and_step_equal_on_every_rank(tmp_path: Path, capsys) -> None:
    out_json, out_md = tmp_path / "m.json", tmp_path / "m.md"
    args = "--matrix --precisions 32,16-mixed --accumulations 1 --jobs 2 --timeout 180"
    rc = main([*args.split(), "--json", str(out_json), "--md", str(out_md)])
    printed = capsys.readouterr().out
    saved = json.loads(out_json.read_text())
    assert rc == 0, printed
    rows = saved["rows"]
    assert [r["optimizer"] for r in rows] == ["sgd", "sgd-fused"]  # fused only under 16-mixed
    for r in rows:
        for arm in ("replay", "step"):
            assert r["arms"][arm]["equal"] == [True, True] and r["arms"][arm]["ranks_agree"], r
        assert min(r["arms"]["step"]["step_replays"]) >= 1, r  # the optimizer step replayed
    unsafe = rows[0]["arms"][UNSAFE_ARM]  # the negative control, on the first scenario only
    assert unsafe["equal"] != [True, True] and UNSAFE_ARM not in rows[1]["arms"]
    assert "2/2 scenarios passed" in printed and "unsafe arms diverged 1/1" in printed
    assert out_md.read_text().count("| pass |") == 2


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline:
            found.append(int(pid))
    return found


@pytest.mark.ddp
def test_a_late_job_fails_its_scenario_with_a_message_and_leaves_no_process(
    tmp_path: Path,
) -> None:
    scenarios = ddp_scenarios(["32"], [1])
    rows = run_matrix(scenarios, timeout=2, work_dir=tmp_path)
    assert not rows[0]["ok"] and "did not finish in 2 s" in rows[0]["error"]
    assert _processes_mentioning(str(tmp_path)) == []  # torchrun's workers were stopped too

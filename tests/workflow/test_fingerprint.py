"""The environment fingerprint and the run-folder slug."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from replaykit.workflow.fingerprint import (
    FINGERPRINT_FILE,
    MANIFEST_NAME,
    fingerprint,
    fingerprint_slug,
    in_colab,
    record_fingerprint,
)

SLUG = re.compile(r"^[A-Za-z0-9.-]+_torch[A-Za-z0-9.-]+_[A-Za-z0-9.-]+$")
KEYS = {
    "tree",
    "python",
    "executable",
    "torch",
    "cuda",
    "cudnn",
    "gpu",
    "driver",
    "device",
    "papermill",
    "nbclient",
    "colab",
    "hostname",
    "time_utc",
}


def _git_tree(path: Path) -> str:
    """A one-commit git checkout at ``path``; returns its commit."""
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    (path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    return subprocess.run(
        [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()


def test_keys_present_and_json(tmp_path: Path) -> None:
    fp = fingerprint(tmp_path)
    assert fp.keys() >= KEYS
    assert json.loads(json.dumps(fp)) == fp
    assert fp["executable"] == sys.executable
    assert fp["tree"] == {
        "path": str(tmp_path.resolve()),
        "source": None,
        "commit": None,
        "dirty": None,
    }
    assert SLUG.match(fingerprint_slug(fp))
    assert fingerprint_slug(fp).endswith("_notree")


def test_slug_is_safe() -> None:
    fp = {
        "device": "NVIDIA H200",
        "torch": "2.11.0+cu128",
        "tree": {"commit": "3f2a1b9c0d", "dirty": True},
    }
    assert fingerprint_slug(fp) == "NVIDIA-H200_torch2.11.0_3f2a1b9-dirty"
    odd = {
        "device": "Tesla T4 (16GB)/x_y",
        "torch": None,
        "tree": {"commit": "ab_c d/e", "dirty": False},
    }
    slug = fingerprint_slug(odd)
    assert SLUG.match(slug), slug
    assert slug.count("_") == 2


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_commit_and_dirty(tmp_path: Path) -> None:
    commit = _git_tree(tmp_path)
    tree = fingerprint(tmp_path)["tree"]
    assert (tree["source"], tree["commit"], tree["dirty"]) == ("git", commit, False)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "evidence.json").write_text("{}")
    assert fingerprint(tmp_path)["tree"]["dirty"] is False  # run evidence does not dirty a tree
    (tmp_path / "a.py").write_text("x = 2\n")
    tree = fingerprint(tmp_path)["tree"]
    assert tree["dirty"] is True and tree["changed"] == ["a.py"]
    assert fingerprint_slug(fingerprint(tmp_path)).endswith(f"_{commit[:7]}-dirty")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_manifest_of_an_uploaded_tree(tmp_path: Path) -> None:
    manifest = {"commit": "feedbeef" * 5, "dirty": False, "sha256": "0" * 64, "files": 3}
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(manifest))
    tree = fingerprint(tmp_path)["tree"]
    assert tree["source"] == "manifest"
    assert (tree["commit"], tree["dirty"], tree["sha256"]) == (manifest["commit"], False, "0" * 64)
    assert tree["manifest"] == manifest and "error" not in tree


def test_a_checkout_is_known_by_git_even_with_a_stale_manifest(tmp_path: Path) -> None:
    _git_tree(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text(
        json.dumps({"commit": "feedbeef" * 5, "dirty": False, "sha256": "0" * 64})
    )
    tree = fingerprint(tmp_path)["tree"]
    assert tree["source"] == "git" and tree["commit"] != "feedbeef" * 5


def test_bad_manifest_is_reported(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text('{"commit": "abc"}')
    tree = fingerprint(tmp_path)["tree"]
    assert tree["source"] == "manifest" and "dirty" in tree["error"]


def test_colab_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    assert in_colab() is False
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_20250101")
    assert in_colab() is True
    assert fingerprint()["colab"] is True


def test_record_fingerprint(tmp_path: Path) -> None:
    fp = record_fingerprint(tmp_path / "run", tree=tmp_path)
    assert json.loads((tmp_path / "run" / FINGERPRINT_FILE).read_text()) == fp
    assert record_fingerprint(None, tree=tmp_path).keys() == fp.keys()


def test_a_packed_tree_is_known_by_its_verified_manifest(tmp_path: Path) -> None:
    """A run on a GPU host whose checkout's git metadata is stale names the archive's commit, not the host's."""
    from replaykit.workflow.archive import pack
    from replaykit.workflow.fingerprint import fingerprint_slug, tree_info

    root = Path(__file__).resolve().parents[2]
    packed = pack(root, tmp_path / "tree.tar.gz")
    info = tree_info(packed.path)
    assert info["source"] == "archive" and info["commit"] == packed.manifest["commit"]
    assert fingerprint_slug({"device": "cpu", "torch": "2.13.0", "tree": info}).endswith(
        packed.manifest["commit"][:7] + ("-dirty" if packed.manifest["dirty"] else "")
    )

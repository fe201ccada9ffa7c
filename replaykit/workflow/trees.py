"""The source trees a batch, bisect or arms run notebooks against: a folder, an archive or a revision.

    tree = prepare_tree(TreeSpec(label="old", rev="HEAD~5"), repo=".", workdir=tmp)
    tree.path, tree.commit, tree.record()

A revision is packed from the repository (``archive.pack``) and unpacked, so the notebook sees
exactly that commit and nothing of the working copy; an archive is verified as it is unpacked.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replaykit.workflow import archive
from replaykit.workflow.fingerprint import tree_info
from replaykit.workflow.folders import slug

__all__ = ["DEFAULT_TREE", "PreparedTree", "TreeSpec", "prepare_tree"]


@dataclass(frozen=True)
class TreeSpec:
    """A tree to run against: ``path`` (a folder or a packed archive) or ``rev`` (a git revision)."""

    label: str | None = None
    path: str | None = None
    rev: str | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.rev is None):
            raise ValueError(f"tree {self.label or '(no label)'}: give exactly one of path or rev")

    @classmethod
    def parse(cls, text: str) -> TreeSpec:
        """``[LABEL=]PATH_OR_REV``: an existing path is a path, anything else a revision."""
        label, sep, value = text.partition("=")
        if not sep or not label or "/" in label:
            label, value = "", text
        if not value:
            raise ValueError(f"empty tree in {text!r}")
        if Path(value).expanduser().exists():
            return cls(label=label or None, path=value)
        return cls(label=label or None, rev=value)

    @property
    def display(self) -> str:
        if self.label:
            return self.label
        return self.rev if self.rev is not None else Path(str(self.path)).resolve().name


@dataclass
class PreparedTree:
    """A tree ready to run: its folder and where it came from."""

    label: str
    path: Path | None  # None: the notebook's own default tree
    source: str  # "path" | "archive" | "rev" | "default"
    rev: str | None = None
    commit: str | None = None
    dirty: bool | None = None
    sha256: str | None = None  # content hash from the pack manifest

    @property
    def short(self) -> str | None:
        return self.commit[:7] if self.commit else None

    def record(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "source": self.source,
            "rev": self.rev,
            "commit": self.commit,
            "short": self.short,
            "dirty": self.dirty,
            "sha256": self.sha256,
            "path": str(self.path) if self.source == "path" and self.path else None,
        }


DEFAULT_TREE = PreparedTree(label="default", path=None, source="default")


def _from_manifest(label: str, root: Path, source: str, rev: str | None) -> PreparedTree:
    manifest = json.loads((root / archive.MANIFEST_NAME).read_text())
    return PreparedTree(
        label=label,
        path=root,
        source=source,
        rev=rev,
        commit=manifest["commit"],
        dirty=manifest["dirty"],
        sha256=manifest["sha256"],
    )


def prepare_tree(spec: TreeSpec, repo: str | Path, workdir: Path) -> PreparedTree:
    """Resolve ``spec`` to a folder. A rev is packed from ``repo`` and unpacked under ``workdir``.

    Raises ValueError (not a commit, a bad archive) or FileNotFoundError (no such path).
    """
    label = spec.display

    def fresh(kind: str) -> Path:
        (Path(workdir) / kind).mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{slug(label)}-", dir=Path(workdir) / kind))

    if spec.rev is not None:
        packed = archive.pack(Path(repo), fresh("archives"), rev=spec.rev)
        return _from_manifest(label, archive.unpack(packed.path, fresh("trees")), "rev", spec.rev)
    path = Path(str(spec.path)).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"tree {label!r}: {path} does not exist")
    if path.is_file():
        if not path.name.endswith((".tar.gz", ".tgz")):
            raise ValueError(f"tree {label!r}: {path} is neither a folder nor a packed .tar.gz")
        return _from_manifest(label, archive.unpack(path, fresh("trees")), "archive", None)
    info = tree_info(path)
    return PreparedTree(
        label=label,
        path=path.resolve(),
        source="path",
        commit=info.get("commit"),
        dirty=info.get("dirty"),
    )

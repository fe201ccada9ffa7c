"""A bisect drill: plant a known bad commit in a copy of real history and check that bisect names it.

    python -m replaykit.workflow.drill --range HEAD~8..HEAD -m cuda --id tests/core   # on a GPU host
    python -m replaykit.workflow.drill --range HEAD~8..HEAD -m cuda --dry-run  # the plan only

The repository is cloned into a temporary folder; the first-parent commits of the range are
copied, tree by tree, onto a throwaway branch there, and from the ``--plant-at``-th copied
commit on (default: the middle) one file carries the planted change (by default the CUDA
backend stops replaying its forward graph: a bug only the ``cuda`` tests can see). Then
``bisect`` runs on the copy: both endpoints first, then the search. The drill passes when
bisect names exactly the planted commit. The runs stay under ``runs/bisect_…`` with
``drill.json`` (the planted commit and the original each copy came from). Your checkout and
its branches are never touched.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from replaykit.workflow.cli import markers_and_ids
from replaykit.workflow.git import git, git_text

__all__ = ["DEFAULT_PLANT", "Plant", "Planted", "main", "plant_history"]


@dataclass(frozen=True)
class Plant:
    """Replace ``old`` by ``new`` (exactly once) in ``path``."""

    path: str
    old: str
    new: str

    def apply(self, root: Path) -> None:
        target = root / self.path
        text = target.read_text() if target.is_file() else ""
        if text.count(self.old) != 1:
            raise ValueError(
                f"cannot plant: {self.path} holds {self.old!r} {text.count(self.old)} times, not once"
            )
        target.write_text(text.replace(self.old, self.new))


DEFAULT_PLANT = Plant(
    path="replaykit/backends/cuda.py",
    old="        self._fwd.replay()\n",
    new="        pass  # drill: planted bug, the forward graph is never replayed\n",
)


@dataclass
class Planted:
    """The throwaway history: ``commits`` (copies, oldest first; ``[0]`` is the good end), the
    ``planted`` copy, and the original each copy came from."""

    repo: Path
    branch: str
    commits: list[str]
    originals: list[str]
    planted: str

    @property
    def good(self) -> str:
        return self.commits[0]

    @property
    def bad(self) -> str:
        return self.commits[-1]


def plant_history(
    source: Path,
    good: str,
    bad: str,
    dest: Path,
    *,
    plant: Plant = DEFAULT_PLANT,
    at: int | None = None,
    branch: str = "drill",
) -> Planted:
    """Clone ``source`` into ``dest`` and copy ``good`` and the first-parent commits after it up to
    ``bad`` onto ``branch`` there, ``plant`` applied from the ``at``-th commit after ``good`` on
    (1-based; default the middle). Raises ValueError when the range is too short or the plant
    does not apply to every commit it must."""
    from replaykit.workflow.bisect import commits_between

    source = Path(source).resolve()
    after = [c.sha for c in commits_between(source, good, bad)]
    if len(after) < 2:
        raise ValueError(f"{good}..{bad} holds {len(after)} commit(s); a drill needs at least 2")
    at = (len(after) + 1) // 2 if at is None else at
    if not 1 <= at <= len(after):
        raise ValueError(f"--plant-at must be within 1..{len(after)}, got {at}")
    originals = [git_text(source, "rev-parse", f"{good}^{{commit}}"), *after]
    git(source.parent, "clone", "-q", "--no-checkout", str(source), str(dest))
    git(dest, "config", "user.email", "drill@replaykit.invalid")
    git(dest, "config", "user.name", "replaykit drill")
    copies: list[str] = []
    for i, original in enumerate(originals):
        git(dest, "checkout", "-q", "-f", "--detach", original)
        git(dest, "clean", "-q", "-fdx")
        subject = git_text(dest, "log", "-1", "--format=%s", original)
        if i >= at:
            plant.apply(dest)
            git(dest, "add", "-A")
            subject += f" [drill: bug planted in {plant.path}]" if i == at else ""
        tree = git_text(dest, "write-tree")
        parents = ["-p", copies[-1]] if copies else []
        copies.append(git_text(dest, "commit-tree", tree, *parents, "-m", subject))
    git(dest, "checkout", "-q", "-f", "-B", branch, copies[-1])
    return Planted(
        repo=Path(dest), branch=branch, commits=copies, originals=originals, planted=copies[at]
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m replaykit.workflow.drill", description=__doc__.splitlines()[0]
    )
    ap.add_argument(
        "--range", required=True, metavar="GOOD..BAD", help="first-parent history to copy"
    )
    ap.add_argument(
        "--repo", type=Path, default=Path("."), help="repository (default: here; never modified)"
    )
    ap.add_argument(
        "--plant-at", type=int, help="1-based commit after GOOD that gets the bug (default: middle)"
    )
    ap.add_argument("--file", default=DEFAULT_PLANT.path, help="file to plant the bug in")
    ap.add_argument("--old", default=DEFAULT_PLANT.old, help="text replaced (must occur once)")
    ap.add_argument("--new", default=DEFAULT_PLANT.new, help="replacement")
    markers_and_ids(
        ap,
        "pytest -m expression for bisect (default: cuda)",
        "test ids or folders to select (repeatable; default: the whole suite)",
    )
    ap.add_argument("--runs-dir", type=Path, default=Path("runs"))
    ap.add_argument(
        "--timeout", type=float, default=0, help="seconds before one pytest run is killed"
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="build the planted history, print it, run nothing"
    )
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    """0: bisect named the planted commit; 1: it named another (or none); 2: bad arguments."""
    from replaykit.workflow.bisect import bisect

    args = build_parser().parse_args(argv)
    good, sep, bad = args.range.partition("..")
    if not (sep and good and bad):
        print(f"error: --range {args.range!r}: expected GOOD..BAD", file=sys.stderr)
        return 2
    plant = Plant(
        args.file,
        args.old.encode().decode("unicode_escape"),
        args.new.encode().decode("unicode_escape"),
    )
    with tempfile.TemporaryDirectory(prefix="replaykit-drill-") as tmp:
        try:
            planted = plant_history(
                args.repo, good, bad, Path(tmp) / "repo", plant=plant, at=args.plant_at
            )
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(
            f"copied {len(planted.commits)} commits of {args.range} onto branch {planted.branch!r} in a "
            f"temporary clone; bug planted in {plant.path} at {planted.planted[:7]}"
        )
        for copy, original in zip(planted.commits, planted.originals, strict=True):
            mark = "  <- planted" if copy == planted.planted else ""
            print(f"  {copy[:7]} (from {original[:7]}){mark}")
        if args.dry_run:
            return 0
        record: dict[str, Any] = {
            "range": args.range,
            "plant": asdict(plant),
            "planted": planted.planted,
            "commits": planted.commits,
            "originals": planted.originals,
        }
        try:
            result = bisect(
                planted.repo,
                planted.good,
                planted.bad,
                markers=args.markers or None,
                ids=args.ids,
                runs_dir=args.runs_dir.resolve(),
                progress=not args.no_progress,
                run_timeout=args.timeout,
            )
        except ValueError as exc:  # an endpoint did not hold: the drill failed
            folder = getattr(exc, "folder", None)
            if folder is not None:
                (Path(folder) / "drill.json").write_text(
                    json.dumps(record | {"named": None, "error": str(exc)}, indent=1)
                )
            print(f"DRILL FAILED: {exc}", file=sys.stderr)
            return 1
    named = result.first_bad.sha if result.first_bad else None
    (result.folder / "drill.json").write_text(
        json.dumps(record | {"named": named, "ok": named == planted.planted}, indent=1)
    )
    print(result.folder)
    print(result.report(), end="")
    if named == planted.planted:
        print(f"DRILL PASSED: bisect named the planted commit {planted.planted[:7]}")
        return 0
    print(
        f"DRILL FAILED: bisect named {named[:7] if named else 'no single commit'}, "
        f"the bug was planted at {planted.planted[:7]}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())

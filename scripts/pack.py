"""Pack this tree (or a revision) into one verified archive for a GPU host; or check one.

    python scripts/pack.py                                  # working tree, dirty included -> dist/
    python scripts/pack.py --rev HEAD~2 --out /tmp/packs    # a commit, as git archive would
    python scripts/pack.py --wheelhouse --python 3.12       # plus wheels for an offline host
    python scripts/pack.py --verify dist/replaykit-abc1234.tar.gz

Exit code: 0 ok, 1 a bad archive (--verify) or a failed pack.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_pack():
    """replaykit/workflow/archive.py by path: the standard library only, so no torch import for packing."""
    spec = importlib.util.spec_from_file_location("replaykit_pack", ROOT / "replaykit" / "workflow" / "archive.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


pk = _load_pack()


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _summary(manifest: dict) -> list[str]:
    commit = manifest["commit"] or "(no commit)"
    lines = [
        f"top      {pk.top_name(manifest)}/",
        f"commit   {commit}" + ("  dirty" if manifest["dirty"] else "  clean"),
        f"rev      {manifest.get('rev')}",
        f"tree     {manifest.get('tree_hash')}",
        f"files    {len(manifest['files'])}  sha256 {manifest['sha256']}",
        f"created  {manifest.get('created_utc')}",
    ]
    if manifest["dirty"]:
        lines.append(f"diff     {len(manifest['diff'].splitlines())} lines")
    wh = manifest.get("wheelhouse")
    if wh:
        lines.append(f"wheels   {len(wh['files'])} for Python {wh['python']} {wh['platform'][0]}")
        lines.append(f"install  {pk.install_command(manifest)}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", help="commit to pack (default: the working tree, dirty included)")
    ap.add_argument("--out", type=Path, default=Path("dist"), help="output folder or .tar.gz")
    ap.add_argument("--repo", type=Path, default=ROOT, help="repository (default: this one)")
    ap.add_argument("--wheelhouse", action="store_true", help="add wheels for an offline host")
    ap.add_argument("--python", default="3.12", help="wheelhouse target Python (default 3.12)")
    ap.add_argument(
        "--requirement",
        "-r",
        action="append",
        metavar="R",
        help="wheelhouse requirement (repeatable; default: the notebook set)",
    )
    ap.add_argument(
        "--interpreter", help="Python of the target version that runs pip (default: found)"
    )
    ap.add_argument("--no-deps", action="store_true", help="wheelhouse without dependencies")
    ap.add_argument("--verify", type=Path, metavar="ARCHIVE", help="check an archive and exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verify is not None:
        try:
            manifest = pk.verify_archive(args.verify)
        except ValueError as exc:
            print(f"BAD ARCHIVE: {exc}", file=sys.stderr)
            return 1
        print(f"ok       {args.verify}")
        print("\n".join(_summary(manifest)))
        return 0
    wheelhouse = None
    if args.wheelhouse or args.requirement:
        reqs = args.requirement or list(pk.NOTEBOOK_REQUIREMENTS)
        wheelhouse = pk.Wheelhouse(
            reqs, python=args.python, no_deps=args.no_deps, interpreter=args.interpreter
        )
    try:
        result = pk.pack(args.repo, args.out, rev=args.rev, wheelhouse=wheelhouse)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(result.path)
    print(f"size     {_mb(result.size)}")
    print("\n".join(_summary(result.manifest)))
    if wheelhouse is not None:
        print(f"target   {pk.install_command(result.manifest, target='.pylibs')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

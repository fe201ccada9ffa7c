"""A notebook's first cell, after it fetched the tree: verify it, install what the notebook needs, import it.

    boot.bootstrap(tree, "parity")     # the cell loads this file by path first

It runs before replaykit (or torch) can be imported, so it is standard library only and the
notebook's bootstrap cell executes it straight from the archive or folder it fetched (an
upload, a Drive path, a clone of ``<git URL>@<ref>``: the cell's job, it needs no replaykit).
It is also where a packed archive is read: ``verify_archive`` and ``unpack`` (``archive.py``
packs, and re-exports these).

What ``bootstrap`` does, in order:

1. an archive made by ``pack`` is verified completely (an edited one is refused) and unpacked
   beside itself; a folder is used as it is.
2. ``ensure``: the packages the notebook needs (the tree's ``pyproject.toml`` extras, see
   ``NOTEBOOK_EXTRAS``) that are missing are installed with pip, from the archive's wheelhouse
   when it carries one (offline hosts), else from the package index. Never torch: the installed
   torch is pinned as a constraint, so nothing can replace it (Colab's build matches its driver).
   Non-editable and into the running interpreter, so no kernel restart is needed.
3. the tree goes first on ``sys.path`` (and on ``PYTHONPATH`` for subprocesses: pytest, DDP).
4. in a notebook, what each later cell shows is recorded for the seal (``outputs``).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

MANIFEST_NAME = "replaykit-manifest.json"
"""At the root of a packed tree: commit, dirty, sha256 and per-file sha256 (the fingerprint reads it)."""
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
FORMAT = 1
PREFIX = "replaykit"
WHEELHOUSE_DIR = "wheelhouse"

NOTEBOOK_EXTRAS: dict[str, tuple[str, ...]] = {
    "parity": ("testing", "notebooks"),
    "benchmark": ("testing", "notebooks"),
    "hazards": ("notebooks",),
    "verify": ("testing", "verify"),
}
"""The ``pyproject.toml`` extras each notebook needs (the verify notebook runs the tree's own tests,
which import Lightning)."""

NEVER_INSTALLED = ("torch", "triton", "nvidia-")
"""Requirement names the bootstrap never installs: the runtime's torch build matches its driver."""

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


def say(text: str) -> None:
    print(f"replaykit bootstrap: {text}", flush=True)


# --------------------------------------------------------------------------- hashing


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB blocks (manifests, run summaries, evidence)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def tree_sha256(files: dict[str, str]) -> str:
    """Content hash of a tree: sha256 over the sorted ``path\\0sha256\\n`` lines."""
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(f"{path}\0{files[path]}\n".encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- reading an archive


def top_name(manifest: dict[str, Any]) -> str:
    """``replaykit-<short>[-dirty]``: the archive's top folder."""
    return f"{PREFIX}-{manifest['short']}" + ("-dirty" if manifest["dirty"] else "")


def stem(name: str) -> str:
    """An archive's name without ``.tar.gz``/``.tgz``/``.tar``."""
    return name.removesuffix(".gz").removesuffix(".tgz").removesuffix(".tar")


def member_parts(name: str) -> list[str]:
    """Components of a member name; refuses absolute paths, ``..``, ``.`` and empty parts."""
    clean = name[:-1] if name.endswith("/") else name
    parts = clean.split("/")
    if (
        not clean
        or clean.startswith("/")
        or "\\" in clean
        or "\0" in clean
        or re.match(r"^[A-Za-z]:", clean)
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise ValueError(f"unsafe member path {name!r}: absolute, '..' or malformed")
    return parts


def _iter_members(path: Path) -> Iterable[tuple[str, list[str], tarfile.TarInfo, Any]]:
    """(name, parts, info, file object or None) for every member, checked for safety."""
    with tarfile.open(path, "r|gz") as tar:
        for info in tar:
            parts = member_parts(info.name)
            if info.isdir():
                yield info.name, parts, info, None
            elif info.isfile():
                yield info.name, parts, info, tar.extractfile(info)
            else:
                kind = "link" if info.issym() or info.islnk() else "special file"
                raise ValueError(f"{info.name!r} is a {kind}; only files and folders are accepted")


def check_stream(path: Path) -> None:
    """Read the whole gzip stream: a truncated or bit-flipped archive fails its CRC/length."""
    with gzip.open(path, "rb") as gz:
        while gz.read(_CHUNK):
            pass


def expected_files(manifest: dict[str, Any]) -> dict[str, str]:
    """Relative path -> sha256 of every file the archive must hold (besides the manifest)."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        fmt = manifest.get("format") if isinstance(manifest, dict) else None
        raise ValueError(f"unsupported manifest format {fmt!r} (expected {FORMAT})")
    for key in ("commit", "short", "dirty", "files", "sha256"):
        if key not in manifest:
            raise ValueError(f"manifest lacks {key!r}")
    files = manifest["files"]
    if not isinstance(files, dict) or not all(
        isinstance(v, str) and _HEX64.match(v) for v in files.values()
    ):
        raise ValueError("manifest 'files' is not a {path: sha256} mapping")
    if tree_sha256(files) != manifest["sha256"]:
        raise ValueError("manifest 'sha256' does not match its 'files' list")
    expected = dict(files)
    wh = manifest.get("wheelhouse")
    if wh:
        for whl, digest in wh["files"].items():
            expected[f"{wh['dir']}/{whl}"] = digest
    dirs = set()
    for rel in expected:
        parts = member_parts(rel)
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    if clash := sorted(dirs & expected.keys()):
        raise ValueError(f"manifest lists {clash[0]!r} both as a file and as a folder")
    return expected


def verify_archive(path: Path) -> dict[str, Any]:
    """Check ``path`` completely and return its manifest; ValueError names any problem.

    Refuses a corrupted or truncated gzip/tar, unsafe members (absolute, ``..``, links,
    devices), several top folders, a missing or inconsistent manifest, and any file that
    is missing, extra, or whose sha256 differs from the manifest. Nothing is written.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such archive")
    seen: dict[str, str] = {}
    tops: set[str] = set()
    manifest_bytes: bytes | None = None
    try:
        check_stream(path)
        for name, parts, _info, fobj in _iter_members(path):
            tops.add(parts[0])
            if len(tops) > 1:
                raise ValueError(f"members under several top folders: {sorted(tops)}")
            if fobj is None:
                continue
            rel = "/".join(parts[1:])
            if not rel:
                raise ValueError(f"{name!r}: a file where the top folder should be")
            if rel in seen or (rel == MANIFEST_NAME and manifest_bytes is not None):
                raise ValueError(f"{name!r} appears twice")
            if rel == MANIFEST_NAME:
                manifest_bytes = fobj.read()
                continue
            h = hashlib.sha256()
            while chunk := fobj.read(_CHUNK):
                h.update(chunk)
            seen[rel] = h.hexdigest()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise ValueError(f"{path.name}: corrupted or truncated archive ({exc})") from exc
    if manifest_bytes is None:
        raise ValueError(f"{path.name}: no {MANIFEST_NAME} under the top folder")
    try:
        manifest = json.loads(manifest_bytes)
    except ValueError as exc:
        raise ValueError(f"{path.name}: {MANIFEST_NAME} is not valid JSON ({exc})") from exc
    expected = expected_files(manifest)
    top = next(iter(tops))
    if top != top_name(manifest):
        raise ValueError(f"top folder {top!r} does not match the manifest ({top_name(manifest)!r})")
    missing = sorted(set(expected) - set(seen))
    extra = sorted(set(seen) - set(expected))
    bad = sorted(p for p in expected.keys() & seen.keys() if expected[p] != seen[p])
    problems = [
        f"{label}: {', '.join(items[:10])}"
        + (f" (+{len(items) - 10} more)" if len(items) > 10 else "")
        for label, items in (
            ("sha256 mismatch", bad),
            ("missing from the archive", missing),
            ("not in the manifest", extra),
        )
        if items
    ]
    if problems:
        raise ValueError(f"{path.name}: " + "; ".join(problems))
    return manifest


def unpack(path: Path, dest: Path, *, replace: bool = False) -> Path:
    """Verify ``path``, then extract it under ``dest``; returns the tree root ``dest/<top>``.

    Extraction goes to a hidden folder beside the target and is renamed into place, so a
    failure leaves nothing half-written. An existing target is an error unless ``replace``.
    """
    manifest = verify_archive(path)
    expected = expected_files(manifest)
    top = top_name(manifest)
    dest = Path(dest).resolve()
    final = dest / top
    if final.exists() and not replace:
        raise FileExistsError(f"{final} exists (pass replace=True to overwrite it)")
    dest.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{top}.", dir=dest))
    try:
        staged = work / top
        staged.mkdir()
        for _name, parts, info, fobj in _iter_members(Path(path)):
            rel = "/".join(parts[1:])
            if fobj is None or not rel:
                continue
            target = staged.joinpath(*parts[1:])
            target.parent.mkdir(parents=True, exist_ok=True)
            h = hashlib.sha256()
            with open(target, "xb") as f:
                while chunk := fobj.read(_CHUNK):
                    h.update(chunk)
                    f.write(chunk)
            same = (
                json.loads(target.read_bytes()) == manifest
                if rel == MANIFEST_NAME
                else expected.get(rel) == h.hexdigest()
            )
            if not same:
                raise ValueError(f"{rel}: changed between verification and extraction")
            target.chmod(0o755 if info.mode & 0o100 else 0o644)
        if final.exists():
            shutil.rmtree(final)
        staged.rename(final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


# --------------------------------------------------------------------------- where it runs


def in_colab() -> bool:
    """True inside a Google Colab runtime."""
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


# --------------------------------------------------------------------------- what a notebook needs


def _requirement_name(req: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not match:
        raise ValueError(f"unreadable requirement {req!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(root: Path, extras: Iterable[str]) -> list[str]:
    """The requirements of ``extras`` in ``root``'s pyproject.toml, ``replaykit[x]`` expanded,
    torch and its CUDA stack left out."""
    try:
        import tomllib
    except (
        ImportError
    ):  # Python 3.10: read the flat lists of [project.optional-dependencies] by hand
        tomllib = None
    text = (Path(root) / "pyproject.toml").read_text()
    if tomllib is not None:
        table = tomllib.loads(text)["project"]["optional-dependencies"]
    else:
        block = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
        table = {
            k: re.findall(r'"([^"]+)"', v)
            for k, v in re.findall(r"^(\w[\w-]*)\s*=\s*\[(.*?)\]", block, re.M | re.S)
        }
    out: list[str] = []
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        if extra not in table:
            raise ValueError(f"{root}/pyproject.toml has no extra {extra!r}")
        seen.add(extra)
        for req in table[extra]:
            name = _requirement_name(req)
            if name == PREFIX:
                todo += re.findall(r"[\w-]+", req.split("[", 1)[1]) if "[" in req else []
            elif not name.startswith(NEVER_INSTALLED) and req not in out:
                out.append(req)
    return out


TORCH_RUN = ("2.11", "2.12", "2.13")
"""torch releases this project holds run evidence for (runs/README.md: 2.11.0+cu128 on an H200,
2.12.1 and 2.13.0 on the CPU). Others in the supported range are allowed, and said to be untested."""


def _release(version: str) -> tuple[int, ...]:
    """``2.11.0+cu128`` -> (2, 11, 0): the numeric release, local and pre-release tags dropped."""
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def torch_floor(root: Path) -> str | None:
    """The oldest torch the tree supports: its pyproject's ``torch>=X`` (the one place it is said)."""
    text = (Path(root) / "pyproject.toml").read_text()
    block = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.M | re.S)
    found = re.search(r"[\"']torch\s*>=\s*([\d.]+)", block.group(1)) if block else None
    return found.group(1) if found else None


def check_torch(root: Path | None) -> None:
    """Refuse, in one line, a torch older than the tree supports; name an untested one."""
    version = installed("torch")
    floor = torch_floor(root) if root is not None else None
    if version is None or floor is None:
        return
    if _release(version) < _release(floor):
        raise RuntimeError(
            f"torch {version} is older than this tree supports (torch>={floor}, pyproject.toml): "
            "pick a runtime or environment with a newer torch"
        )
    if ".".join(map(str, _release(version)[:2])) not in TORCH_RUN:
        say(f"torch {version}: supported (torch>={floor}), but no run of this project used it yet")


def installed(name: str) -> str | None:
    """The installed version of distribution ``name``, or None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _distributions() -> dict[str, str]:
    found = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found[re.sub(r"[-_.]+", "-", name).lower()] = dist.version
    return found


def _wheelhouse(root: Path | None) -> Path | None:
    folder = root / WHEELHOUSE_DIR if root is not None else None
    return folder if folder is not None and any(folder.glob("*.whl")) else None


def pip_command(reqs: list[str], wheelhouse: Path | None, constraints: Path) -> list[str]:
    """pip install into this interpreter: from the wheelhouse only when there is one; torch pinned."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "-c",
        str(constraints),
    ]
    if wheelhouse is not None:
        cmd += ["--no-index", "--find-links", str(wheelhouse)]
    return [*cmd, *reqs]


def fix_line(reqs: list[str], wheelhouse: Path | None) -> str:
    """What to type in a cell to install ``reqs`` by hand (then Run all again)."""
    where = f" --no-index --find-links {wheelhouse}" if wheelhouse is not None else ""
    return (
        "%pip install"
        + where
        + " "
        + " ".join(f"'{r}'" if re.search(r"[<>=!\[ ]", r) else r for r in reqs)
    )


def ensure(reqs: list[str], root: Path | None = None) -> list[str]:
    """Install the requirements of ``reqs`` whose distribution is missing; returns what was installed.

    Prints what it installs, from where, and how long it took; RuntimeError (one line, with the
    command that fixes it) when pip fails or something is still missing afterwards.
    """
    torch_version = installed("torch")
    if torch_version is None:
        raise RuntimeError(
            "torch is not installed, and the bootstrap never installs it (Colab has it; elsewhere "
            "install the torch build for your CUDA first)"
        )
    missing = [r for r in reqs if installed(_requirement_name(r)) is None]
    if not missing:
        say(
            f"nothing to install: {', '.join(_requirement_name(r) for r in reqs) or 'no packages'} present (torch {torch_version})"
        )
        return []
    wheelhouse = _wheelhouse(root)
    source = f"the wheelhouse {wheelhouse}" if wheelhouse is not None else "the package index"
    say(f"installing {', '.join(missing)} from {source} (torch {torch_version} kept)")
    before = _distributions()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="replaykit-pip-") as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(f"torch=={torch_version}\n")
        proc = subprocess.run(
            pip_command(missing, wheelhouse, constraints),
            capture_output=True,
            text=True,
            check=False,
        )
    took = time.monotonic() - started
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        raise RuntimeError(
            f"pip could not install {', '.join(missing)} ({tail[-1] if tail else proc.returncode}); fix: {fix_line(missing, wheelhouse)}"
        )
    importlib.invalidate_caches()
    after = _distributions()
    new = sorted(f"{n} {v}" for n, v in after.items() if before.get(n) != v)
    say(f"installed in {took:.1f} s: {', '.join(new) or '(nothing new)'}")
    still = [r for r in missing if installed(_requirement_name(r)) is None]
    if still:
        raise RuntimeError(
            f"still missing after the bootstrap: {', '.join(still)}; fix: {fix_line(still, wheelhouse)}"
        )
    if installed("torch") != torch_version:
        raise RuntimeError(
            f"torch changed from {torch_version} to {installed('torch')}: restart the runtime"
        )
    return new


# --------------------------------------------------------------------------- the bootstrap


def _checkout_above(here: Path) -> Path | None:
    return next(
        (p for p in (here, *here.parents) if (p / "replaykit" / "__init__.py").is_file()), None
    )


def resolve(tree: str) -> Path | None:
    """The tree's root folder: a folder as is; an archive verified, then unpacked beside itself
    (into a folder named after it); ``""``: None when replaykit is importable, else the checkout
    above the working directory."""
    if not tree:
        if importlib.util.find_spec("replaykit") is not None:
            return None
        root = _checkout_above(Path.cwd())
        if root is None:
            raise RuntimeError(
                "replaykit is not importable: set tree= to a git URL, an archive made by "
                "scripts/pack.py or a folder (in Colab: tree='upload' asks for the archive)"
            )
        return root
    path = Path(tree).expanduser().resolve()
    if path.is_dir():
        return path
    if path.is_file() and path.name.endswith(ARCHIVE_SUFFIXES):
        try:
            root = unpack(path, path.with_name(stem(path.name)), replace=True)
        except ValueError as exc:
            raise RuntimeError(
                f"{path.name} does not match its manifest or is damaged ({exc}); pack it and upload it again"
            ) from None
        say(f"{path.name} verified against its manifest, unpacked into {root}")
        return root
    raise FileNotFoundError(
        f"tree {tree!r}: not a folder, a git URL or an archive made by scripts/pack.py"
    )


def bootstrap(
    tree: str | Path = "",
    notebook: str | None = None,
    *,
    on_path: bool = True,
    install: bool | None = None,
) -> Path | None:
    """Make ``replaykit`` and what ``notebook`` needs importable; returns the tree's root (None when
    ``tree`` is ``""`` and replaykit is importable already).

    ``notebook`` (``"parity"``, ``"verify"`` ...) names the extras to ensure (``NOTEBOOK_EXTRAS``),
    read from the tree's pyproject.toml. ``on_path`` False: the tree is only the one under test (the
    verify notebook keeps running the replaykit it has, and needs that one's extras: the tree is not
    read here, it may be any project). ``install`` None: install what is
    missing when a tree was given (Colab, an offline host with the archive's wheelhouse), and
    only check, naming the fix, when ``tree`` is ``""`` (your own environment).
    """
    root = resolve(str(tree)) if on_path else None
    if root is not None and on_path:
        sys.path.insert(0, str(root))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(root), os.environ.get("PYTHONPATH")])
        )
        importlib.invalidate_caches()
    record_outputs()
    if notebook is None:
        return root
    source = root or _importable_checkout()
    check_torch(source)
    reqs = requirements(source, NOTEBOOK_EXTRAS[notebook]) if source is not None else []
    if install if install is not None else bool(str(tree)):
        ensure(reqs, root)
    else:
        missing = [r for r in reqs if installed(_requirement_name(r)) is None]
        if missing:
            raise RuntimeError(
                f"the {notebook} notebook needs {', '.join(missing)}; fix: {fix_line(missing, None)}"
            )
    return root


def record_outputs() -> None:
    """In a notebook: start recording what each cell shows, so the seal (the last cell) covers
    every output from the next cell on (``replaykit.workflow.outputs``; absent in older trees)."""
    if "IPython" not in sys.modules:
        return
    try:
        outputs = importlib.import_module("replaykit.workflow.outputs")
    except ImportError:
        return
    outputs.start()


def _importable_checkout() -> Path | None:
    """The checkout holding the importable replaykit (with its pyproject.toml), if there is one."""
    spec = importlib.util.find_spec("replaykit")
    if spec is None or not spec.origin:
        return None
    root = Path(spec.origin).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() else None

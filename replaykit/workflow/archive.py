"""Pack a source tree into one verified archive for a GPU host (Colab or offline); open trees.

(One module: packing, the wheelhouse and opening a tree share the manifest's format.)

    result = pack(Path("."), Path("dist"))            # working tree, dirty included
    result = pack(Path("."), Path("dist"), rev="HEAD~3", wheelhouse=Wheelhouse(NOTEBOOK_REQUIREMENTS))
    manifest = verify_archive(result.path)            # ValueError on any corruption
    root = unpack(result.path, Path("/content"))      # verifies first, then extracts
    root = open_tree("any.tar.gz", Path("work"))      # a folder or any archive, manifest checked

The archive is a ``.tar.gz`` whose members all sit under ``replaykit-<short>[-dirty]/``;
that folder holds ``replaykit-manifest.json`` (commit, tree hash, diff, per-file sha256,
optional wheelhouse). Reading an archive (``verify_archive``, ``unpack``) and a notebook's
bootstrap live in ``bootstrap.py`` (the one part a notebook loads by path), re-exported here.
No torch: ``import replaykit`` is lazy, so this imports as part of the package.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import fnmatch
import gzip
import hashlib
import io
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replaykit.workflow import bootstrap as _boot
from replaykit.workflow.git import git as _git
from replaykit.workflow.interpreters import InterpreterError
from replaykit.workflow.interpreters import probe as _ask

ARCHIVE_SUFFIXES = _boot.ARCHIVE_SUFFIXES
FORMAT = _boot.FORMAT
MANIFEST_NAME = _boot.MANIFEST_NAME
PREFIX = _boot.PREFIX
WHEELHOUSE_DIR = _boot.WHEELHOUSE_DIR
bootstrap = _boot.bootstrap
file_sha256 = _boot.file_sha256
in_colab = _boot.in_colab
top_name = _boot.top_name
tree_sha256 = _boot.tree_sha256
unpack = _boot.unpack
verify_archive = _boot.verify_archive
_stem = _boot.stem

EXCLUDED_PARTS = frozenset({".git", ".venv", "__pycache__", ".whl", ".wheelhouse"})
"""Path components never packed, at any depth."""
EXCLUDED_TOP = frozenset({"runs", "dist", WHEELHOUSE_DIR, MANIFEST_NAME})
"""Top-level names never packed (run evidence, archives, names the archive reserves)."""

NOTEBOOK_REQUIREMENTS = [
    "papermill>=2.6",
    "nbformat",
    "nbclient",
    "ipykernel",
    "jupyter_client",
    "nbval",
    "junitparser",
    "pytest",
    "tqdm",
    "ipywidgets",
    "matplotlib",
    "pandas",
    "numpy",
    "pyyaml",
]
"""What the notebooks and the workflow need on a host that has only torch and lightning (the
CUDA-sized training stack a wheelhouse leaves out): the bootstrap installs a notebook's missing
share from it; tests/workflow/test_recipes.py proves it."""

MANYLINUX_X86_64 = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)

HUGE = ("torch", "triton", "nvidia-*")
"""Projects dropped from a wheelhouse: the GPU host has them, and they weigh gigabytes."""

_CHUNK = 1 << 20


# --------------------------------------------------------------------------- hashing


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _git_blob_id(data: bytes, algo: str) -> str:
    return hashlib.new(algo, b"blob %d\0" % len(data) + data).hexdigest()


# --------------------------------------------------------------------------- git


def _excluded(path: str, extra: tuple[str, ...] = ()) -> bool:
    parts = path.split("/")
    return (
        parts[0] in EXCLUDED_TOP
        or any(p in EXCLUDED_PARTS for p in parts)
        or any(path == e or path.startswith(e + "/") for e in extra)
        or fnmatch.fnmatch(parts[-1], f"{PREFIX}-*.tar.gz")  # our own archives
    )


@dataclass(frozen=True)
class _Entry:
    mode: str  # git mode: 100644 / 100755
    oid: str


def _ls_tree(root: Path, commit: str, extra: tuple[str, ...]) -> dict[str, _Entry]:
    """Blob entries of ``commit`` (packable paths only); symlinks and submodules refused."""
    out: dict[str, _Entry] = {}
    for rec in _git(root, "ls-tree", "-r", "-z", "--full-tree", commit).split(b"\0"):
        if not rec:
            continue
        meta, path_b = rec.split(b"\t", 1)
        mode, kind, oid = meta.decode().split()
        path = path_b.decode("utf-8", "surrogateescape")
        if _excluded(path, extra):
            continue
        if kind != "blob" or mode not in ("100644", "100755"):
            raise ValueError(
                f"{path}: {kind} with mode {mode} (symlink or submodule) is not packed"
            )
        out[path] = _Entry(mode, oid)
    return out


def _cat_blobs(root: Path, oids: list[str]) -> list[bytes]:
    """Contents of blobs ``oids``, in order, through one ``git cat-file --batch``."""
    if not oids:
        return []
    raw = _git(root, "cat-file", "--batch", input="\n".join(oids).encode() + b"\n")
    blobs, pos = [], 0
    for oid in oids:
        eol = raw.index(b"\n", pos)
        header = raw[pos:eol].decode().split()
        if len(header) != 3 or header[0] != oid:
            raise ValueError(f"git cat-file: unexpected reply {raw[pos:eol]!r} for {oid}")
        size = int(header[2])
        blobs.append(raw[eol + 1 : eol + 1 + size])
        pos = eol + 1 + size + 1
    return blobs


def _rev_parse(root: Path, spec: str) -> str | None:
    out = subprocess.run(
        ["git", "rev-parse", "--verify", "-q", spec], cwd=root, capture_output=True, check=False
    )
    if out.returncode != 0:
        return None
    return out.stdout.decode().strip() or None


@dataclass
class _Snapshot:
    files: dict[str, bytes]
    executable: set[str]
    commit: str | None
    short: str
    dirty: bool
    tree_hash: str | None
    diff: str
    mtime: int


def _commit_meta(root: Path, commit: str) -> tuple[str, str, int]:
    short = _git(root, "rev-parse", "--short=7", commit).decode().strip()
    tree = _git(root, "rev-parse", f"{commit}^{{tree}}").decode().strip()
    mtime = int(_git(root, "show", "-s", "--format=%ct", commit).decode().strip())
    return short, tree, mtime


def _snapshot_rev(root: Path, rev: str, extra: tuple[str, ...]) -> _Snapshot:
    commit = None if rev.startswith("-") else _rev_parse(root, f"{rev}^{{commit}}")
    if commit is None:
        raise ValueError(f"{rev!r} is not a commit in {root}")
    entries = _ls_tree(root, commit, extra)
    paths = sorted(entries)
    blobs = _cat_blobs(root, [entries[p].oid for p in paths])
    short, tree, mtime = _commit_meta(root, commit)
    return _Snapshot(
        files=dict(zip(paths, blobs, strict=True)),
        executable={p for p in paths if entries[p].mode == "100755"},
        commit=commit,
        short=short,
        dirty=False,
        tree_hash=tree,
        diff="",
        mtime=mtime,
    )


def _snapshot_worktree(root: Path, extra: tuple[str, ...]) -> _Snapshot:
    listed = _git(root, "ls-files", "-z", "-c", "-o", "--exclude-standard").split(b"\0")
    files: dict[str, bytes] = {}
    executable: set[str] = set()
    for path in sorted({p.decode("utf-8", "surrogateescape") for p in listed if p}):
        full = root / path
        if _excluded(path.rstrip("/"), extra) or not os.path.lexists(full):
            continue  # excluded, or tracked but deleted (the diff shows it)
        if full.is_symlink() or not full.is_file():
            raise ValueError(f"{path}: symlink, submodule or nested repository is not packed")
        files[path] = full.read_bytes()  # read once: hashed and archived from these bytes
        if os.stat(full).st_mode & 0o100:
            executable.add(path)

    commit = _rev_parse(root, "HEAD^{commit}")
    if commit is None:  # no commit yet: everything is new
        diff = _diff_new(root, sorted(files))
        return _Snapshot(files, executable, None, "nohead", True, None, diff, _now_ts())
    short, tree, _ = _commit_meta(root, commit)
    head = _ls_tree(root, commit, extra)
    algo = "sha256" if len(commit) == 64 else "sha1"
    changed = [
        p
        for p, e in head.items()
        if p not in files
        or e.oid != _git_blob_id(files[p], algo)
        or (e.mode == "100755") != (p in executable)
    ]
    new = [p for p in files if p not in head]
    dirty = bool(changed or new)
    diff = ""
    if changed:
        specs = [f":(top,literal){p}" for p in sorted(changed)]
        diff = _git(
            root,
            "diff",
            "--binary",
            "--no-color",
            "--no-ext-diff",
            "--no-textconv",
            "HEAD",
            "--",
            *specs,
        ).decode("utf-8", "replace")
    diff += _diff_new(root, new)
    mtime = _now_ts() if dirty else int(_git(root, "show", "-s", "--format=%ct", commit).decode())
    return _Snapshot(files, executable, commit, short, dirty, tree, diff, mtime)


def _diff_new(root: Path, paths: list[str]) -> str:
    """``git diff`` text creating ``paths`` (untracked or not in HEAD)."""
    parts = []
    for p in paths:
        out = _git(
            root, "diff", "--no-index", "--binary", "--no-color", "--", "/dev/null", p, ok=(0, 1)
        )
        parts.append(out.decode("utf-8", "replace"))
    return "".join(parts)


def _now_ts() -> int:
    return int(_dt.datetime.now(_dt.timezone.utc).timestamp())


def _toplevel(repo: Path) -> Path:
    out = _git(Path(repo), "rev-parse", "--show-toplevel")
    return Path(out.decode().strip()).resolve()


# --------------------------------------------------------------------------- wheelhouse


@dataclass(frozen=True)
class Wheelhouse:
    """Wheels for an offline host: ``requirements`` and their dependencies, for one target.

    pip evaluates environment markers (``python_version >= "3.12"``) against the
    interpreter that runs it, not ``--python-version``: the download runs under
    ``interpreter``, by default one of version ``python`` found on PATH or under pyenv.
    """

    requirements: list[str]
    python: str = "3.12"
    platforms: tuple[str, ...] = MANYLINUX_X86_64
    no_deps: bool = False
    exclude: tuple[str, ...] = HUGE
    """Project-name globs removed after download (the host already has them)."""
    interpreter: str | None = None
    """Python that runs ``pip download``; must be version ``python`` (None: find one)."""


def _wheel_project(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.split("-", 1)[0]).lower()


def _probe(python: str) -> tuple[str, str, str] | None:
    """(X.Y, sys.platform, machine) of interpreter ``python``, None if it does not run."""
    try:
        found = _ask(python, timeout=30)
    except InterpreterError:
        return None
    return found.minor, found.platform, found.machine


def find_interpreter(wh: Wheelhouse) -> str:
    """A Python of version ``wh.python`` on a host matching ``wh.platforms``, to run pip."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    if wh.interpreter:
        candidates = [wh.interpreter]
    else:
        candidates = [sys.executable, shutil.which(f"python{wh.python}") or ""]
        candidates += sorted(str(p) for p in pyenv.glob(f"versions/{wh.python}.*/bin/python"))
    linux_x86 = all(
        p.startswith(("manylinux", "linux")) and p.endswith("x86_64") for p in wh.platforms
    )
    seen = []
    for cand in filter(None, candidates):
        info = _probe(cand)
        seen.append(f"{cand}: {' '.join(info) if info else 'does not run'}")
        if info and info[0] == wh.python:
            if linux_x86 and info[1:] != ("linux", "x86_64"):
                raise RuntimeError(
                    f"{cand} runs on {info[1]}/{info[2]}: markers would be evaluated for the "
                    "wrong platform; build a linux x86_64 wheelhouse on a linux x86_64 machine"
                )
            return cand
    raise RuntimeError(
        f"no Python {wh.python} to resolve the wheelhouse with (pip evaluates markers for the "
        f"interpreter running it); pass Wheelhouse(interpreter=...). Tried: {'; '.join(seen)}"
    )


def _run_pip(cmd: list[str]) -> None:
    """Run a pip command (tests replace this)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip()[-3000:]
        raise RuntimeError(f"pip download failed ({proc.returncode}):\n{tail}")


def pip_download_command(wh: Wheelhouse, dest: Path, python: str = sys.executable) -> list[str]:
    cmd = [
        python,
        "-m",
        "pip",
        "download",
        "--only-binary=:all:",
        "--python-version",
        wh.python,
        "--implementation",
        "cp",
    ]
    for plat in wh.platforms:
        cmd += ["--platform", plat]
    if wh.no_deps:
        cmd.append("--no-deps")
    return [*cmd, "--disable-pip-version-check", "-d", str(dest), *wh.requirements]


def build_wheelhouse(wh: Wheelhouse, dest: Path) -> list[Path]:
    """``pip download`` the wheels of ``wh`` into ``dest``; returns them (excluded ones deleted)."""
    if not wh.requirements:
        raise ValueError("a wheelhouse needs at least one requirement")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    _run_pip(pip_download_command(wh, dest, find_interpreter(wh)))
    wheels = []
    for whl in sorted(dest.glob("*.whl")):
        if any(fnmatch.fnmatch(_wheel_project(whl.name), pat) for pat in wh.exclude):
            whl.unlink()
        else:
            wheels.append(whl)
    if not wheels:
        raise RuntimeError(f"pip download left no wheels in {dest}")
    return wheels


def install_command(
    manifest: dict[str, Any], *, root: str = ".", target: str | None = None, python: str = "python"
) -> str:
    """Offline install line for the archive's wheelhouse, run from ``root`` (the unpacked tree).

    With ``target``, installs into that folder (``--target``: everything comes from the
    wheelhouse, installed packages are ignored); put it on ``sys.path`` afterwards.
    """
    wh = manifest.get("wheelhouse")
    if not wh:
        raise ValueError("this archive carries no wheelhouse")
    links = wh["dir"] if root == "." else posixpath.join(root, wh["dir"])
    cmd = [python, "-m", "pip", "install", "--no-index", "--find-links", links]
    if target:
        cmd += ["--target", target]
    return shlex.join([*cmd, *wh["requirements"]])


OFFLINE_RUN = "python scripts/run_notebook.py notebooks/verify.ipynb -p markers cuda"
"""What the offline recipe runs last, from inside the unpacked tree."""


def offline_recipe(path: Path, manifest: dict[str, Any]) -> list[str]:
    """The offline host's commands, in order, for the archive at ``path`` as it was copied over
    (its own name): untar, verify, install from its wheelhouse, run. ValueError without wheels:
    only the ``-wheelhouse-py<X.Y>`` archive of ``pack --wheelhouse`` carries them."""
    if not manifest.get("wheelhouse"):
        raise ValueError(
            f"{Path(path).name} carries no wheelhouse: for an offline host use the archive "
            "`pack --wheelhouse` makes (named ...-wheelhouse-py<X.Y>.tar.gz)"
        )
    top, name = top_name(manifest), Path(path).name
    return [
        f"tar xzf {name}",
        f"python {top}/scripts/pack.py --verify {name}",
        install_command(manifest, root=top),
        f"cd {top} && {OFFLINE_RUN}",
    ]


# --------------------------------------------------------------------------- pack


@dataclass(frozen=True)
class PackResult:
    path: Path
    manifest: dict[str, Any]
    size: int

    @property
    def top(self) -> str:
        return top_name(self.manifest)

    @property
    def commit(self) -> str | None:
        return self.manifest["commit"]

    @property
    def dirty(self) -> bool:
        return self.manifest["dirty"]

    @property
    def file_count(self) -> int:
        return len(self.manifest["files"])

    @property
    def wheels(self) -> list[str]:
        wh = self.manifest["wheelhouse"]
        return sorted(wh["files"]) if wh else []


def _add(
    tar: tarfile.TarFile, name: str, data: bytes, mtime: int, executable: bool = False
) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), mtime
    info.mode = 0o755 if executable else 0o644
    tar.addfile(info, io.BytesIO(data))


def pack(
    repo: Path, out: Path, *, rev: str | None = None, wheelhouse: Wheelhouse | None = None
) -> PackResult:
    """Pack ``repo`` at ``rev`` (None: the working tree, dirty included) into an archive.

    ``out`` is a directory (the archive is named after its top folder, plus the content
    hash when dirty and ``-wheelhouse-py<X.Y>`` with wheels) or a path ending in ``.tar.gz``. ``.git``, ``.venv``, ``__pycache__``,
    ``.whl``, top-level ``runs/``, ``dist/``, ``wheelhouse/`` and the output folder are
    never packed. In the working tree, only tracked and untracked-not-ignored files count.
    """
    root = _toplevel(Path(repo))
    out = Path(out).resolve()
    out_dir = out.parent if out.name.endswith(".tar.gz") else out
    extra: tuple[str, ...] = ()
    if out_dir.is_relative_to(root) and out_dir != root:
        extra = (out_dir.relative_to(root).as_posix(),)
    snap = _snapshot_rev(root, rev, extra) if rev is not None else _snapshot_worktree(root, extra)

    hashes = {p: sha256_bytes(b) for p, b in snap.files.items()}
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "commit": snap.commit,
        "short": snap.short,
        "dirty": snap.dirty,
        "rev": rev,
        "tree_hash": snap.tree_hash,
        "diff": snap.diff if snap.dirty else "",
        "created_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "files": dict(sorted(hashes.items())),
        "sha256": tree_sha256(hashes),
        "wheelhouse": None,
    }
    top = top_name(manifest)
    name = f"{top}-{manifest['sha256'][:8]}" if snap.dirty else top
    if wheelhouse is not None:  # never overwrites the plain archive of the same tree
        name += f"-wheelhouse-py{wheelhouse.python}"
    name += ".tar.gz"
    path = out if out.name.endswith(".tar.gz") else out / name
    path.parent.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="replaykit-wheels-") as tmp:
        wheels: list[Path] = []
        if wheelhouse is not None:
            wheels = build_wheelhouse(wheelhouse, Path(tmp))
            manifest["wheelhouse"] = {
                "dir": WHEELHOUSE_DIR,
                "python": wheelhouse.python,
                "platform": list(wheelhouse.platforms),
                "requirements": list(wheelhouse.requirements),
                "no_deps": wheelhouse.no_deps,
                "excluded": list(wheelhouse.exclude),
                "files": {w.name: sha256_bytes(w.read_bytes()) for w in wheels},
            }
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            with (
                open(partial, "wb") as raw,
                gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz,
                tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
            ):
                body = json.dumps(manifest, indent=1, sort_keys=False).encode() + b"\n"
                _add(tar, f"{top}/{MANIFEST_NAME}", body, snap.mtime)
                for p in sorted(snap.files):
                    _add(tar, f"{top}/{p}", snap.files[p], snap.mtime, p in snap.executable)
                for w in wheels:
                    _add(tar, f"{top}/{WHEELHOUSE_DIR}/{w.name}", w.read_bytes(), snap.mtime)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
    return PackResult(path=path, manifest=manifest, size=path.stat().st_size)


# --------------------------------------------------------------------------- trees: a folder or any archive


def _unsafe(name: str) -> bool:
    """True for an absolute path (POSIX or drive letter) or one that climbs out with ``..``."""
    clean = name.replace("\\", "/")
    return (
        clean.startswith("/")
        or re.match(r"^[A-Za-z]:", clean) is not None
        or ".." in clean.split("/")
    )


def check_manifest(tree: Path) -> dict[str, Any] | None:
    """The tree's ``replaykit-manifest.json`` (None when it has none), its ``files`` verified.

    ``files`` maps a relative path to the sha256 of its contents; the first missing or
    differing file raises ValueError. A manifest without ``files`` is returned unchecked
    (the fingerprint records it).
    """
    path = Path(tree) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable manifest ({exc})") from exc
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: the manifest is not a JSON object")
    files = manifest.get("files")
    if files is None:
        return manifest
    if not isinstance(files, dict):
        raise ValueError(f"{path}: 'files' must map relative paths to sha256 digests")
    for rel, expected in files.items():
        if _unsafe(rel):
            raise ValueError(f"{path}: refusing manifest entry {rel!r} (absolute or '..')")
        target = Path(tree) / rel
        if not target.is_file():
            raise ValueError(f"manifest mismatch: {rel} is listed in {MANIFEST_NAME} but missing")
        actual = file_sha256(target)
        if actual != str(expected).lower():
            raise ValueError(
                f"manifest mismatch: {rel} has sha256 {actual[:16]}…, "
                f"{MANIFEST_NAME} says {str(expected)[:16]}…"
            )
    return manifest


def _check_member(member: tarfile.TarInfo) -> None:
    """Refuse a member of an arbitrary archive: absolute, ``..``, a link leaving the tree, a device."""
    name = member.name
    if _unsafe(name):
        raise ValueError(f"refusing archive member {name!r}: absolute path or '..'")
    if member.issym() or member.islnk():
        base = posixpath.dirname(name) if member.issym() else ""
        target = posixpath.normpath(posixpath.join(base, member.linkname))
        if member.linkname.startswith("/") or _unsafe(target):
            raise ValueError(
                f"refusing archive link {name!r} -> {member.linkname!r}: leaves the tree"
            )
    elif not (member.isfile() or member.isdir()):
        raise ValueError(f"refusing archive member {name!r}: not a file, folder or link")


def extract_tree(archive: Path, workdir: Path) -> Path:
    """Extract ``archive`` into a new folder under ``workdir`` and return the tree's root.

    Every member is checked first (no absolute paths, no ``..``, no links leaving the tree,
    no devices); a corrupted or truncated archive raises ValueError and leaves nothing behind.
    The root is the archive's single top folder when it has one, else the extraction folder.
    Unlike :func:`unpack` the archive needs no manifest: :func:`open_tree` checks one if present.
    """
    archive, workdir = Path(archive), Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    dest = Path(tempfile.mkdtemp(prefix=f"{_stem(archive.name) or 'tree'}-", dir=workdir))
    try:
        with archive.open("rb") as fh:
            gzipped = fh.read(2) == b"\x1f\x8b"
        if gzipped:  # a plain .tar is left to tarfile
            _boot.check_stream(archive)
        with tarfile.open(archive, "r:*") as tar:
            members = tar.getmembers()
            if not members:
                raise ValueError("the archive is empty")
            for member in members:
                _check_member(member)
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, EOFError, OSError, zlib.error, ValueError) as exc:
        shutil.rmtree(dest, ignore_errors=True)
        why = str(exc) or type(exc).__name__
        raise ValueError(f"{archive}: corrupted, truncated or unsafe archive: {why}") from exc
    entries = list(dest.iterdir())
    if len(entries) == 1 and entries[0].is_dir():
        return entries[0]
    return dest


def open_tree(tree: str | Path, workdir: Path) -> Path:
    """A source tree from a folder or an archive, checked against its manifest when it has one.

    A directory: itself (it must hold ``tests/`` or ``pyproject.toml``). A ``.tar.gz``/``.tgz``/
    ``.tar``: extracted safely into ``workdir`` (:func:`extract_tree`). A ``replaykit-manifest.json``
    at the root with ``files`` is verified (:func:`check_manifest`). Raises ValueError for anything
    unusable and FileNotFoundError for a path that does not exist.
    """
    path = Path(tree).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"tree not found: {path}")
    if path.is_dir():
        root = path
    elif path.name.endswith(ARCHIVE_SUFFIXES):
        root = extract_tree(path, Path(workdir))
    else:
        raise ValueError(f"{path}: not a directory or a {'/'.join(ARCHIVE_SUFFIXES)} archive")
    root = root.resolve()
    if not ((root / "tests").is_dir() or (root / "pyproject.toml").is_file()):
        raise ValueError(f"{root} is not a source tree: it holds neither tests/ nor pyproject.toml")
    check_manifest(root)
    return root


# --------------------------------------------------------------------------- the `pack` command


def _summary(manifest: dict[str, Any]) -> list[str]:
    commit = manifest["commit"] or "(no commit)"
    lines = [
        f"top      {top_name(manifest)}/",
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
        lines.append(f"install  {install_command(manifest)}")
    else:
        lines.append(
            "wheels   none: an offline host needs the archive of `pack --wheelhouse` "
            f"({top_name(manifest)}-wheelhouse-py<X.Y>.tar.gz)"
        )
    return lines


PACK_USAGE = """Pack a tree (or a revision) into one verified archive for a GPU host; or check one.

    replaykit-workflow pack                                  # working tree, dirty included -> dist/
    replaykit-workflow pack --rev HEAD~2 --out /tmp/packs    # a commit, as git archive would
    replaykit-workflow pack --wheelhouse --python 3.12       # plus wheels for an offline host
    replaykit-workflow pack --verify dist/replaykit-<commit>.tar.gz    # <commit>: the short commit it printed

(``python scripts/pack.py ...`` is the same command, without importing torch.)
Exit code: 0 ok, 1 a bad archive (--verify) or a failed pack.
"""


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The ``pack`` command's options."""
    ap = argparse.ArgumentParser(
        prog=prog, description=PACK_USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rev", help="commit to pack (default: the working tree, dirty included)")
    ap.add_argument("--out", type=Path, default=Path("dist"), help="output folder or .tar.gz")
    ap.add_argument(
        "--repo", type=Path, default=Path("."), help="repository (default: the one here)"
    )
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


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The ``pack`` command: pack, or ``--verify`` an archive."""
    args = build_parser(prog).parse_args(argv)
    if args.verify is not None:
        try:
            manifest = verify_archive(args.verify)
        except ValueError as exc:
            print(f"BAD ARCHIVE: {exc}", file=sys.stderr)
            return 1
        print(f"ok       {args.verify}")
        print("\n".join(_summary(manifest)))
        return 0
    wheelhouse = None
    if args.wheelhouse or args.requirement:
        reqs = args.requirement or list(NOTEBOOK_REQUIREMENTS)
        wheelhouse = Wheelhouse(
            reqs, python=args.python, no_deps=args.no_deps, interpreter=args.interpreter
        )
    try:
        result = pack(args.repo, args.out, rev=args.rev, wheelhouse=wheelhouse)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(result.path)
    print(f"size     {result.size / 1e6:.1f} MB")
    print("\n".join(_summary(result.manifest)))
    if wheelhouse is not None:
        print(f"target   {install_command(result.manifest, target='.pylibs')}")
        print(f"offline  copy {result.path.name} to the host, then, beside it:")
        for line in offline_recipe(result.path, result.manifest):
            print(f"offline  {line}")
    return 0

"""Packing a tree into a verified archive: manifest, round trip, refusals, wheelhouse (mocked)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from replaykit.workflow import archive as pk
from replaykit.workflow.fingerprint import MANIFEST_NAME, tree_info

ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
    "GIT_CONFIG_NOSYSTEM": "1",
}
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pack.py"


def git(repo: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", *args], cwd=repo, env=ENV, check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """Two commits (runs/ tracked in both), ignored junk beside them; clean at HEAD."""
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q")
    write(r / ".gitignore", ".venv/\n*.log\n")
    write(r / "a.py", "x = 1\n")
    write(r / "pkg" / "b.py", "y = 2\n")
    write(r / "run.sh", "#!/bin/sh\necho hi\n")
    (r / "run.sh").chmod(0o755)
    write(r / "runs" / "old" / "summary.json", "{}\n")  # committed evidence: never packed
    git(r, "add", "-A")
    git(r, "commit", "-q", "-m", "one")
    write(r / "a.py", "x = 10\n")
    git(r, "commit", "-q", "-am", "two")
    write(r / ".venv" / "lib" / "site.py", "junk\n")
    write(r / "debug.log", "junk\n")
    write(r / "pkg" / "__pycache__" / "b.cpython-312.pyc", "junk\n")
    write(r / "runs" / "new" / "summary.json", "{}\n")
    return r


def dirty(r: Path) -> None:
    write(r / "a.py", "x = 11\n")
    write(r / "new.py", "z = 3\n")
    (r / "pkg" / "b.py").unlink()


SOURCES = {".gitignore", "a.py", "pkg/b.py", "run.sh"}


def test_clean_working_tree_equals_head(repo: Path, tmp_path: Path) -> None:
    res = pk.pack(repo, tmp_path / "out")
    m = res.manifest
    head = git(repo, "rev-parse", "HEAD")
    assert (m["format"], m["commit"], m["dirty"], m["diff"], m["rev"]) == (1, head, False, "", None)
    assert m["short"] == head[:7] and res.top == f"replaykit-{head[:7]}"
    assert m["tree_hash"] == git(repo, "rev-parse", "HEAD^{tree}")
    assert set(m["files"]) == SOURCES  # no .venv, runs/, *.log, __pycache__
    for rel, digest in m["files"].items():
        assert digest == hashlib.sha256((repo / rel).read_bytes()).hexdigest()
    assert m["sha256"] == pk.tree_sha256(m["files"])
    at_head = pk.pack(repo, tmp_path / "out2", rev="HEAD").manifest
    assert at_head["sha256"] == m["sha256"] and at_head["rev"] == "HEAD"
    assert res.path.name == f"replaykit-{head[:7]}.tar.gz" and res.size == res.path.stat().st_size


def test_dirty_working_tree(repo: Path, tmp_path: Path) -> None:
    clean = pk.pack(repo, tmp_path / "out", rev="HEAD")
    dirty(repo)
    res = pk.pack(repo, tmp_path / "out")
    m = res.manifest
    assert m["dirty"] is True and m["commit"] == git(repo, "rev-parse", "HEAD")
    assert res.top.endswith("-dirty") and res.path.name.startswith(res.top)
    assert set(m["files"]) == SOURCES - {"pkg/b.py"} | {"new.py"}
    assert m["files"]["a.py"] == hashlib.sha256(b"x = 11\n").hexdigest()
    for name in ("a.py", "new.py", "pkg/b.py"):
        assert f"b/{name}" in m["diff"] or f"a/{name}" in m["diff"]
    # the diff applied to the commit gives the dirty tree back
    root = pk.unpack(clean.path, tmp_path / "x")
    (root / MANIFEST_NAME).unlink()
    subprocess.run(["git", "apply"], cwd=root, input=m["diff"], text=True, check=True)
    got = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    assert got == set(m["files"])
    assert all(pk.sha256_bytes((root / p).read_bytes()) == h for p, h in m["files"].items())


def test_old_rev_is_stable_and_leaves_the_checkout_alone(repo: Path, tmp_path: Path) -> None:
    dirty(repo)
    status = git(repo, "status", "--porcelain")
    first = git(repo, "rev-list", "--max-parents=0", "HEAD")
    one = pk.pack(repo, tmp_path / "o1", rev=first).manifest
    two = pk.pack(repo, tmp_path / "o2", rev=first[:9]).manifest
    assert (one["commit"], one["dirty"], one["diff"], one["rev"]) == (first, False, "", first)
    assert one["files"] == two["files"] and one["sha256"] == two["sha256"]
    assert one["files"]["a.py"] == hashlib.sha256(b"x = 1\n").hexdigest()
    assert git(repo, "status", "--porcelain") == status
    assert (repo / "a.py").read_text() == "x = 11\n"
    with pytest.raises(ValueError, match="not a commit"):
        pk.pack(repo, tmp_path / "o3", rev="no-such-rev")


def test_round_trip(repo: Path, tmp_path: Path) -> None:
    dirty(repo)
    res = pk.pack(repo, tmp_path / "out")
    assert pk.verify_archive(res.path) == res.manifest
    root = pk.unpack(res.path, tmp_path / "dest")
    assert root == (tmp_path / "dest" / res.top).resolve()
    assert (root / "a.py").read_text() == "x = 11\n"
    assert os.access(root / "run.sh", os.X_OK) and not os.access(root / "a.py", os.X_OK)
    info = tree_info(root)  # the fingerprint reads commit, dirty, sha256
    assert info["source"] == "manifest" and "error" not in info
    assert (info["commit"], info["dirty"], info["sha256"]) == (
        res.commit,
        True,
        res.manifest["sha256"],
    )
    assert pk.MANIFEST_NAME == MANIFEST_NAME
    with pytest.raises(FileExistsError):
        pk.unpack(res.path, tmp_path / "dest")
    assert pk.unpack(res.path, tmp_path / "dest", replace=True) == root
    assert [p.name for p in (tmp_path / "dest").iterdir()] == [res.top]  # no staging left


def test_output_inside_the_repo_is_not_packed(repo: Path) -> None:
    for out in ("dist", "packs"):
        pk.pack(repo, repo / out)
        again = pk.pack(repo, repo / out).manifest
        assert not any(p.startswith(out + "/") for p in again["files"])


def _refused(archive: Path, dest: Path, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pk.verify_archive(archive)
    with pytest.raises(ValueError, match=match):
        pk.unpack(archive, dest)
    assert not dest.exists() or not any(dest.iterdir())  # nothing extracted


def test_truncated_archive_is_refused(repo: Path, tmp_path: Path) -> None:
    res = pk.pack(repo, tmp_path / "out")
    data = res.path.read_bytes()
    for n, cut in enumerate((len(data) // 2, len(data) - 4)):
        bad = tmp_path / f"cut{n}.tar.gz"
        bad.write_bytes(data[:cut])
        _refused(bad, tmp_path / f"d{n}", "corrupted or truncated")


def test_flipped_byte_is_refused(repo: Path, tmp_path: Path) -> None:
    res = pk.pack(repo, tmp_path / "out")
    # in the compressed stream: gzip CRC/inflate fails
    data = bytearray(res.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad = tmp_path / "flip.tar.gz"
    bad.write_bytes(bytes(data))
    _refused(bad, tmp_path / "d1", "corrupted or truncated")
    # inside a member, recompressed so the gzip stream is sound: the sha256 catches it
    tar = bytearray(gzip.decompress(res.path.read_bytes()))
    at = tar.index(b"x = 10\n")
    tar[at + 4] ^= 0x01
    bad2 = tmp_path / "flip2.tar.gz"
    bad2.write_bytes(gzip.compress(bytes(tar)))
    _refused(bad2, tmp_path / "d2", r"sha256 mismatch: a\.py")


def _handmade(path: Path, members: dict[str, bytes], links: dict[str, str] | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return path


def _manifest_for(files: dict[str, bytes], short: str = "abc1234") -> bytes:
    hashes = {p: pk.sha256_bytes(b) for p, b in files.items()}
    m = {
        "format": 1,
        "commit": None,
        "short": short,
        "dirty": False,
        "files": hashes,
        "sha256": pk.tree_sha256(hashes),
        "wheelhouse": None,
    }
    return json.dumps(m).encode()


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("replaykit-abc1234/../evil", "unsafe member"),
        ("../evil", "unsafe member"),
        ("/tmp/evil", "unsafe member"),
    ],
)
def test_unsafe_member_is_refused(tmp_path: Path, name: str, match: str) -> None:
    files = {"a.py": b"x\n"}
    members = {"replaykit-abc1234/" + MANIFEST_NAME: _manifest_for(files)}
    members |= {f"replaykit-abc1234/{p}": b for p, b in files.items()} | {name: b"evil\n"}
    _refused(_handmade(tmp_path / "evil.tar.gz", members), tmp_path / "d", match)
    assert not (tmp_path / "evil").exists()


def test_links_missing_manifest_and_extra_files_are_refused(tmp_path: Path) -> None:
    files = {"a.py": b"x\n"}
    base = {
        "replaykit-abc1234/" + MANIFEST_NAME: _manifest_for(files),
        "replaykit-abc1234/a.py": b"x\n",
    }
    link = _handmade(tmp_path / "l.tar.gz", base, {"replaykit-abc1234/l": "/etc/passwd"})
    _refused(link, tmp_path / "d1", "is a link")
    nomani = _handmade(tmp_path / "n.tar.gz", {"replaykit-abc1234/a.py": b"x\n"})
    _refused(nomani, tmp_path / "d2", "no replaykit-manifest.json")
    extra = _handmade(tmp_path / "e.tar.gz", base | {"replaykit-abc1234/b.py": b"y\n"})
    _refused(extra, tmp_path / "d3", r"not in the manifest: b\.py")
    assert pk.verify_archive(_handmade(tmp_path / "ok.tar.gz", base))["short"] == "abc1234"


def test_wheelhouse_with_mocked_pip(repo: Path, tmp_path: Path, monkeypatch) -> None:
    calls: list[list[str]] = []

    def fake_pip(cmd: list[str]) -> None:
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / "papermill-2.7.0-py3-none-any.whl").write_bytes(b"fake wheel")
        (dest / "torch-2.9.1-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"huge")
        (dest / "nvidia_cublas_cu12-1-py3-none-manylinux1_x86_64.whl").write_bytes(b"huge")

    monkeypatch.setattr(pk, "_run_pip", fake_pip)
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    wh = pk.Wheelhouse(["papermill>=2.6", "tqdm"], python=py)
    plain = pk.pack(repo, tmp_path / "out").path
    res = pk.pack(repo, tmp_path / "out", wheelhouse=wh)
    assert res.path.name == f"{res.top}-wheelhouse-py{py}.tar.gz" and res.path != plain
    assert (
        pk.verify_archive(plain)["wheelhouse"] is None
    )  # the plain archive of the same tree is kept
    (cmd,) = calls
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" not in cmd
    assert "--only-binary=:all:" in cmd and cmd[cmd.index("--implementation") + 1] == "cp"
    assert cmd[cmd.index("--python-version") + 1] == py and cmd[-2:] == ["papermill>=2.6", "tqdm"]
    assert [cmd[i + 1] for i, c in enumerate(cmd) if c == "--platform"] == list(pk.MANYLINUX_X86_64)
    w = pk.verify_archive(res.path)["wheelhouse"]
    assert w["files"] == {"papermill-2.7.0-py3-none-any.whl": pk.sha256_bytes(b"fake wheel")}
    assert (w["dir"], w["python"], w["requirements"]) == ("wheelhouse", py, wh.requirements)
    root = pk.unpack(res.path, tmp_path / "d")
    assert (root / "wheelhouse" / "papermill-2.7.0-py3-none-any.whl").read_bytes() == b"fake wheel"
    assert "wheelhouse/papermill-2.7.0-py3-none-any.whl" not in res.manifest["files"]
    line = pk.install_command(res.manifest)
    assert line == "python -m pip install --no-index --find-links wheelhouse 'papermill>=2.6' tqdm"
    assert "--target .pylibs" in pk.install_command(res.manifest, target=".pylibs")
    calls.clear()
    pk.build_wheelhouse(pk.Wheelhouse(["x"], python=py, no_deps=True), tmp_path / "w2")
    assert "--no-deps" in calls[0]


def test_wheelhouse_needs_an_interpreter_of_the_target_version(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    monkeypatch.setattr(pk, "_run_pip", lambda cmd: pytest.fail("pip must not run"))
    with pytest.raises(RuntimeError, match=r"no Python 2\.1.*markers"):
        pk.build_wheelhouse(pk.Wheelhouse(["x"], python="2.1"), tmp_path / "w")


def test_cli(repo: Path, tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, str(SCRIPT), *args]
        return subprocess.run(cmd, capture_output=True, text=True, check=False)

    made = cli("--repo", str(repo), "--out", str(tmp_path / "out"), "--rev", "HEAD")
    assert made.returncode == 0, made.stderr
    archive = Path(made.stdout.splitlines()[0])
    assert archive.is_file() and "files    4" in made.stdout and "clean" in made.stdout
    ok = cli("--verify", str(archive))
    assert ok.returncode == 0 and "replaykit-" in ok.stdout
    (tmp_path / "bad.tar.gz").write_bytes(archive.read_bytes()[:100])
    bad = cli("--verify", str(tmp_path / "bad.tar.gz"))
    assert bad.returncode == 1 and "BAD ARCHIVE" in bad.stderr


def test_bootstrap(repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A notebook's bootstrap: a folder as is, an archive verified then unpacked beside it, an edited one refused."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert pk.bootstrap("") is None  # replaykit is importable here: nothing to do
    assert pk.bootstrap(repo) == repo.resolve() and sys.path[0] == str(repo.resolve())
    archive = pk.pack(repo, tmp_path / "tree.tar.gz").path
    root = pk.bootstrap(str(archive))
    assert root == tmp_path / "tree" / pk.top_name(pk.verify_archive(archive)) and sys.path[
        0
    ] == str(root)
    assert (root / "a.py").read_text() == "x = 10\n"
    assert pk.bootstrap(str(archive)) == root  # run again: unpacked again over the first
    edited = tmp_path / "edited.tar.gz"
    with tarfile.open(archive) as src, tarfile.open(edited, "w:gz") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read() if member.isfile() else None
            if data is not None and member.name.endswith("/a.py"):
                data, member.size = b"x = 11\n", 7
            dst.addfile(member, io.BytesIO(data) if data is not None else None)
    with pytest.raises(RuntimeError, match="does not match its manifest"):
        pk.bootstrap(str(edited))
    with pytest.raises(FileNotFoundError):
        pk.bootstrap(str(tmp_path / "nowhere"))


def test_the_offline_recipe_names_the_archive_that_holds_the_wheels(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The recipe untars the archive as copied over (its own name) and installs from a wheelhouse
    that this archive holds; the plain archive has none and says which one does."""

    def fake_pip(cmd: list[str]) -> None:
        (Path(cmd[cmd.index("-d") + 1]) / "tqdm-4.67.0-py3-none-any.whl").write_bytes(b"wheel")

    monkeypatch.setattr(pk, "_run_pip", fake_pip)
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    plain = pk.pack(repo, tmp_path / "out")
    made = pk.pack(repo, tmp_path / "out", wheelhouse=pk.Wheelhouse(["tqdm"], python=py))
    with pytest.raises(ValueError, match=r"no wheelhouse.*wheelhouse-py"):
        pk.offline_recipe(plain.path, plain.manifest)
    assert pk.main(["--verify", str(plain.path)]) == 0
    assert "wheels   none: an offline host needs the archive of `pack --wheelhouse`" in (
        capsys.readouterr().out
    )

    recipe = pk.offline_recipe(made.path, made.manifest)
    assert recipe[0] == f"tar xzf {made.top}-wheelhouse-py{py}.tar.gz"
    host = tmp_path / "host"
    host.mkdir()
    (host / made.path.name).write_bytes(made.path.read_bytes())  # "copy the archive over"
    subprocess.run(["bash", "-c", recipe[0]], cwd=host, check=True)
    links = recipe[2].split("--find-links ", 1)[1].split()[0]
    assert [p.name for p in (host / links).iterdir()] == ["tqdm-4.67.0-py3-none-any.whl"]
    assert recipe[3].startswith(f"cd {made.top} && ")

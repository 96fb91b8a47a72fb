#!/usr/bin/env python3
"""Build llama.cpp's web UI from the pinned, patched source, once per UI source, and place it where
llama.cpp's build embeds it.

llama-server serves the chat UI from assets compiled into it (``scripts/ui-assets.cmake`` embeds a
pre-built ``tools/ui/dist`` when one is present). Upstream downloads that ``dist`` or builds it with
npm; here it is built with ``npm ci`` and ``npm run build`` from ``tools/ui`` of the patched tree (the
UI patch in ``patches/`` included), in the set-up cache, keyed by the content of the UI's sources:

    <cache>/ui/work/            a copy of the sources and its node_modules (kept for the next build)
    <cache>/ui/<key>/dist/      the built UI; a second clone or a re-run copies it (no npm at all)

Without node (20.19 or newer: the UI's vite needs it) or npm, nothing is built and the server answers
``/`` with a short page saying how to get the UI (``csrc/server/server-ridgefill.cpp``); this script then
says so in one line and exits 0, since the UI is optional. ``RIDGEFILL_UI=0`` skips the UI likewise.

Usage: build_ui.py [--tree DIR] [--cache DIR]
Prints ``ui: <dist directory>`` or ``ui: none (<why>)`` on stdout; progress and problems on stderr.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fetch_llama_cpp import REPO, default_cache_dir, sync_tree

NODE_MIN = (20, 19)  # vite 7, the UI's bundler: node ^20.19 || >= 22.12
SKIP_DIRS = {"dist", "node_modules", ".svelte-kit", "build"}
KEEP_BUILDS = 3  # built UIs kept in the cache (about 10 MB each)
HOW_TO_GET = "install node >= 20.19 and npm, then run `make native` again"
TO_GET = "to get llama.cpp's chat page at `/`, "


def ui_sources(ui: Path) -> list[Path]:
    """The UI's source files (relative), without build outputs and installed packages."""
    out = []
    for root, dirs, files in os.walk(ui):
        rel_root = Path(root).relative_to(ui)
        if rel_root == Path("."):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        out.extend(rel_root / f for f in files)
    return sorted(out)


def source_key(ui: Path) -> str:
    """Hash of the UI's source files: names and contents (the pinned tree and the UI patch)."""
    h = hashlib.sha256()
    for rel in ui_sources(ui):
        h.update(str(rel).encode() + b"\0" + (ui / rel).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def node_problem() -> str | None:
    """Why node and npm cannot build the UI here, or None when they can."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        return "node and npm were not found" if not node and not npm else f"{'node' if not node else 'npm'} was not found"
    try:
        out = subprocess.run([node, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"node does not run ({e})"
    m = re.match(r"v(\d+)\.(\d+)", out)
    if not m:
        return f"node reports an unknown version {out!r}"
    version = (int(m[1]), int(m[2]))
    if version < NODE_MIN or (version[0] == 21) or (version[0] == 22 and version[1] < 12):
        return f"node {out} is too old (the UI's vite needs ^20.19 or >= 22.12)"
    return None


def stage(ui: Path, work: Path) -> None:
    """Make work a copy of the UI sources, keeping its node_modules."""
    work.mkdir(parents=True, exist_ok=True)
    for entry in work.iterdir():
        if entry.name == "node_modules":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    for rel in ui_sources(ui):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ui / rel, work / rel)


def run_logged(cmd: list[str], cwd: Path, log: Path, env: dict | None = None) -> None:
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, check=False, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        print("\n".join(f"  {line}" for line in tail), file=sys.stderr)
        raise RuntimeError(f"`{' '.join(cmd)}` failed with exit status {proc.returncode} (log: {log})")


def build(ui: Path, cache: Path, key: str) -> Path:
    """npm ci (when the lock file changed) and npm run build into <cache>/ui/<key>/dist."""
    work = cache / "work"
    log = cache / "build.log"
    log.write_text("")
    t0 = time.monotonic()
    print("ui: building llama.cpp's web UI from the pinned source (npm ci, npm run build: about 2 min, "
          "once per UI source; log: " + str(log) + ")", file=sys.stderr, flush=True)
    stage(ui, work)
    lock_hash = hashlib.sha256((work / "package-lock.json").read_bytes()).hexdigest()
    marker = work / "node_modules" / ".ridgefill-lock.sha256"
    if not marker.is_file() or marker.read_text().strip() != lock_hash:
        run_logged(["npm", "ci", "--no-audit", "--no-fund"], work, log)
        marker.write_text(lock_hash + "\n")
    tmp = cache / f".{key}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    env = dict(os.environ, LLAMA_UI_OUT_DIR=str(tmp / "dist"), LLAMA_BUILD_NUMBER="0")
    final = cache / key
    try:
        run_logged(["npm", "run", "build"], work, log, env)
        if not (tmp / "dist" / "index.html").is_file():
            raise RuntimeError(f"npm run build left no index.html (log: {log})")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # a finished build appears whole, or not at all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"ui: built in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return final / "dist"


def prune(cache: Path, keep: str) -> None:
    builds = [p for p in cache.iterdir() if p.is_dir() and re.fullmatch(r"[0-9a-f]{16}", p.name)]
    builds.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for p in builds[KEEP_BUILDS:]:
        if p.name != keep:
            shutil.rmtree(p, ignore_errors=True)


def provide(tree: Path, cache_root: Path) -> tuple[Path | None, str]:
    """The UI's dist placed in tree/tools/ui/dist, or None and why not (with what to do about it)."""
    ui = tree / "tools" / "ui"
    target = ui / "dist"
    if not (ui / "package.json").is_file():
        return None, f"{ui} has no package.json"
    if os.environ.get("RIDGEFILL_UI", "1") == "0":
        shutil.rmtree(target, ignore_errors=True)
        return None, "RIDGEFILL_UI=0; " + TO_GET + "unset RIDGEFILL_UI"
    cache = cache_root / "ui"
    cache.mkdir(parents=True, exist_ok=True)
    key = source_key(ui)
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time, whichever clone asks
        dist = cache / key / "dist"
        if not (dist / "index.html").is_file():
            why = node_problem()
            if why:
                shutil.rmtree(target, ignore_errors=True)  # never embed a UI built from other sources
                return None, f"{why}; {TO_GET}{HOW_TO_GET}"
            try:
                dist = build(ui, cache, key)
            except (OSError, RuntimeError) as e:
                shutil.rmtree(target, ignore_errors=True)
                return None, f"building it failed: {e}; fix that, then run `make native` again"
        os.utime(cache / key)  # most recently used: kept by prune
        sync_tree(dist, target)
        prune(cache, key)
    return target, ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, default=REPO / ".cache" / "llama.cpp", help="the patched llama.cpp tree")
    ap.add_argument("--cache", type=Path, default=None, help="set-up cache (default: ~/.cache/ridgefill-cpp)")
    args = ap.parse_args(argv)
    dist, why = provide(args.tree.resolve(), (args.cache or default_cache_dir()).resolve())
    if dist is None:
        print(f"ui: none ({why})")
        print(f"ridgefill: llama-server gets no web UI: {why}", file=sys.stderr)
        return 0
    print(f"ui: {dist}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

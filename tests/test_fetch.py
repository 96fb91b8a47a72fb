"""tools/fetch_llama_cpp.py: checksum verification, patch application, incremental sync."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import fetch_llama_cpp as F

REPO = Path(__file__).resolve().parent.parent


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_patch_that_does_not_apply_is_named(tmp_path):
    tree = _tree(tmp_path / "tree", {"src/a.txt": "one\ntwo\nthree\n"})
    good = tmp_path / "0001-good.patch"
    good.write_text("--- a/src/a.txt\n+++ b/src/a.txt\n@@ -1,3 +1,3 @@\n one\n-two\n+TWO\n three\n")
    bad = tmp_path / "0002-bad.patch"
    bad.write_text("--- a/src/a.txt\n+++ b/src/a.txt\n@@ -1,3 +1,3 @@\n one\n-zwei\n+ZWEI\n three\n")
    F.apply_patches(tree, [good])
    assert (tree / "src/a.txt").read_text() == "one\nTWO\nthree\n"
    with pytest.raises(F.FetchError, match="0002-bad.patch does not apply"):
        F.apply_patches(tree, [bad])
    assert (tree / "src/a.txt").read_text() == "one\nTWO\nthree\n"  # a failed patch changes nothing


def test_project_patches_apply_to_the_pinned_tree():
    # the prepared tree exists (the build used it) and carries the current patch set
    stamp = json.loads((REPO / ".cache/llama.cpp" / F.STAMP).read_text())
    assert stamp["patchset"] == F.patchset_hash(F.patch_files())
    assert stamp["patches"] == [p.name for p in F.patch_files()]
    assert "res->t_layer_inp[il] = inpL;" in (REPO / ".cache/llama.cpp/src/models/gemma3.cpp").read_text()


def test_sync_tree_rewrites_only_changed_files(tmp_path):
    src = _tree(tmp_path / "src", {"a": "1", "d/b": "2", "d/c": "3"})
    dst = tmp_path / "dst"
    assert F.sync_tree(src, dst) == 3
    old = os.stat(dst / "a").st_mtime_ns
    os.utime(dst / "a", ns=(old - 10**9, old - 10**9))
    (src / "d/b").write_text("changed")
    (src / "d/c").unlink()
    assert F.sync_tree(src, dst) == 1
    assert os.stat(dst / "a").st_mtime_ns == old - 10**9  # untouched
    assert (dst / "d/b").read_text() == "changed"
    assert not (dst / "d/c").exists()


def test_checksum_mismatch_is_refused(tmp_path, monkeypatch):
    pin = {"package": "llama-cpp-python", "version": "0.3.36", "sdist": "llama_cpp_python-0.3.36.tar.gz",
           "sha256": "0" * 64}
    fake_pip = tmp_path / "fake-pip"
    # a "pip" that downloads a file with the wrong content
    fake_pip.write_text(
        "#!/bin/sh\nwhile [ $# -gt 0 ]; do [ \"$1\" = -d ] && d=$2; shift; done\n"
        "echo tampered > \"$d/llama_cpp_python-0.3.36.tar.gz\"\n"
    )
    fake_pip.chmod(0o755)
    monkeypatch.setattr(F, "_pip_command", lambda: [str(fake_pip)])
    with pytest.raises(F.FetchError, match="sha256 mismatch"):
        F.fetch_sdist(pin, tmp_path / "cache")
    assert not (tmp_path / "cache/dl" / pin["sdist"]).exists()  # nothing unverified is kept


def test_cached_corrupt_download_is_replaced(tmp_path, monkeypatch):
    content = b"a good sdist"
    import hashlib

    pin = {"package": "llama-cpp-python", "version": "0.3.36", "sdist": "x.tar.gz",
           "sha256": hashlib.sha256(content).hexdigest()}
    dl = tmp_path / "cache/dl"
    dl.mkdir(parents=True)
    (dl / "x.tar.gz").write_bytes(b"partial")
    script = tmp_path / "fake-pip"
    script.write_text(f"#!{sys.executable}\nimport sys\nd = sys.argv[sys.argv.index('-d') + 1]\n"
                      f"open(d + '/x.tar.gz', 'wb').write({content!r})\n")
    script.chmod(0o755)
    monkeypatch.setattr(F, "_pip_command", lambda: [str(script)])
    got = F.fetch_sdist(pin, tmp_path / "cache")
    assert got.read_bytes() == content

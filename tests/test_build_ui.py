"""tools/build_ui.py: llama.cpp's web UI is built once per UI source and cached, a second clone copies
it without running npm, a changed source or lock file builds again (npm ci only for the lock file),
and without node/npm - or with a node too old, or a failing build - set-up goes on without the UI,
says so in one line, and never leaves a UI built from other sources in the tree.

node and npm are stand-ins here (shell scripts on PATH that log their calls and write a dist/), so
these tests take milliseconds; test_web_ui.py checks the real build in a browser.
"""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import pytest

import build_ui

NODE = """#!/bin/sh
echo "${FAKE_NODE_VERSION:-v20.20.2}"
"""
NPM = """#!/bin/sh
echo "$*" >> "$FAKE_NPM_LOG"
case "$1" in
  ci) rm -rf node_modules && mkdir node_modules ;;
  run) [ -n "$FAKE_NPM_FAIL" ] && { echo "vite: error" >&2; exit 1; }
       mkdir -p "$LLAMA_UI_OUT_DIR" && cat src/app.txt > "$LLAMA_UI_OUT_DIR/index.html" ;;
esac
"""


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A patched tree with a two-file UI, a cache, and stand-in node/npm first on PATH."""
    tree = tmp_path / "clone1" / "llama.cpp"
    ui = tree / "tools" / "ui"
    (ui / "src").mkdir(parents=True)
    (ui / "package.json").write_text('{"name": "llama-ui"}\n')
    (ui / "package-lock.json").write_text('{"lockfileVersion": 3}\n')
    (ui / "src" / "app.txt").write_text("<html>one</html>\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir / "node", NODE)
    _script(bin_dir / "npm", NPM)
    log = tmp_path / "npm.log"
    log.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_NPM_LOG", str(log))
    monkeypatch.delenv("RIDGEFILL_UI", raising=False)
    return dict(tree=tree, ui=ui, cache=tmp_path / "cache", log=log, bin=bin_dir)


def _calls(env) -> list[str]:
    return env["log"].read_text().splitlines()


def test_built_once_then_copied_to_a_second_clone(env, tmp_path):
    dist, why = build_ui.provide(env["tree"], env["cache"])
    assert why == "" and dist == env["ui"] / "dist"
    assert (dist / "index.html").read_text() == "<html>one</html>\n"
    assert _calls(env) == ["ci --no-audit --no-fund", "run build"]
    # a second clone (a fresh tree from the same sources) and a re-run: no npm at all
    tree2 = tmp_path / "clone2" / "llama.cpp"
    shutil.copytree(env["tree"], tree2, ignore=shutil.ignore_patterns("dist"))
    dist2, _ = build_ui.provide(tree2, env["cache"])
    build_ui.provide(env["tree"], env["cache"])
    assert (dist2 / "index.html").read_text() == "<html>one</html>\n"
    assert len(_calls(env)) == 2


def test_a_changed_source_builds_again_and_a_changed_lock_file_installs_again(env):
    build_ui.provide(env["tree"], env["cache"])
    (env["ui"] / "src" / "app.txt").write_text("<html>two</html>\n")  # e.g. the UI patch changed
    dist, _ = build_ui.provide(env["tree"], env["cache"])
    assert (dist / "index.html").read_text() == "<html>two</html>\n"
    assert _calls(env)[2:] == ["run build"]  # node_modules kept
    (env["ui"] / "package-lock.json").write_text('{"lockfileVersion": 3, "x": 1}\n')
    build_ui.provide(env["tree"], env["cache"])
    assert _calls(env)[3:] == ["ci --no-audit --no-fund", "run build"]


@pytest.mark.parametrize("case", ["no node", "no npm", "old node", "node 21", "build fails", "RIDGEFILL_UI=0"])
def test_without_a_working_node_setup_goes_on_without_the_ui(env, monkeypatch, capsys, case):
    build_ui.provide(env["tree"], env["cache"])  # a UI from the current sources is in the tree
    (env["ui"] / "src" / "app.txt").write_text("<html>two</html>\n")  # new sources, not built yet
    if case == "no node":
        (env["bin"] / "node").unlink()
        monkeypatch.setenv("PATH", str(env["bin"]))
    elif case == "no npm":
        (env["bin"] / "npm").unlink()
        monkeypatch.setenv("PATH", str(env["bin"]))
    elif case == "old node":
        monkeypatch.setenv("FAKE_NODE_VERSION", "v18.19.1")
    elif case == "node 21":
        monkeypatch.setenv("FAKE_NODE_VERSION", "v21.7.3")
    elif case == "build fails":
        monkeypatch.setenv("FAKE_NPM_FAIL", "1")
    else:
        monkeypatch.setenv("RIDGEFILL_UI", "0")
    capsys.readouterr()
    assert build_ui.main(["--tree", str(env["tree"]), "--cache", str(env["cache"])]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ui: none (")
    expect = {"no node": "node was not found", "no npm": "npm was not found", "old node": "too old",
              "node 21": "too old", "build fails": "`npm run build` failed", "RIDGEFILL_UI=0": "RIDGEFILL_UI=0"}[case]
    assert expect in out
    line = [x for x in err.splitlines() if x.startswith("ridgefill:")]
    assert len(line) == 1 and "llama-server gets no web UI" in line[0]
    assert ("unset RIDGEFILL_UI" if case == "RIDGEFILL_UI=0" else "make native") in line[0]
    if case == "build fails":
        assert "exit status 1" in line[0] and "vite: error" in err  # the end of npm's log is shown
    if case != "build fails":  # a failed build also shows the end of its log
        assert len(err.splitlines()) == 1
    # the UI of the old sources is not embedded for the new ones
    assert not (env["ui"] / "dist").exists()
    # nothing half-built is left in the cache as a finished build
    key = build_ui.source_key(env["ui"])
    assert not (env["cache"] / "ui" / key).exists()


def test_a_tree_without_a_ui_is_not_an_error(env, capsys):
    shutil.rmtree(env["ui"])
    assert build_ui.main(["--tree", str(env["tree"]), "--cache", str(env["cache"])]) == 0
    assert "has no package.json" in capsys.readouterr().out


def test_the_source_key_ignores_build_outputs(env):
    key = build_ui.source_key(env["ui"])
    for d in ("dist", "node_modules", ".svelte-kit"):
        (env["ui"] / d).mkdir(exist_ok=True)
        (env["ui"] / d / "f.js").write_text("x")
    assert build_ui.source_key(env["ui"]) == key
    (env["ui"] / "src" / "more.txt").write_text("y")
    assert build_ui.source_key(env["ui"]) != key


def test_the_page_of_a_server_built_without_the_ui_says_how_to_get_it():
    """The page llama-server answers at "/" without a UI (csrc/server/server-ridgefill.cpp, served by patch
    0010's hook in server-http.cpp; built into every server, used only without the UI) says what is
    missing and the command this script's message names, and the browser test recognises it."""
    import ctypes
    import http.server
    import threading

    import ridgefill_cpp  # noqa: F401  (loads the patched libraries the server library needs)
    from web_ui import NO_UI_MARKER, page_kind

    lib = ctypes.CDLL(str(Path(ridgefill_cpp.__file__).parent / "lib" / "libllama-server-impl.so"))
    fn = lib._Z27server_ridgefill_no_ui_pagev  # const char * server_ridgefill_no_ui_page()
    fn.restype = ctypes.c_char_p
    page = fn().decode()
    assert page.startswith("<!doctype html>") and NO_UI_MARKER in page
    assert "node (20.19 or newer)" in page and "npm" in page and "make native" in page
    assert build_ui.NODE_MIN == (20, 19) and "make native" in build_ui.HOW_TO_GET

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = page.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert page_kind(f"http://127.0.0.1:{srv.server_address[1]}") == "no-ui"
    finally:
        srv.shutdown()

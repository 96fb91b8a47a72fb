"""RidgeFill over llama.cpp's RPC backend: the tiny model of every supported architecture split
between this process's CPU and two ``ggml-rpc-server`` workers on loopback (the stock worker of the
same llama.cpp commit, installed with the package) gives what the same plan gives locally, stock
likewise; a worker that dies mid-plan gives a clear error, and the process and context stay up.

Every worker binds 127.0.0.1 on a free port and is stopped by its fixture; startup, connection and
every wait are bounded in time.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest
from prefill_helpers import ctx_kwargs
from test_mapfile import _maps

import ridgefill_cpp
import llama_cpp  # noqa: E402  (after ridgefill_cpp: the patched libraries)
from ridgefill_cpp import Llama, RidgeFill
from ridgefill_cpp.maps.fingerprint import model_fingerprint
from ridgefill_cpp.core.gguf_model import read_model_info
from ridgefill_cpp.maps.mapfile import write_map_file
from ridgefill_cpp.testing import tiny_models as mtm
from ridgefill_cpp.runtime.rpc import RpcServerLost, Worker, default_params_edited, server_list, worker_binary

ARCHS = mtm.ARCHS  # every supported architecture
N_PROMPT = 300
KW = ctx_kwargs(n_ctx=512, n_batch=128, n_ubatch=64)


@pytest.fixture(scope="module")
def workers():
    with Worker(threads=1) as a, Worker(threads=1) as b:
        yield a, b


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return [int(t) for t in np.random.default_rng(0).integers(10, 250, size=N_PROMPT)]


def _remote(path, workers, **kw) -> Llama:
    """The model with its first two layers here, the rest (and the output layer) on the two workers."""
    n_layer = read_model_info(path).n_layer
    return Llama(str(path), rpc_servers=[w.endpoint for w in workers], n_gpu_layers=n_layer - 1,
                 tensor_split=[1, 1], **KW, **kw)


def _outputs(llm: Llama, tokens, info) -> dict[str, np.ndarray]:
    """The last 8 rows' logits, K/V of the last attention layer (every row) and, on hybrids, the
    recurrent state of the last recurrent layer."""
    out = {"logits": llm.prefill(tokens, n_logits=8)}
    last_attn = max(il for il in range(info.n_layer) if il not in info.recurrent_layers)
    out["k"], out["v"] = llm.read_kv(last_attn, list(range(len(tokens))))
    if info.recurrent_layers:
        out["state"] = llm.read_state(max(info.recurrent_layers))
    return out


def test_build_has_rpc_backend_and_worker():
    assert "RPC" in ridgefill_cpp.build_info()["backends"]
    assert worker_binary().is_file()


@pytest.mark.parametrize("arch", ARCHS)
def test_split_over_workers_matches_local(arch, tiny_models, workers, tokens):
    path = tiny_models[arch]
    info = read_model_info(path)
    split = info.default_split
    for rf in (None, RidgeFill.identity(split, tail=16, min_prompt=64)):
        local = Llama(str(path), ridgefill=rf, **KW)
        try:
            want, want_stats = _outputs(local, tokens, info), local.ridgefill_stats
        finally:
            local.close()
        remote = _remote(path, workers, ridgefill=rf)
        try:
            devices = remote.layer_devices()
            got, got_stats = _outputs(remote, tokens, info), remote.ridgefill_stats
        finally:
            remote.close()
        # layers 0-1 here, the late layers on both workers
        assert all(d.startswith("CPU") for d in devices[:2]), devices
        assert {d.split(" ")[1] for d in devices[2:]} == {f"({w.endpoint})" for w in workers}, devices
        if rf is not None:
            assert got_stats["exact_positions"] == want_stats["exact_positions"] and got_stats["n_filled"] > 0
        for key in want:
            assert np.isfinite(want[key]).all()
            scale = max(float(np.abs(want[key]).max()), 1e-6)
            err = float(np.abs(got[key] - want[key]).max()) / scale
            assert err <= 1e-5, f"{arch} {'stock' if rf is None else 'ridgefill'} {key}: relative error {err:.2e}"


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
@pytest.mark.parametrize("placement", ["resident", "host"])
def test_maps_on_workers_or_host(arch, placement, tiny_models, workers, tokens, tmp_path):
    path = tiny_models[arch]
    info = read_model_info(path)
    split = info.default_split
    m = _maps(n_embd=info.n_embd, split=split, n_layer=info.n_layer, arch=info.architecture,
              fingerprint=model_fingerprint(path))
    for a in m.a.values():
        a *= 0.05  # keeps the filled rows' activations in range
    maps = write_map_file(tmp_path / f"{arch}.ridgefill.gguf", m, dtype="f16")
    rf = RidgeFill(maps, tail=16, min_prompt=64, placement=placement)
    local = Llama(str(path), ridgefill=rf, **KW)
    try:
        want = _outputs(local, tokens, info)
    finally:
        local.close()
    remote = _remote(path, workers, ridgefill=rf)
    try:
        got = _outputs(remote, tokens, info)
        buffers = remote.ridgefill_memory()["maps_buffers"]
    finally:
        remote.close()
    # resident: with their layers on the workers; host: in this machine's memory
    assert any(b.startswith("RPC") for b in buffers) == (placement == "resident"), buffers
    for key in want:
        scale = max(float(np.abs(want[key]).max()), 1e-6)
        assert float(np.abs(got[key] - want[key]).max()) / scale <= 1e-5, key


def test_bad_server_lists_are_refused_before_loading(tiny_models):
    with pytest.raises(ValueError, match="is not host:port"):
        server_list("127.0.0.1")
    with pytest.raises(ValueError, match="is not host:port"):
        Llama(str(tiny_models["llama"]), rpc_servers="127.0.0.1:notaport", **KW)
    # nothing listens there (a port just freed): a clear error, not an abort
    with Worker(threads=1) as w:
        endpoint = w.endpoint
    with pytest.raises(ValueError, match=f"RPC server {endpoint} does not answer"):
        Llama(str(tiny_models["llama"]), rpc_servers=endpoint, **KW)


_ggml_base = ctypes.CDLL(str(ridgefill_cpp.LIB_DIR / "libggml-base.so"))
_ggml_base.ggml_get_name.argtypes = [ctypes.c_void_p]
_ggml_base.ggml_get_name.restype = ctypes.c_char_p


class _KillAt:
    """A scheduler eval callback (``llama_context_params.cb_eval``) that, once armed, kills a worker
    when the scheduler reaches the first node named ``node``: a deterministic point inside a plan.
    The callback asks for no node's data, so the graphs run as they would without it."""

    def __init__(self, worker: Worker, node: str):
        self.worker, self.node, self.armed, self.hit = worker, node.encode(), False, False
        self.cb = llama_cpp.ggml_backend_sched_eval_callback(self._cb)

    def _cb(self, t, ask, _ud):
        if ask and self.armed and not self.hit and _ggml_base.ggml_get_name(t) == self.node:
            self.hit = True
            self.worker.kill()
        return False

    def installed(self):
        """Contexts created inside get the callback (llama-cpp-python's Llama has no argument for it)."""
        return default_params_edited("llama_context_default_params", lambda params: setattr(params, "cb_eval", self.cb))


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
@pytest.mark.parametrize("phase", ["early", "late"])
def test_worker_dying_mid_plan(arch, phase, tiny_models, tokens):
    path = tiny_models[arch]
    info = read_model_info(path)
    split, last = info.default_split, info.n_layer - 1
    rf = RidgeFill.identity(split, tail=16, min_prompt=64)
    with Worker(threads=1) as first, Worker(threads=1) as second:
        # early: in the plan's second decode call, at the first worker's first layer (below the
        # split); late: at the last layer (second worker), which only the late phase computes for the
        # prompt's rows
        dying = first if phase == "early" else second
        kill = _KillAt(dying, "")
        with kill.installed():
            llm = _remote(path, (first, second), ridgefill=rf)
        try:
            devices = llm.layer_devices()
            il = next(i for i, d in enumerate(devices) if dying.endpoint in d) if phase == "early" else last
            assert dying.endpoint in devices[il] and (il < split) == (phase == "early"), devices
            kill.node = f"attn_norm-{il}".encode()
            llm.prefill(tokens[:100])
            n0 = llm.n_tokens
            calls = []
            decode = llm._ctx.decode

            def counted(batch):
                calls.append(len(calls))
                kill.armed = phase == "late" or len(calls) == 2
                return decode(batch)

            llm._ctx.decode = counted
            with pytest.raises(RpcServerLost, match=f"RPC server {dying.endpoint} stopped responding"):
                llm.prefill(tokens[100:])
            assert kill.hit and (phase == "late" or len(calls) == 2), calls
            # the rows of the failed prompt are gone, the earlier ones kept (on a hybrid, whose
            # recurrent state cannot be rolled back, none); the context answers
            if info.recurrent_layers:
                n0 = 0
            assert llm.n_tokens == n0
            assert llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(llm._ctx.ctx), 0) == n0 - 1
            assert llm.tokenize(b"still here")
            # every later decode fails the same way, without hanging or aborting
            for more in (tokens[100:110], tokens[100:101]):
                with pytest.raises(RpcServerLost):
                    llm.eval(more)
                assert llm.n_tokens == n0
        finally:
            llm.close()
        # the worker back on its port: the model loaded again works
        dying._want_port = dying.port
        dying.start()
        llm = _remote(path, (first, second), ridgefill=rf)
        try:
            assert np.isfinite(llm.prefill(tokens)).all()
        finally:
            llm.close()


def test_worker_lost_in_the_last_graph_of_a_stock_call(tiny_models, tokens):
    """A worker killed while the last layer of a one-row decode (a generated token) runs fails that
    llama_decode call itself (-3), not only the next one: with RidgeFill attached the call waits for
    its graphs when the model has RPC devices."""
    path = tiny_models["llama"]
    info = read_model_info(path)
    with Worker(threads=1) as first, Worker(threads=1) as second:
        kill = _KillAt(second, f"attn_norm-{info.n_layer - 1}")
        with kill.installed():
            llm = _remote(path, (first, second), ridgefill=RidgeFill.identity(info.default_split, tail=16))
        try:
            llm.eval(tokens[:20])  # shorter than min_prompt: stock
            kill.armed = True
            llm._batch.set_batch(batch=tokens[20:21], n_past=llm.n_tokens, logits_all=False)
            with pytest.raises(RuntimeError, match="llama_decode returned -3"):
                llm._ctx.decode(llm._batch)
            assert kill.hit
        finally:
            llm.close()


def test_two_models_on_the_same_workers(tiny_models, workers, tokens):
    """Two models of one process on the same workers (they share each worker's one connection), used
    in turn: each gives what it gives alone."""
    path = tiny_models["llama"]
    split = read_model_info(path).default_split
    a = _remote(path, workers, ridgefill=RidgeFill.identity(split, tail=16, min_prompt=64))
    b = _remote(path, workers)
    try:
        alone_a, alone_b = a.prefill(tokens), b.prefill(tokens)
        for _ in range(2):
            a.reset()
            b.reset()
            np.testing.assert_array_equal(a.prefill(tokens), alone_a)
            np.testing.assert_array_equal(b.prefill(tokens), alone_b)
    finally:
        a.close()
        b.close()


def _server_args(workers, n_layer: int) -> list[str]:
    from test_serve_ridgefill import TINY_ARGS

    args = list(TINY_ARGS)
    args[args.index("-ngl") + 1] = str(n_layer - 1)
    return args + ["--rpc", ",".join(w.endpoint for w in workers), "-ts", "1,1"]


def test_server_over_workers_matches_library(tiny_models, workers, tmp_path):
    """``serve MODEL -- --rpc A,B``: the patched llama-server with the late layers on the workers
    serves what the library gives locally, RidgeFill and ``"ridgefill": false`` alike."""
    from test_serve_ridgefill import TINY_RF, _assert_same, _complete, _library, _prompt

    from ridgefill_cpp.server.serve import Server

    model = tiny_models["llama"]
    prompt = _prompt(model, 300)
    rf = RidgeFill.identity(**TINY_RF)
    args = _server_args(workers, read_model_info(model).n_layer)
    before = [len(w.log()) for w in workers]
    with Server(model, rf, extra_args=args, log_path=tmp_path / "s.log", startup_timeout=60) as srv:
        # the server holds a connection to each worker
        assert all("Accepted client connection" in w.log()[n:] for w, n in zip(workers, before))
        res = _complete(srv, prompt)
        assert res["ridgefill"]["n_filled"] > 0, res.get("ridgefill")
        _assert_same(res, _library(model, prompt, rf))
        _assert_same(_complete(srv, prompt, ridgefill=False), _library(model, prompt, None))


def test_server_survives_a_lost_worker(tiny_models, tmp_path):
    """A worker killed under a running server: requests get an error, never a hang or a crash, and the
    server stays up (``/health``)."""
    from test_serve_ridgefill import TINY_RF, _get, _post, _prompt

    from ridgefill_cpp.server.serve import Server

    model = tiny_models["llama"]
    prompt = _prompt(model, 300)
    with Worker(threads=1) as a, Worker(threads=1) as b:
        args = _server_args((a, b), read_model_info(model).n_layer)
        with Server(model, RidgeFill.identity(**TINY_RF), extra_args=args, log_path=tmp_path / "s.log",
                    startup_timeout=60) as srv:
            body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "cache_prompt": False}
            assert _post(srv.url + "/completion", body)[0] == 200
            b.kill()
            for ridgefill in (True, False):
                status, res = _post(srv.url + "/completion", {**body, "ridgefill": ridgefill}, timeout=60)
                assert status >= 500 and "error" in res, (status, res)
                assert _get(srv.url + "/health")[0] == 200
            assert srv.process.poll() is None
        log = (tmp_path / "s.log").read_text(errors="replace")
        assert f"RPC server {b.endpoint}" in log and "stopped responding" in log, log[-3000:]


def test_cli_rpc_server_is_a_worker(tiny_models, tokens, tmp_path):
    """``ridgefill-gguf rpc-server`` runs the packaged worker in the foreground (exec): a host uses it."""
    import shutil
    import signal
    import socket
    import subprocess
    import time

    from ridgefill_cpp.core.processes import free_port

    exe = shutil.which("ridgefill-gguf", path=str(Path(sys.executable).parent))
    port = free_port("127.0.0.1")
    proc = subprocess.Popen([exe, "rpc-server", "--port", str(port), "--threads", "1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.returncode
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the worker did not listen in 30 s"
                time.sleep(0.05)
        path = tiny_models["llama"]
        llm = Llama(str(path), rpc_servers=f"127.0.0.1:{port}", **KW)  # every layer there by default
        try:
            assert all(d.startswith("RPC") for d in llm.layer_devices())
            assert np.isfinite(llm.prefill(tokens)).all()
        finally:
            llm.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_fill_sends_x_s_once_per_device(tiny_models, tokens, tmp_path):
    """Late layers on a second worker read x_S from a copy there, written with the early phase: the rows
    cross once a plan (not once a late layer, and never the whole n_ctx-row buffer). Bytes the worker
    holding the split layer sends back per prefill, counted by a proxy: RidgeFill's exceed stock's by
    about one N x n_embd float copy."""
    from rpc_cpu import CountingProxy

    path = tiny_models["llama"]
    info = read_model_info(path)
    long = tokens * 7  # 2100 rows in a 4096-row context
    row_bytes = len(long) * info.n_embd * 4
    with Worker(threads=1) as a, Worker(threads=1) as b:
        proxies = [CountingProxy(("127.0.0.1", w.port)) for w in (a, b)]
        try:
            # split 3: layers 0-3 on the first worker, the late layers 4-5 on the second
            llm = Llama(str(path), rpc_servers=[p.endpoint for p in proxies], n_gpu_layers=info.n_layer + 1,
                        tensor_split=[1, 1], ridgefill=RidgeFill.identity(3, tail=16, min_prompt=64),
                        **{**KW, "n_ctx": 4096, "n_batch": 2048, "n_ubatch": 512})
            try:
                devices = llm.layer_devices()
                assert proxies[0].endpoint in devices[3] and all(proxies[1].endpoint in d for d in devices[4:]), devices
                down = {}
                for variant in ("stock", "ridgefill", "stock", "ridgefill"):
                    llm.set_ridgefill(None if variant == "stock" else RidgeFill.identity(3, tail=16, min_prompt=64))
                    llm.reset()
                    for p in proxies:
                        p.take()
                    llm.eval(long)
                    down[variant] = proxies[0].take()[1]
            finally:
                llm.close()
        finally:
            for p in proxies:
                p.close()
    assert down["stock"] >= row_bytes  # stock sends the hidden states of layer 4 across once
    assert down["ridgefill"] <= down["stock"] + 1.5 * row_bytes, (down, row_bytes)

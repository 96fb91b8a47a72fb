"""Stock vs RidgeFill prefill with a model split over two ``ggml-rpc-server`` workers on loopback:
time to first token side by side, and the bytes that cross each RPC link per prefill (counted by a
TCP proxy between the host and each worker), issue #19.

Each worker gets a contiguous share of the model's layers (``--tensor-split``, 1:1 by default;
every layer and the output layer offloaded), so the host only embeds the tokens and samples; stock and RidgeFill run
alternately on the same context (``set_ridgefill``), after a warm-up. Optionally the same model
runs on this machine alone (``--local``) for the ratio without RPC.

    python tools/measure/rpc_cpu.py MODEL --maps MAPS [--lengths 2048,8192] [--reps 2] [--worker-threads 1]
        [--tensor-split 1,1] [--local] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import socket
import statistics
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


#: ggml-rpc's commands (enum rpc_cmd of ggml-rpc.cpp) and the layout of its serialised tensor
RPC_COMMANDS = ("ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "FREE_BUFFER", "BUFFER_CLEAR",
                "SET_TENSOR", "SET_TENSOR_HASH", "GET_TENSOR", "COPY_TENSOR", "GRAPH_COMPUTE", "GET_DEVICE_MEMORY",
                "INIT_TENSOR", "GET_ALLOC_SIZE", "HELLO", "DEVICE_COUNT", "GRAPH_RECOMPUTE", "MEMSET_TENSOR")
RPC_TENSOR_SIZE, RPC_TENSOR_NAME = 296, slice(228, 292)


class CommandTally:
    """Parses the host -> worker byte stream of ggml-rpc (| cmd: 1 byte | size: 8 bytes | data |)
    and adds up its bytes by command, and those of SET_TENSOR by the tensor's name (layer numbers
    dropped: ``kq_mask``, ``ridgefill_f_rows`` ...)."""

    def __init__(self):
        self.by_cmd: dict[str, int] = {}
        self.set_by_name: dict[str, int] = {}
        self._buf = bytearray()
        self._need = 9  # bytes of the next header
        self._cmd: int | None = None

    def feed(self, data) -> None:
        self._buf += data
        while len(self._buf) >= self._need:
            if self._cmd is None:
                self._cmd = self._buf[0]
                size = int.from_bytes(self._buf[1:9], "little")
                del self._buf[:9]
                self._need = size
                name = RPC_COMMANDS[self._cmd] if self._cmd < len(RPC_COMMANDS) else str(self._cmd)
                self.by_cmd[name] = self.by_cmd.get(name, 0) + 9 + size
                self._size = size
                continue
            body = bytes(self._buf[:self._need])
            del self._buf[:self._need]
            if RPC_COMMANDS[self._cmd] == "SET_TENSOR" and len(body) >= RPC_TENSOR_SIZE:
                raw = body[RPC_TENSOR_NAME].split(b"\0", 1)[0].decode(errors="replace")
                key = re.sub(r"-\d+$", "", raw) or "(unnamed)"
                self.set_by_name[key] = self.set_by_name.get(key, 0) + len(body)
            self._cmd, self._need = None, 9

    def take(self) -> dict:
        out = {"by_command": dict(sorted(self.by_cmd.items(), key=lambda kv: -kv[1])),
               "set_tensor_by_name": dict(sorted(self.set_by_name.items(), key=lambda kv: -kv[1]))}
        self.by_cmd, self.set_by_name = {}, {}
        return out


class CountingProxy:
    """A loopback TCP proxy to ``target`` (host, port) that counts the bytes of each direction (and,
    with ``tally``, what the host's go to: :class:`CommandTally`)."""

    def __init__(self, target: tuple[str, int], tally: bool = False):
        self.target = target
        self.up = self.down = 0  # host -> worker, worker -> host
        self.tally = CommandTally() if tally else None
        self._lock = threading.Lock()
        self._listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listen.bind(("127.0.0.1", 0))
        self._listen.listen(4)
        self.endpoint = f"127.0.0.1:{self._listen.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, server, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "down"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        try:
            while (n := src.recv_into(buf)) > 0:
                dst.sendall(view[:n])
                with self._lock:
                    setattr(self, way, getattr(self, way) + n)
                    if way == "up" and self.tally is not None:
                        self.tally.feed(view[:n])
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def take(self) -> tuple[int, int]:
        """(up, down) bytes since the last call."""
        with self._lock:
            out, self.up, self.down = (self.up, self.down), 0, 0
        return out

    def take_tally(self) -> dict:
        with self._lock:
            return self.tally.take() if self.tally is not None else {}

    def close(self) -> None:
        self._listen.close()


def _prefill(llm, tokens, proxies) -> dict:
    llm.reset()
    for p in proxies:
        p.take()
        p.take_tally()
    t = time.perf_counter()
    llm.eval(tokens)
    ms = (time.perf_counter() - t) * 1000.0
    links = [p.take() for p in proxies]
    return {"ttft_ms": ms, "bytes_up": [u for u, _ in links], "bytes_down": [d for _, d in links],
            "up_detail": [p.take_tally() for p in proxies],
            "stats": {k: llm.ridgefill_stats.get(k) for k in ("split", "n_filled", "n_exact", "ceiling")}
            if llm.ridgefill_stats else None}


def measure(model: str, maps: str, lengths: list[int], reps: int, worker_threads: int, threads: int,
            local: bool, tensor_split: list[float] | None = None) -> dict:
    from ridgefill_cpp import Llama, RidgeFill
    from ridgefill_cpp.quality.bench import prompt_tokens
    from ridgefill_cpp.core.gguf_model import read_model_info
    from ridgefill_cpp.runtime.rpc import Worker

    info = read_model_info(model)
    rf = RidgeFill(maps, min_prompt=0)
    n_ctx = max(lengths) + 16
    kw = dict(n_ctx=n_ctx, n_batch=2048, n_ubatch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    prompts: dict[int, list[int]] = {}
    out = {"model": info.name or pathlib.Path(model).name, "architecture": info.architecture, "n_layer": info.n_layer,
           "n_embd": info.n_embd, "maps": str(maps), "lengths": lengths, "reps": reps,
           "worker_threads": worker_threads, "host_threads": threads, "tensor_split": tensor_split or [1, 1],
           "rpc": [], "local": []}

    def run(llm, proxies, rows):
        prompts.update({n: prompt_tokens(llm, n) for n in lengths if n not in prompts})
        llm.set_ridgefill(rf)
        llm.eval(prompts[lengths[0]][:256])  # warm-up
        for n in lengths:
            for rep in range(reps):
                for variant in (("stock", "ridgefill") if rep % 2 == 0 else ("ridgefill", "stock")):
                    llm.set_ridgefill(rf if variant == "ridgefill" else None)
                    r = _prefill(llm, prompts[n], proxies)
                    r.update(n=n, variant=variant, rep=rep)
                    rows.append(r)
                    print(f"  {n:6d} {variant:9s} {r['ttft_ms']:9.1f} ms  up {sum(r['bytes_up'])/1e6:8.2f} MB  "
                          f"down {sum(r['bytes_down'])/1e6:8.2f} MB", flush=True)

    with Worker(threads=worker_threads) as w1, Worker(threads=worker_threads) as w2:
        proxies = [CountingProxy(("127.0.0.1", w.port), tally=True) for w in (w1, w2)]
        try:
            t = time.perf_counter()
            llm = Llama(model, rpc_servers=[p.endpoint for p in proxies], n_gpu_layers=info.n_layer + 1,
                        tensor_split=tensor_split or [1, 1], ridgefill=rf, **kw)
            out["load_s"] = time.perf_counter() - t
            out["load_bytes_up"] = [p.take()[0] for p in proxies]
            out["layer_devices"] = llm.layer_devices()
            out["maps_buffers"] = llm.ridgefill_memory()["maps_buffers"]
            print(f"{out['model']} over 2 workers ({worker_threads} thread(s) each)", flush=True)
            try:
                run(llm, proxies, out["rpc"])
            finally:
                llm.close()
        finally:
            for p in proxies:
                p.close()
    if local:
        print(f"{out['model']} on this machine ({threads} thread(s))", flush=True)
        llm = Llama(model, ridgefill=rf, **kw)
        try:
            run(llm, [], out["local"])
        finally:
            llm.close()
    out["summary"] = summarize(out)
    return out


def summarize(out: dict) -> list[dict]:
    rows = []
    for where in ("rpc", "local"):
        for n in out["lengths"]:
            got = {v: [r for r in out[where] if r["n"] == n and r["variant"] == v] for v in ("stock", "ridgefill")}
            if not got["stock"]:
                continue
            med = {v: statistics.median(r["ttft_ms"] for r in rs) for v, rs in got.items()}
            row = {"where": where, "n": n, "stock_ms": med["stock"], "ridgefill_ms": med["ridgefill"],
                   "speedup": med["stock"] / med["ridgefill"], "ceiling": got["ridgefill"][0]["stats"]["ceiling"]}
            if where == "rpc":
                for v in ("stock", "ridgefill"):
                    r = got[v][0]
                    row[f"{v}_mb_up"] = sum(r["bytes_up"]) / 1e6
                    row[f"{v}_mb_down"] = sum(r["bytes_down"]) / 1e6
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--maps", required=True, help="map file of `ridgefill-gguf fit` for the model")
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--reps", type=int, default=2, help="prefills per variant and length (alternated)")
    ap.add_argument("--worker-threads", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="host threads")
    ap.add_argument("--local", action="store_true", help="also run stock vs RidgeFill on this machine alone")
    ap.add_argument("--tensor-split", default="1,1", help="the two workers' shares of the layers")
    ap.add_argument("--json", type=pathlib.Path)
    a = ap.parse_args(argv)
    out = measure(a.model, a.maps, [int(x) for x in a.lengths.split(",")], a.reps, a.worker_threads, a.threads,
                  a.local, [float(x) for x in a.tensor_split.split(",")])
    for r in out["summary"]:
        extra = (f"  MB up/down stock {r['stock_mb_up']:.1f}/{r['stock_mb_down']:.1f}, RidgeFill "
                 f"{r['ridgefill_mb_up']:.1f}/{r['ridgefill_mb_down']:.1f}") if r["where"] == "rpc" else ""
        print(f"{r['where']:5s} N={r['n']:6d} stock {r['stock_ms']:9.1f} ms  RidgeFill {r['ridgefill_ms']:9.1f} ms  "
              f"{r['speedup']:.2f}x (ceiling {r['ceiling']:.2f}x){extra}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

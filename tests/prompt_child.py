"""Run one prompt through llama.cpp in a child process, for tests that must survive a crash of the
native code (an illegal instruction is reported as the child's signal, not as a dead test run).

    python prompt_child.py MODEL EXTRA_BUFTS OUT.npy TOKENS

Decodes TOKENS[:-1] as one batch (every row's logits) and then TOKENS[-1] alone (a one-row batch:
matrix kernels have separate paths for one row), writes the [len(TOKENS), n_vocab] float32 logits
to OUT.npy and prints one JSON line: the decode return codes and the buffer types that hold the
model's weights (from llama.cpp's "... model buffer size" log lines). EXTRA_BUFTS is 1 to let
llama.cpp place weights in the CPU backend's extra buffer types (AMX, CPU_REPACK: its default),
0 for plain CPU buffers.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main(argv: list[str]) -> int:
    model_path, extra, out, tokens = argv[0], argv[1] == "1", argv[2], [int(t) for t in argv[3].split(",")]

    import ridgefill_cpp  # noqa: F401  (the patched libraries)
    from llama_cpp import llama_cpp as C

    log: list[str] = []

    @C.llama_log_callback
    def on_log(level, text, user_data):
        log.append(text.decode(errors="replace"))

    C.llama_log_set(on_log, None)
    C.llama_backend_init()
    mparams = C.llama_model_default_params()
    mparams.use_extra_bufts = extra
    model = C.llama_model_load_from_file(model_path.encode(), mparams)
    if not model:
        print(json.dumps({"error": "model did not load", "log": "".join(log)[-2000:]}))
        return 1
    cparams = C.llama_context_default_params()
    cparams.n_ctx = max(64, len(tokens))
    cparams.n_batch = cparams.n_ubatch = len(tokens)
    cparams.n_threads = cparams.n_threads_batch = 2
    ctx = C.llama_init_from_model(model, cparams)
    n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))

    batch = C.llama_batch_init(len(tokens), 0, 1)
    rows, rcs = [], []
    for first, last in ((0, len(tokens) - 1), (len(tokens) - 1, len(tokens))):
        for i, pos in enumerate(range(first, last)):
            batch.token[i] = tokens[pos]
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1
        batch.n_tokens = last - first
        rcs.append(int(C.llama_decode(ctx, batch)))
        logits = C.llama_get_logits(ctx)
        rows.append(np.ctypeslib.as_array(logits, shape=((last - first) * n_vocab,)).reshape(last - first, n_vocab).copy())
    np.save(out, np.concatenate(rows).astype(np.float32))

    buffers = sorted({line.split("model buffer size")[0].split()[-1]
                      for line in "".join(log).splitlines() if "model buffer size" in line})
    print(json.dumps({"decode": rcs, "weight_buffers": buffers}))
    C.llama_batch_free(batch)
    C.llama_free(ctx)
    C.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

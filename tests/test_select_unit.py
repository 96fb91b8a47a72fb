"""The selector rules of csrc/llama-ridgefill-select.cpp compiled on their own (no context, model or
backend: the file is pure functions) and checked against the oracle's selectors
(ridgefill_cpp/oracle/fill.py) on random scores, tokens and vocabularies, ties and token classes
included. The end-to-end selector tests (test_prefill.py) check the same rules through libllama;
these reach the cases a tiny model's prompts rarely produce (many equal scores, every class mix,
fractions that round, rows given as embeddings)."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from ridgefill_cpp.core.settings import SELECTORS  # the names and their C values (checked against libllama's)
from ridgefill_cpp.oracle import fill as F

REPO = Path(__file__).resolve().parent.parent

ALL_CLASSES = F.CLASS_DIGIT | F.CLASS_RARE | F.CLASS_LINE_START | F.CLASS_SINK

DRIVER = r"""
#include "llama-ridgefill-select.h"

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

// stdin: selector fraction n_prefix pos0 classes span has_scores n_rows, the rows' scores and tokens,
// n_vocab, then per vocabulary entry: control length hex-bytes. stdout: the selected positions
int main() {
    llama_ridgefill_select_input in;
    int has_scores = 0, n_rows = 0, n_vocab = 0;
    std::cin >> in.selector >> in.fraction >> in.n_prefix >> in.pos0 >> in.classes >> in.span >> has_scores >> n_rows;
    in.has_scores = has_scores != 0;
    in.scores.resize(n_rows);
    in.tokens.resize(n_rows);
    for (auto & s : in.scores) { std::cin >> s; }
    for (auto & t : in.tokens) { std::cin >> t; }
    std::cin >> n_vocab;
    std::vector<std::string> texts(n_vocab);
    std::vector<bool> control(n_vocab);
    for (int v = 0; v < n_vocab; ++v) {
        int c = 0, len = 0;
        std::cin >> c >> len;
        control[v] = c != 0;
        for (int i = 0; i < len; ++i) {
            unsigned b = 0;
            std::cin >> std::hex >> b >> std::dec;
            texts[v].push_back((char) b);
        }
    }
    if (!std::cin) {
        return 2;
    }
    in.piece = [&](llama_token t) {
        llama_ridgefill_piece p;
        if (t >= 0 && t < n_vocab) {
            p.text    = &texts[t];
            p.control = control[t];
        }
        return p;
    };
    for (llama_pos p : llama_ridgefill_select_rows(in)) {
        std::printf("%d ", p);
    }
    std::printf("\n");
    return 0;
}
"""


def _include_dirs(tmp: Path) -> list[Path]:
    """csrc/ and the public llama.cpp headers (the build's tree, else the pinned sources unpacked)."""
    tree = REPO / ".cache" / "llama.cpp"
    if not (tree / "include" / "llama.h").is_file():
        import fetch_llama_cpp

        pin = fetch_llama_cpp.json.loads(fetch_llama_cpp.PIN_FILE.read_text())
        sdist = fetch_llama_cpp.fetch_sdist(pin, fetch_llama_cpp.default_cache_dir())
        tree = fetch_llama_cpp.unpack_llama_cpp(sdist, pin, tmp / "llama.cpp")
    return [REPO / "csrc", tree / "include", tree / "ggml" / "include"]


@pytest.fixture(scope="module")
def select_bin(tmp_path_factory) -> Path:
    cxx = shutil.which("c++") or shutil.which("g++")
    assert cxx, "a C++ compiler is needed (the native build has one)"
    tmp = tmp_path_factory.mktemp("select")
    (tmp / "driver.cpp").write_text(DRIVER)
    out = tmp / "select"
    inc = [f"-I{d}" for d in _include_dirs(tmp)]
    # only this file of csrc/, and ggml's abort for GGML_ASSERT: the rules need nothing else
    ggml_abort = tmp / "abort.cpp"
    ggml_abort.write_text('#include <cstdio>\n#include <cstdlib>\nextern "C" void ggml_abort(const char * f, int l, '
                          'const char *, ...) { std::fprintf(stderr, "abort %s:%d\\n", f, l); std::abort(); }\n')
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", *inc, str(REPO / "csrc" / "llama-ridgefill-select.cpp"),
                    str(tmp / "driver.cpp"), str(ggml_abort), "-o", str(out)], check=True, capture_output=True, text=True)
    return out


def _run(select_bin: Path, selector: str, fraction: float, n_prefix: int, scores, tokens, texts, control, *,
         pos0: int = 0, classes: int = F.CLASS_SINK | F.CLASS_DIGIT, has_scores: bool = True, span: int = 1) -> list[int]:
    lines = [f"{SELECTORS[selector]} {fraction!r} {n_prefix} {pos0} {classes} {span} {int(has_scores)} {len(tokens)}",
             " ".join(repr(float(s)) for s in scores), " ".join(str(t) for t in tokens), str(len(texts))]
    for text, c in zip(texts, control):
        raw = text.encode()
        lines.append(f"{int(c)} {len(raw)} " + " ".join(f"{b:x}" for b in raw))
    res = subprocess.run([str(select_bin)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    return [int(x) for x in res.stdout.split()]


def _oracle(selector: str, fraction: float, n_prefix: int, scores, tokens, texts, control, classes: int,
            span: int = 1) -> list[int]:
    sc = torch.tensor(scores, dtype=torch.float32)
    if selector == "none":
        return []
    if selector in ("attention", "probe"):  # the probe's scores get no recency correction
        return F.select_exact_rows(sc, n_prefix, fraction, span, recency=F.RECENCY_SHARE if selector == "attention" else 0)
    if selector == "protected":  # no scores: the span does not apply
        return F.select_protected_rows(tokens, texts, control, n_prefix, fraction, classes)
    return F.select_attention_protected_rows(sc, tokens, texts, control, n_prefix, fraction, classes, span)


def _vocab(rng: random.Random, n: int) -> tuple[list[str], list[bool]]:
    pieces = ["the", " a", "7", "x1", "\n", "ok\n", " 42", "é", "--", "  ", "", "9\n", "b", "<s>"]
    texts = [rng.choice(pieces) + (str(rng.randrange(10)) if rng.random() < 0.2 else "") for _ in range(n)]
    control = [rng.random() < 0.1 for _ in range(n)]
    return texts, control


@pytest.mark.parametrize("selector", list(SELECTORS))
def test_selector_rules_match_the_oracle(select_bin, selector):
    rng = random.Random(1000 + SELECTORS[selector])
    for case in range(60):
        n_vocab = rng.choice([5, 12, 40])
        texts, control = _vocab(rng, n_vocab)
        n_rows = rng.randrange(1, 120)
        n_prefix = rng.randrange(0, n_rows + 1)
        # few distinct scores: ties everywhere (the earlier row wins); exact in float32
        scores = [rng.randrange(0, rng.choice([2, 5, 1000])) / 8 for _ in range(n_rows)]
        tokens = [rng.randrange(n_vocab) for _ in range(n_rows)]
        fraction = rng.choice([0.0, 0.1, 0.25, 1 / 3, 0.5, 1.0])
        classes = rng.choice([F.CLASS_SINK | F.CLASS_DIGIT, ALL_CLASSES, F.CLASS_RARE, F.CLASS_LINE_START])
        span = rng.choice([1, 1, 2, 3, 8, 16, 200])
        got = _run(select_bin, selector, fraction, n_prefix, scores, tokens, texts, control, classes=classes, span=span)
        want = _oracle(selector, fraction, n_prefix, scores, tokens, texts, control, classes, span)
        assert got == want, (case, selector, fraction, n_prefix, classes, span)
        assert len(got) <= F.n_selected(n_prefix, fraction)


def test_counts_round_as_the_oracle(select_bin):
    texts, control = ["a"], [False]
    for n_prefix, fraction in [(30, 0.1), (10, 0.1), (7, 1 / 7), (3, 0.34), (100, 0.999), (1, 1e-12)]:
        got = _run(select_bin, "attention", fraction, n_prefix, [1.0] * n_prefix, [0] * n_prefix, texts, control)
        assert len(got) == F.n_selected(n_prefix, fraction)
        assert got == list(range(len(got)))  # all equal: the earliest rows


def test_attention_without_a_selector_layer_and_embedding_rows(select_bin):
    texts, control = ["1", "x"], [False, False]
    # no scores (an attention selector whose split has no full-attention layer below it): nothing
    assert _run(select_bin, "attention", 0.5, 10, [0.0] * 10, [1] * 10, texts, control, has_scores=False) == []
    # attention+protected then keeps only the protected rows
    tokens = [1, 1, 0, 1, 1, 1, 1, 0, 1, 1]
    got = _run(select_bin, "attention+protected", 0.5, 10, list(range(10)), tokens, texts, control,
               pos0=100, has_scores=False)
    assert got == [102, 107]  # the digit rows, as positions from pos0 (no sink rows past position 3)
    # rows given as embeddings (LLAMA_TOKEN_NULL) are in no token class, and not counted
    tokens = [-1, 0, -1, 1, 0]
    assert _run(select_bin, "protected", 1.0, 5, [0.0] * 5, tokens, texts, control, pos0=4,
                classes=ALL_CLASSES) == [4 + 1, 4 + 3, 4 + 4]


def test_spans_keep_the_rows_around_each_peak(select_bin):
    """With span w, the w rows around each top-scoring row come whole, peaks in score order, a span
    stops at the prefix's ends, and spans give at most ceil(SPAN_SHARE · k) of the k rows: the
    top-scoring single rows give the rest. Without a span, the single top rows. (The probe's rule:
    the attention selectors take RECENCY_SHARE of the rows first, test_recency_share_below.)"""
    texts, control = ["x"], [False]
    scores = [0.0] * 100
    scores[40], scores[70], scores[1] = 9.0, 5.0, 3.0
    before, after = F.span_extent(8)
    assert (before, after) == (3, 4) and F.SPAN_SHARE == 0.75
    run = lambda fraction, span: _run(select_bin, "probe", fraction, 100, scores, [0] * 100, texts, control,  # noqa: E731
                                      pos0=10, span=span)
    at = lambda rows: [10 + r for r in sorted(rows)]  # noqa: E731
    assert run(0.03, 1) == at([1, 40, 70])
    # k = 8: 6 rows of the first peak's span (the peak, then its earliest rows), then rows 70 and 1
    assert run(0.08, 8) == at([37, 38, 39, 40, 41, 42, 70, 1])
    # k = 16: the first span whole and 4 rows of the second (12), then row 1 and the earliest zero rows
    assert run(0.16, 8) == at([*range(37, 45), 70, 67, 68, 69, 1, 0, 2, 3])
    # k = 32: 24 rows of spans: 37..44, 67..74, and the third, cut at row 0 (rows 0..5), then the rest
    assert run(0.32, 8) == at([*range(37, 45), *range(67, 75), *range(0, 6), *range(6, 16)])
    assert run(1.0, 4096) == list(range(10, 110))


def test_recency_share_below(select_bin):
    """The attention selectors take ceil(RECENCY_SHARE · k) rows first by their recency-corrected
    score: a row far back that stands out against the prompt's power-law trend is kept although
    every row near the end scores higher; the probe's scores get no correction. Scores that do not
    fall with distance are left as they are."""
    texts, control = ["x"], [False]
    n = 100
    trend = [1.0 / (n - j) for j in range(n)]  # a query row's attention falls as 1/distance
    scores = list(trend)
    scores[20] = 3.0 * trend[20]  # 3x what a row at its distance gets, 0.0375: below the last 26 rows
    assert F.RECENCY_SHARE == 0.25 and sorted(scores, reverse=True).index(scores[20]) == 26
    run = lambda selector, sc, span=1, fraction=0.1: _run(select_bin, selector, fraction, n, sc, [0] * n,  # noqa: E731
                                                          texts, control, span=span)
    last = list(range(90, 100))
    assert run("probe", scores) == last  # k = 10, the ten nearest rows
    # ceil(0.25 · 10) = 3 by the corrected score: row 20, then two of the trend rows; 7 by score
    got = run("attention", scores)
    assert 20 in got and len(got) == 10 and len(set(got) & set(last)) >= 7
    # with a span the whole fact comes: k = 40, 10 rows by corrected span, the span around row 20 first
    before, after = F.span_extent(8)
    got = run("attention", scores, span=8, fraction=0.4)
    assert set(range(20 - before, 20 + after + 1)) <= set(got)
    assert not set(range(20 - before, 20 + after + 1)) <= set(run("probe", scores, span=8, fraction=0.4))
    # rising with distance: no correction, the attention rule is the probe's
    rising = list(reversed(trend))
    assert run("attention", rising) == run("probe", rising) == list(range(10))


def test_sink_rows_are_positions_not_rows(select_bin):
    texts, control = ["x"], [False]
    got = _run(select_bin, "protected", 1.0, 8, [0.0] * 8, [0] * 8, texts, control, pos0=2, classes=F.CLASS_SINK)
    assert got == [2, 3]  # positions 2 and 3 of the sequence are its last sink rows

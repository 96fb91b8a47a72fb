// The selector seam as pure functions (see llama-ridgefill-select.h).

#include "llama-ridgefill-select.h"

#include "ggml.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <numeric>
#include <tuple>
#include <unordered_map>

int32_t llama_ridgefill_n_selected(int32_t n_prefix, double fraction) {
    if (n_prefix <= 0) {
        return 0;
    }
    const double k = std::ceil(fraction*n_prefix - 1e-9);
    return (int32_t) std::max(0.0, std::min<double>(n_prefix, k));
}

void llama_ridgefill_span_extent(int32_t span, int32_t * before, int32_t * after) {
    GGML_ASSERT(span >= 1);
    *before = (span - 1)/2;
    *after  = span - 1 - *before;
}

std::vector<int32_t> llama_ridgefill_rows_by_score(const std::vector<float> & scores, int32_t n_prefix, int32_t span) {
    GGML_ASSERT((int32_t) scores.size() >= n_prefix);
    const int32_t n = std::max(n_prefix, 0);

    // the rank of each row: the highest score of a row whose span covers it (a row r covers
    // r - before .. r + after), i.e. the sliding maximum over j - after .. j + before
    std::vector<float> rank(scores.begin(), scores.begin() + n);
    int32_t before = 0;
    int32_t after  = 0;
    llama_ridgefill_span_extent(span, &before, &after);
    if (span > 1) {
        std::deque<int32_t> win; // rows of the window, scores decreasing
        int32_t next = 0;        // the next row to enter the window
        for (int32_t j = 0; j < n; ++j) {
            for (; next <= std::min(j + before, n - 1); ++next) {
                while (!win.empty() && scores[win.back()] <= scores[next]) {
                    win.pop_back();
                }
                win.push_back(next);
            }
            while (win.front() < j - after) {
                win.pop_front();
            }
            rank[j] = scores[win.front()];
        }
    }

    std::vector<int32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        return rank[a] != rank[b] ? rank[a] > rank[b] : scores[a] > scores[b];
    });
    return order;
}

std::vector<float> llama_ridgefill_recency_corrected(const std::vector<float> & scores, int32_t n_prefix) {
    GGML_ASSERT((int32_t) scores.size() >= n_prefix);
    const int32_t n = std::max(n_prefix, 0);

    auto log_d = [n](int32_t j) { return std::log((double) (n - j)); };
    auto used  = [&](int32_t j) { return j >= LLAMA_RIDGEFILL_N_SINK && scores[j] > 0.0f; };

    // least squares of log score on log distance, centred (two passes)
    double  mx = 0.0;
    double  my = 0.0;
    int64_t m  = 0;
    for (int32_t j = 0; j < n; ++j) {
        if (used(j)) {
            mx += log_d(j);
            my += std::log((double) scores[j]);
            m++;
        }
    }
    double b = 0.0;
    if (m >= 2) {
        mx /= m;
        my /= m;
        double sxx = 0.0;
        double sxy = 0.0;
        for (int32_t j = 0; j < n; ++j) {
            if (used(j)) {
                const double x = log_d(j) - mx;
                sxx += x*x;
                sxy += x*(std::log((double) scores[j]) - my);
            }
        }
        if (sxx > 0.0) {
            b = sxy/sxx;
        }
    }
    b = std::min(0.0, std::max(-LLAMA_RIDGEFILL_RECENCY_MAX_SLOPE, b));

    std::vector<float> out(n);
    for (int32_t j = 0; j < n; ++j) {
        out[j] = (float) (scores[j]*std::exp(-b*log_d(j)));
    }
    return out;
}

std::vector<int32_t> llama_ridgefill_protected_rows(const std::vector<llama_token> & tokens, llama_pos pos0,
        int32_t n_prefix, int32_t classes, const llama_ridgefill_piece_fn & piece) {
    const int32_t N = (int32_t) tokens.size();
    std::unordered_map<llama_token, int32_t> count;
    for (llama_token t : tokens) {
        if (t != LLAMA_TOKEN_NULL) {
            count[t]++;
        }
    }
    auto text_of = [&](llama_token t) -> llama_ridgefill_piece {
        return t == LLAMA_TOKEN_NULL ? llama_ridgefill_piece() : piece(t);
    };

    struct cand { int32_t rank; int32_t count; int32_t j; };
    std::vector<cand> cands;
    for (int32_t j = 0; j < std::min(n_prefix, N); ++j) {
        const llama_token           t  = tokens[j];
        const llama_ridgefill_piece pc = text_of(t);
        int32_t cls = 0;
        if (pos0 + j < LLAMA_RIDGEFILL_N_SINK) {
            cls |= LLAMA_RIDGEFILL_CLASS_SINK;
        }
        if (pc.text && !pc.control) {
            const std::string & s = *pc.text;
            if (std::any_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) {
                cls |= LLAMA_RIDGEFILL_CLASS_DIGIT;
            }
            if (count[t] == 1) {
                cls |= LLAMA_RIDGEFILL_CLASS_RARE;
            }
            if (j > 0) {
                const llama_ridgefill_piece prev = text_of(tokens[j - 1]);
                if (prev.text && !prev.text->empty() && prev.text->back() == '\n') {
                    cls |= LLAMA_RIDGEFILL_CLASS_LINE_START;
                }
            }
        }
        cls &= classes;
        if (cls) {
            const int32_t rank = (cls & LLAMA_RIDGEFILL_CLASS_SINK)  ? 0 :
                                 (cls & LLAMA_RIDGEFILL_CLASS_DIGIT) ? 1 :
                                 (cls & LLAMA_RIDGEFILL_CLASS_RARE)  ? 2 : 3;
            cands.push_back({ rank, pc.text ? count[t] : 0, j });
        }
    }
    std::sort(cands.begin(), cands.end(), [](const cand & a, const cand & b) {
        return std::tie(a.rank, a.count, a.j) < std::tie(b.rank, b.count, b.j);
    });
    std::vector<int32_t> rows;
    rows.reserve(cands.size());
    for (const cand & c : cands) {
        rows.push_back(c.j);
    }
    return rows;
}

std::vector<llama_pos> llama_ridgefill_select_rows(const llama_ridgefill_select_input & in) {
    const int32_t k = llama_ridgefill_n_selected(in.n_prefix, in.fraction);

    // the first k distinct rows of the lists, in turn; a list adds at most n_max rows
    std::vector<char>      chosen(std::max(in.n_prefix, 0), 0);
    std::vector<llama_pos> exact;
    auto take = [&](const std::vector<int32_t> & rows, int32_t n_max) {
        const int32_t end = (int32_t) std::min<int64_t>(k, (int64_t) exact.size() + n_max);
        for (size_t i = 0; i < rows.size() && (int32_t) exact.size() < end; ++i) {
            if (!chosen[rows[i]]) {
                chosen[rows[i]] = 1;
                exact.push_back(in.pos0 + rows[i]);
            }
        }
    };
    // by score: the attention selectors' LLAMA_RIDGEFILL_RECENCY_SHARE of the k rows by the corrected
    // score (as spans); with a span, whole spans up to LLAMA_RIDGEFILL_SPAN_SHARE of them in all
    // (those included); then single rows
    auto by_score = [&](bool recency) {
        int32_t n_recency = 0;
        if (recency) {
            const size_t n_before = exact.size();
            take(llama_ridgefill_rows_by_score(llama_ridgefill_recency_corrected(in.scores, in.n_prefix), in.n_prefix, in.span),
                 llama_ridgefill_n_selected(k, LLAMA_RIDGEFILL_RECENCY_SHARE));
            n_recency = (int32_t) (exact.size() - n_before);
        }
        if (in.span > 1) {
            take(llama_ridgefill_rows_by_score(in.scores, in.n_prefix, in.span),
                 std::max(0, llama_ridgefill_n_selected(k, LLAMA_RIDGEFILL_SPAN_SHARE) - n_recency));
        }
        take(llama_ridgefill_rows_by_score(in.scores, in.n_prefix, 1), k);
    };
    auto protect = [&]() { take(llama_ridgefill_protected_rows(in.tokens, in.pos0, in.n_prefix, in.classes, in.piece), k); };

    switch (in.selector) {
        case LLAMA_RIDGEFILL_SELECTOR_NONE:
            break;
        case LLAMA_RIDGEFILL_SELECTOR_ATTENTION:
        case LLAMA_RIDGEFILL_SELECTOR_PROBE:
            if (in.has_scores) {
                by_score(in.selector == LLAMA_RIDGEFILL_SELECTOR_ATTENTION);
            }
            break;
        case LLAMA_RIDGEFILL_SELECTOR_PROTECTED:
            protect();
            break;
        case LLAMA_RIDGEFILL_SELECTOR_ATTENTION_PROTECTED:
            protect();
            if (in.has_scores) {
                by_score(/*recency =*/ true);
            }
            break;
        default:
            GGML_ABORT("unknown selector %d", in.selector);
    }
    std::sort(exact.begin(), exact.end());
    return exact;
}

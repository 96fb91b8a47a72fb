// The selector seam (docs/design.md §5) as pure functions: which prefix rows of a planned prompt stay
// exact, from the rows' selector scores and tokens. Nothing here touches a context, a model or a
// backend, so the rules can be compiled and tested on their own (tests/test_select_unit.py).
#pragma once

#include "llama-ridgefill.h"

#include <functional>
#include <string>
#include <vector>

// how many prefix rows the selector keeps: ceil(fraction * n_prefix), with a tolerance against
// rounding (0.1 * 30 is 3, not 4)
int32_t llama_ridgefill_n_selected(int32_t n_prefix, double fraction);

// what the protected selector knows of a token: its text, and whether it is a control token;
// text == nullptr: not a token of the vocabulary
struct llama_ridgefill_piece {
    const std::string * text    = nullptr;
    bool                control = false;
};

using llama_ridgefill_piece_fn = std::function<llama_ridgefill_piece(llama_token)>;

// the rows a span of `span` rows (>= 1) around row r covers: r - before .. r + after
void llama_ridgefill_span_extent(int32_t span, int32_t * before, int32_t * after);

// prefix rows 0..n_prefix-1 by score, highest first (ties: the earlier row). span > 1: by the
// highest score of a row whose span covers them, then by their own score, so the span around each
// top-scoring row comes whole (rows past the prefix's ends are not in it)
std::vector<int32_t> llama_ridgefill_rows_by_score(const std::vector<float> & scores, int32_t n_prefix, int32_t span = 1);

// the prefix rows' scores without their recency trend: score_j * d_j^-b, d_j = n_prefix - j the row's
// distance from the end of the prefix and b the least-squares slope of log score on log d over the
// rows after the sinks (j >= LLAMA_RIDGEFILL_N_SINK) with a score > 0, clamped to
// [-LLAMA_RIDGEFILL_RECENCY_MAX_SLOPE, 0]: a row's score over what a row at its distance gets on
// average, a power law fitted on the prompt's own scores. [n_prefix]
std::vector<float> llama_ridgefill_recency_corrected(const std::vector<float> & scores, int32_t n_prefix);

// prefix rows in a class of `classes` (enum llama_ridgefill_token_class bits): sink rows first, then
// digits, then once-in-the-prompt tokens, then line starts; within a class rarer tokens (fewer
// occurrences in the prompt) first, then the earlier row. tokens: the token of each planned row
// (LLAMA_TOKEN_NULL: given as an embedding), the first at position pos0
std::vector<int32_t> llama_ridgefill_protected_rows(const std::vector<llama_token> & tokens, llama_pos pos0,
        int32_t n_prefix, int32_t classes, const llama_ridgefill_piece_fn & piece);

// what a selector decides from
struct llama_ridgefill_select_input {
    int32_t  selector  = LLAMA_RIDGEFILL_SELECTOR_NONE; // enum llama_ridgefill_selector
    double   fraction  = 0.0;
    int32_t  n_prefix  = 0;
    llama_pos pos0     = 0;
    int32_t  classes   = 0;      // protected selectors: enum llama_ridgefill_token_class bits
    int32_t  span      = 1;      // attention and probe scores: rows by span (llama_ridgefill_rows_by_score)
    bool     has_scores = false; // attention selectors without a selector layer have none
    std::vector<float>       scores; // [>= n_prefix] the score of each planned row
    std::vector<llama_token> tokens; // protected selectors
    llama_ridgefill_piece_fn piece;  // protected selectors
};

// the exact prefix rows, as ascending positions: the first k = ceil(fraction * n_prefix) distinct
// rows of the selector's lists, in turn (attention+protected: the protected rows, then by score). By
// score: the attention selectors first take rows by span of the recency-corrected scores, at most
// ceil(LLAMA_RIDGEFILL_RECENCY_SHARE * k) rows; with span > 1, rows by span of the scores add rows
// until the two span lists have added ceil(LLAMA_RIDGEFILL_SPAN_SHARE * k); then rows by their own
// score (span 1) fill the rest
std::vector<llama_pos> llama_ridgefill_select_rows(const llama_ridgefill_select_input & in);

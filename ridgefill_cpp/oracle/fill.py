"""RidgeFill's filled-row prefill (docs/design.md §4) and its attention selector (§5), on the oracle.

This module is the reference definition in code: the C/C++ implementation is checked against it
(last-row logits and the filled KV-cache rows). It is written layer-major, as §4 is, and is built
only from the oracle's own layer pieces (``kv_path``, ``layer_over_cache``, ``gdn_update``,
``gdn_layer_output``), the same ones its exact forward pass is made of, so the exact and the
filled branch cannot drift apart.

One prompt of N rows, a fresh sequence at positions 0..N-1; split S, tail T::

    roles     tail    = the last T rows                             exact
              chosen  = exact_positions (e.g. the attention selector) exact
              filled  = every other prefix row
    l < S     every row runs layer l exactly
    l ≥ S     (a) s_{l,h} = mean ‖V(x_l)‖ / mean ‖V(x̂_l)‖ over the first min(c, T) tail rows
              (b) filled rows: x̂_l = x_S (l = S or identity fill) or A_l φ(x_S) + b_l (maps),
                  then K, V = kv_path(l, x̂_l, j), V ·= s_{l,h}, written to the cache at row j
              (c) exact rows run the whole layer, attending causally (and within gemma3's sliding
                  window) to the cache: filled K/V for filled rows, their own exact K/V otherwise
    GDN l ≥ S (qwen35) the recurrence consumes every row in position order; a filled row feeds
              only its state update from x̂_l; exact rows run the whole layer (readout, gate,
              output projection, FFN). No value scale (there is no V cache) and no terminal-state
              correction here.

Choices where docs/design.md §4/§5 are silent (the C++ implementation follows them):

* **Degenerate cases** (§4.6). S = L or N ≤ T: the plan is inactive and every layer runs exactly
  on every row through the same code as the exact forward, so the output is bit-identical to
  :meth:`forward`. All rows exact through ``exact_positions`` (selector fraction 1.0) is *not* a
  short cut: the late-layer machinery runs and matches the exact forward up to rounding.
  S = L-1 has no maps (they exist for S+1..L-1) and its only late layer fills from x_S, which is
  the exact input there: output equal to the exact forward up to rounding, for any selection.
* **Tail** must be ≥ 1 (the last row gives the logits); T > N is clamped to N.
* **Value scale.** The ratio of the two means (not the mean of ratios), per KV head, in the
  oracle's dtype; ``V`` is the V projection the cache stores (attn norm → W_v (+b_v)), positions
  play no part. The first min(c, T) tail rows in position order (the rows nearest the prefix).
  c = 0 → 1. A zero denominator (all predicted V zero) → 1. At l = S, x̂ = x_S is the tail rows'
  exact input, so s = 1 up to rounding. It is measured even when no row is filled.
  GDN layers have no scale: their rows in ``value_scales`` are 1.
* **qwen35 gated attention.** The output gate (the second half of ``attn_q``) belongs to the
  query side: filled rows compute no Q and no gate; exact rows gate their attention output with
  their own gate from their own input. The value scale is measured and applied on V only.
* **Row 0 / the attention sink** gets no special rule: it is exact when the tail or the selector
  covers it (the attention selector picks sink rows, they receive the most attention) and filled
  otherwise, as POP does.
* **Selector rounding.** ``select_exact_rows`` keeps ``ceil(fraction · prefix)`` rows (with a 1e-9
  tolerance, so 0.1 · 30 is 3 and not 4): any fraction > 0 of a non-empty prefix keeps at least
  one row, 0 keeps none, 1 keeps all. Ties in score go to the earlier position. With a span,
  ceil(SPAN_SHARE · k) rows come as whole spans around the top-scoring rows, the rest as single rows;
  for the attention selectors the first ceil(RECENCY_SHARE · k) of them by :func:`recency_corrected`.
* **Selector layer** (:func:`default_selector_layer`): the last full-attention layer below S, i.e.
  S-1 for llama and qwen3; gemma3 skips sliding-window layers (they cannot see rows further back
  than the window) and qwen35 skips Gated DeltaNet layers (they have no attention probabilities).
  No such layer → ValueError. The scores are summed over query heads (not KV heads) and over the
  last min(n_queries, N) prompt rows, which include the tail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from .common import Oracle

if TYPE_CHECKING:
    from ..maps.mapfile import RidgeMaps
    from .qwen35 import GDNState, GDNUpdate

#: row roles (:attr:`FillOutput.roles`)
ROLE_FILLED = 0  # prefix row filled at the late layers
ROLE_EXACT = 1  # prefix row kept exact (selector / exact_positions)
ROLE_TAIL = 2  # one of the last T rows (always exact)

#: the value-rescale row count c of docs/design.md §4.3a
DEFAULT_VALUE_RESCALE = 512
#: attention selector defaults (docs/design.md §5)
DEFAULT_N_QUERIES = 64
DEFAULT_FRACTION = 0.10
DEFAULT_SPAN = 16
SPAN_SHARE = 0.75  # span > 1: the share of the exact rows taken as whole spans, the rest single rows
RECENCY_SHARE = 0.25  # attention selectors: the share of the exact rows picked first by recency-corrected score
RECENCY_MAX_SLOPE = 2.0  # the steepest recency trend recency_corrected removes: score ~ d^-2


@dataclass
class FillOutput:
    """What filled-row prefill of one prompt produced (see the module docstring).

    Row-indexed tensors cover every prompt row in position order. ``keys[l]`` / ``values[l]``
    are layer l's KV-cache rows as written (keys after k-norm and RoPE; at late layers filled
    rows hold the filled K and the rescaled filled V), ``[N, n_head_kv, head_dim]``, or None for
    a Gated DeltaNet layer. ``layer_inputs[l]`` is what each row fed into layer l: the exact input
    for exact rows and for every row below S, the predicted input x̂_l for filled rows at l ≥ S.
    """

    tokens: list[int]
    positions: torch.Tensor  # [N] int64
    split: int
    tail: int  # min(T, N)
    roles: torch.Tensor  # [N] int8: ROLE_FILLED / ROLE_EXACT / ROLE_TAIL
    active: bool  # False: S = L or N ≤ T, every layer ran exactly on every row
    layer_inputs: torch.Tensor  # [L, N, n_embd]
    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    value_scales: torch.Tensor  # [L - S, n_head_kv]; row i is layer S + i
    n_scale_rows: int  # min(c, T) (0 when the rescale is off or the plan inactive)
    hidden_out: torch.Tensor  # [n_exact, n_embd]: the residual after the last layer, exact rows
    logits: torch.Tensor  # [1, n_vocab] (last row) or [T, n_vocab] (tail rows, tail_logits=True)
    gdn_states: dict[int, "GDNState"] = field(default_factory=dict)  # qwen35: GDN layer -> final state
    #: qwen35, active plans: late GDN layer -> its state after the last prefix row (row N-T-1), before
    #: any terminal-state correction (what ``state_gains`` multiplies)
    boundary_states: dict[int, "GDNState"] = field(default_factory=dict)
    key_scales: torch.Tensor | None = None  # [L - S, n_head_kv] (key_rescale > 0), else None
    probe_scores: torch.Tensor | None = None  # [N]: the probe's scores (probe_queries > 0 / probe_fill_forward)
    n_probe: int = 0  # rows of the probe pass counted in the compute ratio (probe_fill_forward)

    @property
    def last_logits(self) -> torch.Tensor:
        return self.logits[-1]

    @property
    def exact_rows(self) -> torch.Tensor:
        return torch.nonzero(self.roles != ROLE_FILLED).flatten()

    @property
    def filled_rows(self) -> torch.Tensor:
        return torch.nonzero(self.roles == ROLE_FILLED).flatten()

    @property
    def late_layers(self) -> range:
        return range(self.split, len(self.keys))

    def value_scale(self, il: int) -> torch.Tensor:
        """s_{l,h} of late layer `il`, [n_head_kv]."""
        return self.value_scales[il - self.split]

    @property
    def compute_ratio(self) -> float:
        """docs/design.md §4's ceiling r = S/L + (1 - S/L)·(T + |E|)/N (map cost not included)."""
        L, N = len(self.keys), len(self.tokens)
        if not self.active:
            return 1.0
        n_exact = int((self.roles != ROLE_FILLED).sum()) + self.n_probe
        return self.split / L + (1 - self.split / L) * n_exact / N


# ------------------------------------------------------------------------------------------------
# the pieces of §4


def row_roles(n_rows: int, tail: int, exact_positions: Sequence[int] = ()) -> torch.Tensor:
    """Roles of the rows 0..n_rows-1: the last `tail` rows ROLE_TAIL, `exact_positions` (in the
    prefix) ROLE_EXACT, every other row ROLE_FILLED."""
    roles = torch.full((n_rows,), ROLE_FILLED, dtype=torch.int8)
    for p in exact_positions:
        if not 0 <= int(p) < n_rows:
            raise ValueError(f"exact position {int(p)} outside the prompt (rows 0..{n_rows - 1})")
        roles[int(p)] = ROLE_EXACT
    roles[max(0, n_rows - tail):] = ROLE_TAIL
    return roles


def predicted_input(oracle: Oracle, maps: "RidgeMaps | None", il: int, split: int,
                    x_split: torch.Tensor) -> torch.Tensor:
    """x̂_l for rows with split-layer states `x_split`: x_S itself at l = S or with identity fill
    (maps None), else ``A_l φ(x_S) + b_l`` (:meth:`RidgeMaps.predict`), in the oracle's dtype."""
    if maps is None or il == split:
        return x_split
    pred = maps.predict(il, x_split.detach().to(torch.float64).numpy())
    return torch.from_numpy(pred).to(oracle.dtype)


def value_scale(oracle: Oracle, il: int, x_exact: torch.Tensor, x_pred: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
    """s_{l,h} = mean ‖V(x_exact)‖ / mean ‖V(x_pred)‖ per KV head, [n_head_kv], over the rows
    given (the first min(c, T) tail rows: their exact inputs at layer l and their predicted ones).
    V is the layer's V projection as its K/V path writes it. A zero denominator gives 1."""
    _, v_exact = oracle.kv_path(il, x_exact, positions)
    _, v_pred = oracle.kv_path(il, x_pred, positions)
    num = v_exact.norm(dim=-1).mean(dim=0)  # [n_head_kv]
    den = v_pred.norm(dim=-1).mean(dim=0)
    one = torch.ones_like(den)
    return torch.where(den > 0, num / torch.where(den > 0, den, one), one)


def key_scale(oracle: Oracle, il: int, x_exact: torch.Tensor, x_pred: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
    """The key analogue of :func:`value_scale` (issue #8's key rescale): mean ‖K(x_exact)‖ /
    mean ‖K(x_pred)‖ per KV head, K as the cache stores it (after k-norm and RoPE; RoPE rotates
    pairs of dimensions, so the norms are those before it). A zero denominator gives 1."""
    k_exact, _ = oracle.kv_path(il, x_exact, positions)
    k_pred, _ = oracle.kv_path(il, x_pred, positions)
    num = k_exact.norm(dim=-1).mean(dim=0)
    den = k_pred.norm(dim=-1).mean(dim=0)
    one = torch.ones_like(den)
    return torch.where(den > 0, num / torch.where(den > 0, den, one), one)


def _check_maps(oracle: Oracle, maps: "RidgeMaps", split: int, n_embd: int) -> None:
    m = maps.meta
    problems = []
    if m.architecture != oracle.arch:
        problems.append(f"architecture {m.architecture!r} (model: {oracle.arch!r})")
    if m.n_layer != oracle.n_layer:
        problems.append(f"n_layer {m.n_layer} (model: {oracle.n_layer})")
    if m.n_embd != n_embd:
        problems.append(f"n_embd {m.n_embd} (model: {n_embd})")
    if m.split_layer != split:
        problems.append(f"split {m.split_layer} (requested: {split})")
    if problems:
        raise ValueError("the ridge maps do not fit this fill: " + "; ".join(problems))


# ------------------------------------------------------------------------------------------------
# the whole prompt


@torch.no_grad()
def fill_forward(oracle: Oracle, tokens: Sequence[int], *, split: int, maps: "RidgeMaps | None" = None,
                 tail: int, exact_positions: Sequence[int] = (), value_rescale: int = DEFAULT_VALUE_RESCALE,
                 key_rescale: int = 0, tail_logits: bool = False, probe_queries: int = 0,
                 fixed: FillOutput | None = None, state_gains: dict[int, torch.Tensor] | None = None,
                 boundary_override: dict[int, "GDNState"] | None = None) -> FillOutput:
    """Filled-row prefill of `tokens` (a fresh sequence, positions 0..N-1), docs/design.md §4.

    `split` S (1..L; S = L is the exact forward), `maps` the ridge maps fitted for S (None:
    identity fill), `tail` T ≥ 1, `exact_positions` the prefix rows kept exact (absolute
    positions, e.g. from :func:`select_attention_rows`), `value_rescale` c (0: off), `key_rescale`
    c_K: the key analogue of the value scale, measured on the first min(c_K, T) tail rows and applied
    to the filled K (0: off, the default; issue #8).
    `tail_logits`: logits of every tail row instead of the last one only.

    The probe selector's two passes (:func:`probe_fill_forward`): `probe_queries` n_q > 0 sums the
    attention the last n_q exact rows pay every row at each full-attention late layer (against the
    cache as it is there, filled rows included) into ``probe_scores``; `fixed` (a probe pass's
    output) gives the filled rows' late-layer K/V and the scales instead of computing them.

    `state_gains` (qwen35): the terminal-state correction, late GDN layer -> per value-head gains
    [n_v_heads]; the layer's recurrent (ssm) state after the last prefix row is multiplied by them
    before the tail rows continue the recurrence (:mod:`ridgefill_cpp.oracle.state_correction`).
    `boundary_override` (qwen35, the splice test of docs/design.md §9): late GDN layer -> the state its tail
    rows start from instead of the one the prefix left (before `state_gains`).
    """
    tokens = [int(t) for t in tokens]
    n, n_layer = len(tokens), oracle.n_layer
    if n == 0:
        raise ValueError("fill_forward: empty token list")
    if not 1 <= split <= n_layer:
        raise ValueError(f"split {split} outside 1..{n_layer} (the model has {n_layer} layers; {n_layer} = no fill)")
    if tail < 1:
        raise ValueError(f"tail {tail}: at least the last row must be exact")
    if value_rescale < 0:
        raise ValueError(f"value_rescale {value_rescale} must be ≥ 0 (0: off)")
    if key_rescale < 0:
        raise ValueError(f"key_rescale {key_rescale} must be ≥ 0 (0: off)")
    tail = min(tail, n)
    x = oracle.embed(tokens)
    if maps is not None:
        _check_maps(oracle, maps, split, x.shape[1])
    roles = row_roles(n, tail, exact_positions)
    positions = torch.arange(n, dtype=torch.long)
    active = split < n_layer and n > tail
    last_exact = split if active else n_layer  # layers 0..last_exact-1 run exactly on all rows

    layer_inputs = torch.empty(n_layer, n, x.shape[1], dtype=x.dtype)
    keys: list[torch.Tensor | None] = [None] * n_layer
    values: list[torch.Tensor | None] = [None] * n_layer
    gdn_states: dict[int, GDNState] = {}
    boundary_states: dict[int, GDNState] = {}
    value_scales = torch.ones(n_layer - split, oracle.n_head_kv, dtype=x.dtype)
    key_scales = torch.ones(n_layer - split, oracle.n_head_kv, dtype=x.dtype) if key_rescale > 0 else None
    probe_scores = torch.zeros(n, dtype=x.dtype) if probe_queries > 0 else None

    # §4.1: layers 0..S-1 run exactly on all rows (all layers when the plan is inactive); this
    # loop is the oracle's exact forward pass, piece by piece
    for il in range(last_exact):
        layer_inputs[il] = x
        if oracle.is_recurrent(il):
            upd = oracle.gdn_update(il, x, keep_row_states=True)
            x = oracle.gdn_layer_output(il, x, upd)
            gdn_states[il] = upd.state
        else:
            keys[il], values[il] = oracle.kv_path(il, x, positions)
            x = oracle.layer_over_cache(il, x, positions, keys[il], values[il], positions)

    exact = torch.nonzero(roles != ROLE_FILLED).flatten()
    if not active:
        return _output(oracle, tokens, positions, split, tail, roles, False, layer_inputs, keys, values,
                       value_scales, 0, x[exact], tail_logits, gdn_states)

    # §4.2-3: the late layers, layer-major. Exact rows carry their hidden state from layer to
    # layer; filled rows only ever have x_S and the predicted inputs made from it.
    filled = torch.nonzero(roles == ROLE_FILLED).flatten()
    x_split = x
    x_exact = x_split[exact]  # [n_exact, n_embd], position order
    n_scale_rows = min(value_rescale, tail)
    scale_rows = torch.arange(n - tail, n - tail + n_scale_rows)  # the first min(c, T) tail rows
    scale_in_exact = torch.searchsorted(exact, scale_rows)  # their index among the exact rows
    n_key_rows = min(key_rescale, tail)
    key_rows = torch.arange(n - tail, n - tail + n_key_rows)
    key_in_exact = torch.searchsorted(exact, key_rows)

    for il in range(split, n_layer):
        x_hat = predicted_input(oracle, maps, il, split, x_split[filled])
        layer_inputs[il, exact] = x_exact
        layer_inputs[il, filled] = x_hat

        if oracle.is_recurrent(il):
            # §4.4: the recurrence runs over every row in position order, each row's input being
            # exact or predicted; only the exact rows read the state out and go on. It runs in two
            # pieces, the prefix and the tail, so that the state at the boundary can be read and
            # corrected (the same row-by-row arithmetic as one piece)
            from .qwen35 import GDNState, GDNUpdate

            b = n - tail
            head = oracle.gdn_update(il, layer_inputs[il, :b], keep_row_states=True)
            boundary_states[il] = head.state
            start = head.state
            if boundary_override is not None and il in boundary_override:
                start = boundary_override[il]
            if state_gains is not None and il in state_gains:
                start = GDNState(conv=start.conv, ssm=start.ssm * state_gains[il].to(x.dtype)[:, None, None])
            rest = oracle.gdn_update(il, layer_inputs[il, b:], state=start, keep_row_states=True)
            upd = GDNUpdate(state=rest.state, q=torch.cat([head.q, rest.q]),
                            row_states=torch.cat([head.row_states, rest.row_states]),
                            beta=torch.cat([head.beta, rest.beta]), g=torch.cat([head.g, rest.g]))
            x_exact = oracle.gdn_layer_output(il, layer_inputs[il], upd, exact)
            gdn_states[il] = upd.state
            continue

        if fixed is not None:
            # the probe pass wrote the filled rows (with its scales): they stay as they are
            k_filled, v_filled = fixed.keys[il][filled], fixed.values[il][filled]
            value_scales[il - split] = fixed.value_scales[il - split]
            if key_scales is not None and fixed.key_scales is not None:
                key_scales[il - split] = fixed.key_scales[il - split]
        # (a) the value scale, from the tail rows' exact and predicted inputs
        elif n_scale_rows > 0:
            x_pred_tail = predicted_input(oracle, maps, il, split, x_split[scale_rows])
            value_scales[il - split] = value_scale(oracle, il, x_exact[scale_in_exact], x_pred_tail, scale_rows)
        if fixed is None:
            s = value_scales[il - split]
            if key_scales is not None and n_key_rows > 0:
                x_pred_key = predicted_input(oracle, maps, il, split, x_split[key_rows])
                key_scales[il - split] = key_scale(oracle, il, x_exact[key_in_exact], x_pred_key, key_rows)
            # (b) filled rows: the layer's own K/V path on x̂_l, V rescaled, into the cache
            k_filled, v_filled = oracle.kv_path(il, x_hat, positions[filled])
            v_filled = v_filled * s[None, :, None]
            if key_scales is not None:
                k_filled = k_filled * key_scales[il - split][None, :, None]
        # exact rows' K/V: the same path on their exact input
        k_exact, v_exact = oracle.kv_path(il, x_exact, positions[exact])
        k_cache = torch.empty(n, *k_exact.shape[1:], dtype=k_exact.dtype)
        v_cache = torch.empty(n, *v_exact.shape[1:], dtype=v_exact.dtype)
        k_cache[filled], v_cache[filled] = k_filled, v_filled
        k_cache[exact], v_cache[exact] = k_exact, v_exact
        keys[il], values[il] = k_cache, v_cache
        if probe_scores is not None and is_full_attention(oracle, il):
            q = exact[-min(probe_queries, len(exact)):]
            w = oracle.attention_weights(il, x_exact[-len(q):], positions[q], k_cache, positions)
            probe_scores += w.sum(dim=(0, 1))
        # (c) exact rows run the rest of the layer over the whole cache
        x_exact = oracle.layer_over_cache(il, x_exact, positions[exact], k_cache, v_cache, positions)

    out = _output(oracle, tokens, positions, split, tail, roles, True, layer_inputs, keys, values,
                  value_scales, n_scale_rows, x_exact, tail_logits, gdn_states)
    out.key_scales = key_scales
    out.probe_scores = probe_scores
    out.boundary_states = boundary_states
    return out


@torch.no_grad()
def probe_fill_forward(oracle: Oracle, tokens: Sequence[int], *, split: int, maps: "RidgeMaps | None" = None,
                       tail: int, fraction: float = DEFAULT_FRACTION, n_queries: int = DEFAULT_N_QUERIES,
                       value_rescale: int = DEFAULT_VALUE_RESCALE, key_rescale: int = 0,
                       tail_logits: bool = False, span: int = DEFAULT_SPAN) -> FillOutput:
    """The `probe` selector (docs/design.md §5) end to end. Probe pass: every prefix row filled (value and
    key scales measured in this pass), the tail runs the late layers against that cache, and the
    last min(n_queries, T) rows' attention at each full-attention late layer scores the rows. The
    top ceil(fraction · prefix) prefix rows are selected (with ``span``: :func:`ranked_rows`); they and the tail then run the late layers
    exactly over the probe's filled rows (their cells are overwritten by the exact K/V). No rows
    selected: the probe pass is the result. ``n_probe`` = T when the second pass ran.
    """
    probe = fill_forward(oracle, tokens, split=split, maps=maps, tail=tail, value_rescale=value_rescale,
                         key_rescale=key_rescale, tail_logits=tail_logits,
                         probe_queries=min(n_queries, tail, len(tokens)))
    if not probe.active:
        return probe
    prefix_len = len(tokens) - probe.tail
    chosen = select_exact_rows(probe.probe_scores, prefix_len, fraction, span, recency=0.0)
    if not chosen:
        return probe
    out = fill_forward(oracle, tokens, split=split, maps=maps, tail=tail, exact_positions=chosen,
                       value_rescale=value_rescale, key_rescale=key_rescale, tail_logits=tail_logits, fixed=probe)
    out.probe_scores = probe.probe_scores
    out.n_probe = probe.tail
    return out


# ------------------------------------------------------------------------------------------------
# the protected selector (docs/design.md §5)

#: row classes of the `protected` selector (the C enum's bits) and the sink rows
CLASS_DIGIT, CLASS_RARE, CLASS_LINE_START, CLASS_SINK = 1, 2, 4, 8
N_SINK = 4


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte-level BPE alphabet: printable bytes stand for themselves, the others are shifted
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def piece_texts(tokens_meta: Sequence[str], tokenizer_model: str) -> list[str]:
    """The text of every vocabulary entry, from the GGUF's ``tokenizer.ggml.tokens`` and
    ``tokenizer.ggml.model``: SentencePiece (``llama``: "▁" is a space, ``<0xNN>`` a byte) or
    byte-level BPE (``gpt2``). Undecodable bytes become U+FFFD."""
    out = []
    if tokenizer_model == "gpt2":
        inv = {c: b for b, c in _bytes_to_unicode().items()}
        for t in tokens_meta:
            out.append(bytes(inv.get(c, 0x3F) for c in t).decode("utf-8", errors="replace"))
        return out
    for t in tokens_meta:
        if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            out.append(bytes([int(t[3:5], 16)]).decode("utf-8", errors="replace"))
        else:
            out.append(t.replace("\u2581", " "))
    return out


def select_protected_rows(tokens: Sequence[int], texts: Sequence[str], control: Sequence[bool], prefix_len: int,
                          fraction: float = DEFAULT_FRACTION, classes: int = CLASS_SINK | CLASS_DIGIT) -> list[int]:
    """The `protected` selector: the prefix rows in one of `classes` (sink: the first N_SINK
    positions; digits: the token's text has a decimal digit; rare: the token occurs once in the
    prompt; line start: the previous token's text ends with a newline; control tokens are in no
    token class), at most ceil(fraction · prefix_len) of them: sink rows first, then digits, then
    rare, then line starts; within a class rarer tokens (fewer occurrences in the prompt) first,
    then earlier rows. `texts`/`control`: per vocabulary entry; positions start at 0."""
    tokens = [int(t) for t in tokens]
    count: dict[int, int] = {}
    for t in tokens:
        count[t] = count.get(t, 0) + 1
    cands = []
    for j in range(min(prefix_len, len(tokens))):
        t = tokens[j]
        cls = CLASS_SINK if j < N_SINK else 0
        if not control[t]:
            if any(c in "0123456789" for c in texts[t]):
                cls |= CLASS_DIGIT
            if count[t] == 1:
                cls |= CLASS_RARE
            if j > 0 and texts[tokens[j - 1]].endswith("\n"):
                cls |= CLASS_LINE_START
        cls &= classes
        if cls:
            rank = next(r for r, c in enumerate((CLASS_SINK, CLASS_DIGIT, CLASS_RARE, CLASS_LINE_START)) if cls & c)
            cands.append((rank, count[t], j))
    cands.sort()
    return sorted(j for _, _, j in cands[:n_selected(prefix_len, fraction)])


def _output(oracle, tokens, positions, split, tail, roles, active, layer_inputs, keys, values, value_scales,
            n_scale_rows, hidden_exact, tail_logits, gdn_states) -> FillOutput:
    # the tail rows are the last `tail` exact rows
    logits = oracle.logits(hidden_exact[-tail:] if tail_logits else hidden_exact[-1:])
    return FillOutput(tokens=tokens, positions=positions, split=split, tail=tail, roles=roles, active=active,
                      layer_inputs=layer_inputs, keys=keys, values=values, value_scales=value_scales,
                      n_scale_rows=n_scale_rows, hidden_out=hidden_exact, logits=logits, gdn_states=gdn_states)


def select_attention_protected_rows(scores: torch.Tensor, tokens: Sequence[int], texts: Sequence[str],
                                    control: Sequence[bool], prefix_len: int, fraction: float = DEFAULT_FRACTION,
                                    classes: int = CLASS_SINK | CLASS_DIGIT, span: int = DEFAULT_SPAN) -> list[int]:
    """The `attention+protected` selector: the protected rows (:func:`select_protected_rows`, at most
    ceil(fraction · prefix_len)), then the other prefix rows by score (:func:`ranked_rows` with
    ``span`` and RECENCY_SHARE; ties: the earlier row) up to ceil(fraction · prefix_len) in all."""
    k = n_selected(prefix_len, fraction)
    chosen = select_protected_rows(tokens, texts, control, prefix_len, fraction, classes)
    return sorted(chosen + ranked_rows(scores, prefix_len, k, span, taken=chosen, recency=RECENCY_SHARE))


# ------------------------------------------------------------------------------------------------
# the attention selector (docs/design.md §5)


def is_full_attention(oracle: Oracle, il: int) -> bool:
    """Whether layer `il` attends to every earlier row (not recurrent, no sliding window)."""
    return not oracle.is_recurrent(il) and oracle.attention_window(il) == 0


def default_selector_layer(oracle: Oracle, split: int) -> int:
    """The layer the `attention` selector measures at: the last full-attention layer below
    `split` (exact there). llama, qwen3: S-1. gemma3: the last global layer below S, since a
    sliding-window layer cannot see rows further back than its window and would never select
    them. qwen35: the last gated-attention layer below S (GDN layers have no attention weights).
    """
    if not 1 <= split <= oracle.n_layer:
        raise ValueError(f"split {split} outside 1..{oracle.n_layer}")
    for il in range(split - 1, -1, -1):
        if is_full_attention(oracle, il):
            return il
    raise ValueError(f"no full-attention layer below split {split} ({oracle.arch}): the attention selector "
                     "needs one; use a deeper split or another selector")


@torch.no_grad()
def attention_scores(oracle: Oracle, tokens: Sequence[int], layer: int,
                     n_queries: int = DEFAULT_N_QUERIES) -> torch.Tensor:
    """Attention each row receives at `layer` from the last `n_queries` prompt rows: the softmax
    probabilities summed over query heads and over those rows, [N] (every row, prefix and tail;
    each query row's probabilities sum to 1 per head, so the total is n_head · min(n_queries, N);
    less with gpt-oss's attention sinks, whose share of each softmax goes to no row).

    Layers 0..layer-1 run exactly on every row (the rows' inputs at `layer` are exact, as they are
    below the split); `layer` must have attention (not a GDN layer).
    """
    tokens = [int(t) for t in tokens]
    n = len(tokens)
    if n == 0:
        raise ValueError("attention_scores: empty token list")
    if not 0 <= layer < oracle.n_layer:
        raise ValueError(f"layer {layer} outside 0..{oracle.n_layer - 1}")
    if n_queries < 1:
        raise ValueError(f"n_queries {n_queries} must be ≥ 1")
    if oracle.is_recurrent(layer):
        raise ValueError(f"layer {layer} is a Gated DeltaNet layer: it has no attention to score rows with")
    positions = torch.arange(n, dtype=torch.long)
    x = oracle.embed(tokens)
    for il in range(layer):
        if oracle.is_recurrent(il):
            x = oracle.gdn_layer_output(il, x, oracle.gdn_update(il, x, keep_row_states=True))
        else:
            k, v = oracle.kv_path(il, x, positions)
            x = oracle.layer_over_cache(il, x, positions, k, v, positions)
    k, _ = oracle.kv_path(layer, x, positions)
    q_rows = positions[max(0, n - n_queries):]
    probs = oracle.attention_weights(layer, x[q_rows], q_rows, k, positions)  # [n_head, n_q, N]
    return probs.sum(dim=(0, 1))


def n_selected(prefix_len: int, fraction: float = DEFAULT_FRACTION) -> int:
    """How many prefix rows the selector keeps: ceil(fraction · prefix_len), with a 1e-9
    tolerance against rounding (0.1 · 30 → 3), within 0..prefix_len."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction {fraction} outside [0, 1]")
    if prefix_len <= 0:
        return 0
    return max(0, min(prefix_len, math.ceil(fraction * prefix_len - 1e-9)))


def span_extent(span: int) -> tuple[int, int]:
    """The rows the span of ``span`` rows around row r covers: r - before .. r + after."""
    if span < 1:
        raise ValueError(f"span {span} must be >= 1")
    before = (span - 1) // 2
    return before, span - 1 - before


def span_ranks(scores: torch.Tensor, prefix_len: int, span: int = 1) -> torch.Tensor:
    """Each prefix row's rank score under span ``span``: the highest score of a prefix row whose span
    (:func:`span_extent`) covers it; span 1: its own score."""
    before, after = span_extent(span)
    sc = scores[:prefix_len]
    return torch.stack([sc[max(0, j - after):j + before + 1].max() for j in range(prefix_len)]) if prefix_len else sc


def recency_slope(scores: torch.Tensor, prefix_len: int) -> float:
    """The slope b of log score on log d, d = prefix_len - j a prefix row's distance from the end of
    the prefix: least squares over the rows after the sinks (j >= N_SINK) whose score is > 0; 0 when
    fewer than two such rows (or one distance) are left. Not clamped."""
    sc = scores[:prefix_len].double()
    j = torch.arange(prefix_len, dtype=torch.float64)
    use = (j >= N_SINK) & (sc > 0)
    if int(use.sum()) < 2:
        return 0.0
    x, y = torch.log(prefix_len - j[use]), torch.log(sc[use])
    vx = ((x - x.mean())**2).sum()
    return float(((x - x.mean())*(y - y.mean())).sum()/vx) if float(vx) > 0 else 0.0


def recency_corrected(scores: torch.Tensor, prefix_len: int, strength: float = 1.0) -> torch.Tensor:
    """The prefix rows' attention scores without their recency trend: each row's score times
    d^(-strength * b), d = prefix_len - j its distance from the end of the prefix and b the
    :func:`recency_slope`, clamped to [-RECENCY_MAX_SLOPE, 0] (a prompt whose scores do not fall
    with distance is left as it is). Strength 1 ranks a row by its score over what a row at its
    distance gets on average (a power law fitted on the prompt's own scores); 0 leaves the scores
    unchanged."""
    sc = scores[:prefix_len].double()
    logd = torch.log(prefix_len - torch.arange(prefix_len, dtype=torch.float64))
    b = min(0.0, max(-RECENCY_MAX_SLOPE, recency_slope(scores, prefix_len)))
    return (sc*torch.exp(-strength*b*logd)).to(scores.dtype)


def rows_by_score(scores: torch.Tensor, prefix_len: int, span: int = 1) -> list[int]:
    """Prefix rows by :func:`span_ranks` (highest first), then by their own score, then earlier."""
    if scores.shape[0] < prefix_len:
        raise ValueError(f"{scores.shape[0]} scores for a prefix of {prefix_len} rows")
    ranks = span_ranks(scores, prefix_len, span).tolist()
    own = scores[:prefix_len].tolist()
    return sorted(range(prefix_len), key=lambda j: (-ranks[j], -own[j], j))


def ranked_rows(scores: torch.Tensor, prefix_len: int, k: int, span: int = DEFAULT_SPAN,
                taken: Sequence[int] = (), share: float = SPAN_SHARE, recency: float = 0.0) -> list[int]:
    """The rows a scored selector adds to ``taken`` until there are ``k``, from these lists in turn:
    with ``recency`` > 0, rows by span of the :func:`recency_corrected` scores add at most
    ceil(recency · k) (the attention selectors: RECENCY_SHARE); with ``span`` > 1, rows by span
    (:func:`rows_by_score`) add rows until the span lists have added ceil(share · k) (the library's
    share: SPAN_SHARE, the recency rows included); then rows by their own score the rest (span 1:
    by own score alone). Rows already taken are skipped."""
    have, out = set(taken), []

    def add(order: list[int], n_max: int) -> int:
        end, n0 = min(k, len(have) + n_max), len(out)
        for i in order:
            if len(have) >= end:
                break
            if i not in have:
                have.add(i)
                out.append(i)
        return len(out) - n0

    n_recency = add(rows_by_score(recency_corrected(scores, prefix_len), prefix_len, span),
                    n_selected(k, recency)) if recency > 0 else 0
    if span > 1:
        add(rows_by_score(scores, prefix_len, span), max(0, n_selected(k, share) - n_recency))
    add(rows_by_score(scores, prefix_len, 1), k)
    return out


def select_exact_rows(scores: torch.Tensor, prefix_len: int, fraction: float = DEFAULT_FRACTION,
                      span: int = DEFAULT_SPAN, recency: float = RECENCY_SHARE) -> list[int]:
    """The top :func:`n_selected` (k = ceil(fraction · prefix_len)) prefix rows by score, as sorted
    positions. Only rows 0..prefix_len-1 compete; ties go to the earlier position. First
    ceil(recency · k) of them by the :func:`recency_corrected` scores, as spans (the attention
    selectors' RECENCY_SHARE; the probe's scores pass 0); ``span`` > 1: up to ceil(SPAN_SHARE · k)
    in spans, those included, by the highest score within the span around them
    (:func:`rows_by_score`), so the span around each top-scoring row is kept whole; the rest by
    their own score (:func:`ranked_rows`)."""
    k = n_selected(prefix_len, fraction)
    if k == 0:
        return []
    return sorted(ranked_rows(scores, prefix_len, k, span, recency=recency))


def select_attention_rows(oracle: Oracle, tokens: Sequence[int], *, split: int, tail: int,
                          fraction: float = DEFAULT_FRACTION, n_queries: int = DEFAULT_N_QUERIES,
                          layer: int | None = None, span: int = DEFAULT_SPAN) -> list[int]:
    """The `attention` selector end to end: score at `layer` (default
    :func:`default_selector_layer`), keep the top ceil(fraction · prefix) prefix rows (with a span:
    :func:`ranked_rows`)."""
    layer = default_selector_layer(oracle, split) if layer is None else layer
    prefix_len = max(0, len(tokens) - tail)
    if prefix_len == 0 or n_selected(prefix_len, fraction) == 0:
        return []
    return select_exact_rows(attention_scores(oracle, tokens, layer, n_queries), prefix_len, fraction, span)

"""Terminal-state correction for Gated DeltaNet late layers (qwen35; issue #5), on the oracle.

Filled rows feed a late GDN layer's recurrence with predicted inputs x̂_l, so its state at the
prefix/tail boundary (after row N-T-1) carries their errors into every tail row. docs/design.md §4 item 4
asks for a correction of that state toward the exact one before the tail runs; the paper does
not say how. The estimator here needs no training and no extra rows at prefill time:

**Per-head state gain.** For late GDN layer l and value head h, the boundary state is a matrix
M_h (D_v × D_k). The correction is M_h ← g_{l,h} · M_h, with g fitted in closed form on calibration
text as the least-squares gain from the filled to the exact boundary state over windows w:

    g_{l,h} = Σ_w ⟨M^exact_{w,l,h}, M^fill_{w,l,h}⟩_F / Σ_w ‖M^fill_{w,l,h}‖²_F

Why a gain: the state is a decayed sum of rank-one updates β_t (v_t − M k_t) k_tᵀ. A predicted
input that is a shrunken or noisier version of the exact one (ridge regression shrinks toward the
mean) changes the size of the v and k the filled rows write more systematically than their
direction, and the same shrinkage shows in every window; a gain per head absorbs the systematic
part and leaves the window-specific part alone (it is the value-scale idea of docs/design.md §4.3a, for the
state). It costs one multiply per state element at the boundary and n_v_heads numbers per late GDN
layer in the map file. The conv state (the last d_conv-1 conv inputs) is left as it is: it covers
three rows and is overwritten by the first tail rows.

The gains are fitted with the same selector, split, tail and maps as prefill uses; a window's
exact boundary state comes from the same plan with every prefix row exact (the late-layer code
path of :func:`~ridgefill_cpp.oracle.fill.fill_forward`, equal to the exact forward to rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from .common import Oracle
from .fill import DEFAULT_FRACTION, FillOutput, fill_forward, select_attention_rows

if TYPE_CHECKING:
    from ..maps.mapfile import RidgeMaps


def late_gdn_layers(oracle: Oracle, split: int) -> list[int]:
    """The Gated DeltaNet layers at or above the split (the ones a correction applies to)."""
    return [il for il in range(split, oracle.n_layer) if oracle.is_recurrent(il)]


def _plan(oracle: Oracle, tokens: Sequence[int], split: int, maps, tail: int, fraction: float) -> list[int]:
    if fraction <= 0:
        return []
    return select_attention_rows(oracle, tokens, split=split, tail=tail, fraction=fraction)


@dataclass
class BoundaryPair:
    """One window's filled and exact boundary states, late GDN layer -> ssm [n_v_heads, D_v, D_k]."""

    filled: dict[int, torch.Tensor]
    exact: dict[int, torch.Tensor]


@torch.no_grad()
def boundary_pair(oracle: Oracle, tokens: Sequence[int], *, split: int, maps: "RidgeMaps | None" = None,
                  tail: int, fraction: float = DEFAULT_FRACTION, value_rescale: int = 512) -> BoundaryPair:
    """The boundary states of one window under the plan (filled) and with every prefix row exact."""
    tokens = [int(t) for t in tokens]
    if len(tokens) <= tail:
        raise ValueError(f"a window of {len(tokens)} tokens has no prefix before a tail of {tail}")
    chosen = _plan(oracle, tokens, split, maps, tail, fraction)
    filled = fill_forward(oracle, tokens, split=split, maps=maps, tail=tail, exact_positions=chosen,
                          value_rescale=value_rescale)
    exact = fill_forward(oracle, tokens, split=split, maps=maps, tail=tail,
                         exact_positions=range(len(tokens) - tail), value_rescale=value_rescale)
    return BoundaryPair(filled={il: st.ssm for il, st in filled.boundary_states.items()},
                        exact={il: st.ssm for il, st in exact.boundary_states.items()})


def gains_from_pairs(pairs: Sequence[BoundaryPair]) -> dict[int, torch.Tensor]:
    """The least-squares per-head gains of the module docstring over the windows' pairs."""
    if not pairs:
        raise ValueError("no calibration windows")
    gains = {}
    for il in pairs[0].filled:
        num = sum((p.exact[il] * p.filled[il]).sum(dim=(1, 2)) for p in pairs)
        den = sum((p.filled[il] * p.filled[il]).sum(dim=(1, 2)) for p in pairs)
        gains[il] = torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.ones_like(den))
    return gains


@torch.no_grad()
def fit_state_gains(oracle: Oracle, windows: Sequence[Sequence[int]], *, split: int, maps: "RidgeMaps | None" = None,
                    tail: int, fraction: float = DEFAULT_FRACTION, value_rescale: int = 512) -> dict[int, torch.Tensor]:
    """Per-head gains of every late GDN layer, fitted on calibration ``windows`` (token lists, BOS
    first, each longer than ``tail``) with the plan prefill would use."""
    if not late_gdn_layers(oracle, split):
        return {}
    return gains_from_pairs([boundary_pair(oracle, w, split=split, maps=maps, tail=tail, fraction=fraction,
                                           value_rescale=value_rescale) for w in windows])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖_F / ‖b‖_F."""
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


@dataclass
class CorrectionReport:
    """Relative state errors (‖M − M_exact‖_F / ‖M_exact‖_F, per late GDN layer) without and with the
    correction, at the boundary and after the tail, and the last-row logit KL to the exact forward."""

    boundary_without: dict[int, float]
    boundary_with: dict[int, float]
    final_without: dict[int, float]
    final_with: dict[int, float]
    kl_without: float
    kl_with: float


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p, -1), torch.log_softmax(q, -1)
    return float((lp.exp() * (lp - lq)).sum())


@torch.no_grad()
def evaluate_correction(oracle: Oracle, tokens: Sequence[int], gains: dict[int, torch.Tensor], *, split: int,
                        maps: "RidgeMaps | None" = None, tail: int, fraction: float = DEFAULT_FRACTION,
                        value_rescale: int = 512) -> CorrectionReport:
    """What the correction does to one held-out prompt: boundary and final state errors and the
    last-row KL to the exact forward, without and with ``gains``."""
    tokens = [int(t) for t in tokens]
    chosen = _plan(oracle, tokens, split, maps, tail, fraction)
    kw = dict(split=split, maps=maps, tail=tail, exact_positions=chosen, value_rescale=value_rescale)
    plain: FillOutput = fill_forward(oracle, tokens, **kw)
    corrected: FillOutput = fill_forward(oracle, tokens, **kw, state_gains=gains)
    exact = fill_forward(oracle, tokens, split=split, maps=maps, tail=tail, exact_positions=range(len(tokens) - tail),
                         value_rescale=value_rescale)
    ref = oracle.forward(tokens, last_only=True)
    layers = late_gdn_layers(oracle, split)
    return CorrectionReport(
        boundary_without={il: relative_error(plain.boundary_states[il].ssm, exact.boundary_states[il].ssm) for il in layers},
        boundary_with={il: relative_error(plain.boundary_states[il].ssm * gains[il][:, None, None],
                                          exact.boundary_states[il].ssm) for il in layers},
        final_without={il: relative_error(plain.gdn_states[il].ssm, ref.gdn_states[il].ssm) for il in layers},
        final_with={il: relative_error(corrected.gdn_states[il].ssm, ref.gdn_states[il].ssm) for il in layers},
        kl_without=_kl(ref.logits[-1], plain.last_logits),
        kl_with=_kl(ref.logits[-1], corrected.last_logits),
    )

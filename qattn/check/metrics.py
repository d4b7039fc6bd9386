"""Error metrics, one definition used by tests, emulators, the probe and the parity tool (DESIGN §3)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .reference import to_numpy


@dataclass(frozen=True)
class Errors:
    max_rel: float  # max over rows of max|O - R| / max|R| in that row
    rel_l2: float  # ||O - R||_2 / ||R||_2
    cos: float  # cosine similarity of the flattened tensors
    nonfinite: int  # NaN/Inf elements in O
    worst_index: tuple  # index of the largest |O - R| within the worst row

    def as_dict(self) -> dict:
        return asdict(self)


def compare(out, ref) -> Errors:
    """Compare an output with its reference; the last axis is the row's feature axis."""
    o = to_numpy(out).astype(np.float64)
    r = to_numpy(ref).astype(np.float64)
    if o.shape != r.shape:
        raise ValueError(f"out: shape {o.shape} does not match the reference's {r.shape}")
    nonfinite = int(np.count_nonzero(~np.isfinite(o)))
    diff = np.abs(np.nan_to_num(o - r, nan=np.inf, posinf=np.inf, neginf=np.inf))
    row_scale = np.abs(r).max(axis=-1, keepdims=True)
    tiny = np.finfo(np.float64).tiny
    with np.errstate(invalid="ignore", divide="ignore"):
        row_err = np.where(diff.max(axis=-1, keepdims=True) == 0, 0.0,
                           diff.max(axis=-1, keepdims=True) / np.maximum(row_scale, tiny))
    worst_row = np.unravel_index(int(np.argmax(row_err)), row_err.shape)
    worst_col = int(np.argmax(diff[worst_row[:-1]]))
    worst = tuple(int(i) for i in worst_row[:-1]) + (worst_col,)
    ref_norm = float(np.linalg.norm(r))
    err_norm = float(np.linalg.norm(np.where(np.isfinite(o), o - r, np.inf)))
    out_norm = float(np.linalg.norm(np.nan_to_num(o)))
    if ref_norm == 0:
        rel_l2 = 0.0 if err_norm == 0 else float("inf")
    else:
        rel_l2 = err_norm / ref_norm
    denom = ref_norm * out_norm
    cos = float(np.vdot(np.nan_to_num(o).ravel(), r.ravel()) / denom) if denom > 0 else float(ref_norm == out_norm)
    if nonfinite:
        cos = float("nan")
    return Errors(max_rel=float(row_err.max()), rel_l2=rel_l2, cos=cos, nonfinite=nonfinite, worst_index=worst)


def failures(out, ref, max_rel: float) -> int:
    """Rows whose max relative error exceeds max_rel, plus rows holding a NaN/Inf."""
    o = to_numpy(out).astype(np.float64)
    r = to_numpy(ref).astype(np.float64)
    diff = np.abs(o - r)
    scale = np.maximum(np.abs(r).max(axis=-1), np.finfo(np.float64).tiny)
    bad = ~np.isfinite(o).all(axis=-1)
    with np.errstate(invalid="ignore"):
        bad |= np.nan_to_num(diff, nan=np.inf).max(axis=-1) > max_rel * scale
    return int(np.count_nonzero(bad))


def kl_rows(p_ref, p) -> np.ndarray:
    """KL(P_ref || P) per probability row (last axis); zero-probability reference entries add 0."""
    pr = to_numpy(p_ref).astype(np.float64)
    pq = to_numpy(p).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(pr > 0, pr * (np.log(pr) - np.log(np.maximum(pq, np.finfo(np.float64).tiny))), 0.0)
    return terms.sum(axis=-1)


def mass_below(p, floor: float) -> np.ndarray:
    """Fraction of each probability row's mass carried by entries below floor."""
    pr = to_numpy(p).astype(np.float64)
    total = pr.sum(axis=-1)
    return np.where(total > 0, np.where(pr < floor, pr, 0.0).sum(axis=-1) / np.maximum(total, 1e-300), 0.0)


def mass_histogram(p, edges) -> np.ndarray:
    """Fraction of each probability row's mass whose entries fall in each bin
    [edges[i], edges[i+1]) (values past either end count in the end bins); shape
    [..., len(edges) - 1]."""
    pr = to_numpy(p).astype(np.float64)
    edges = np.asarray(edges, dtype=np.float64)
    index = np.clip(np.searchsorted(edges, pr, side="right") - 1, 0, len(edges) - 2)
    bins = np.stack([np.where(index == i, pr, 0.0).sum(axis=-1) for i in range(len(edges) - 1)], axis=-1)
    total = pr.sum(axis=-1, keepdims=True)
    return np.where(total > 0, bins / np.maximum(total, 1e-300), 0.0)

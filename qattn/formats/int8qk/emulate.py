"""The int8-QK recipes' emulator products (check/emulate.py runs the flash loop): int8 Q and K̃ codes
per scale group with exact int32 products, PV in fp16, int8 (P static 127) or e4m3 (P static 448).
e4m3·e4m3 tile products are exact in float64 (8-bit significands over 36 binades) and are rounded to
float32 once per tile: the two-level accumulation of DESIGN §2.

Options: block_m (query rows per Q scale block, 128), q_granularity / k_granularity ("block",
"warp", "thread"; see quant), warps (4), smoothing ("mean": K̄ subtracted; "mean+balance": then Q's
and K̃'s channels balanced by quant.balance_factors; None: K quantized as given, so the LSE has no
q·K̄ to add back), alpha_rule (the balancing factors' rule: quant.ALPHA_RULES) and smooth_k, the
deprecated alias of smoothing (True: "mean", False: None)."""
from __future__ import annotations

import numpy as np

from ...check import quant as common
from ...check.emulate import F32, Tiles, exact, to_f32_acc
from . import quant

FORMATS = ("i8-f16", "i8-i8", "i8-f8")


def _int8_qk(lay, q, k, scale, block_n, block_m, q_granularity, k_granularity, warps, smoothing, alpha_rule):
    """int8 QK after the smoothing (see the module docstring): returns (scores, lse_shift). Balancing
    scales Q's channels up and K̃'s down by the same α, so the scores keep q̃·K̃ and the shift q̃·K̄."""
    q2 = common.fold_softmax_scale(q, scale)
    q_in, k_in, k_mean = quant.smooth(q2, k, smoothing, alpha_rule)
    q8 = quant.quantize_int8(q_in, block_m, granularity=q_granularity, warps=warps, operand="q")
    k8 = quant.quantize_int8(k_in, block_n, granularity=k_granularity, warps=warps, operand="k")
    qc, qs = exact(lay.q(q8.codes)), lay.q(q8.scale)
    kc, ks = exact(lay.kv(k8.codes)), lay.kv(k8.scale)

    def scores(j0, j1):
        s_int = qc @ kc[..., j0:j1, :].swapaxes(-1, -2)
        return to_f32_acc(s_int) * qs * ks[..., j0:j1, 0][..., None, :]

    shift = (lay.q(q2) @ lay.kv(k_mean).swapaxes(-1, -2))[..., 0]
    return scores, shift


def _int8_pv_tiles(pv_format):
    def build(lay, q, k, v, scale, block_n, *, block_m=128, q_granularity="block", k_granularity="block", warps=4,
              smoothing=quant.UNSET, alpha_rule=quant.DEFAULT_ALPHA_RULE, smooth_k=None):
        smoothing = quant.smoothing_option(smoothing, smooth_k, quant.default_smoothing(np.shape(k)[-2]))
        if alpha_rule not in quant.ALPHA_RULES:
            raise ValueError(f"alpha_rule: expected one of {quant.ALPHA_RULES}, got {alpha_rule!r}")
        scores, shift = _int8_qk(lay, q, k, scale, block_n, block_m, q_granularity, k_granularity, warps,
                                 smoothing, alpha_rule)
        if pv_format == "f16":
            v16 = lay.kv(np.asarray(v, F32).astype(np.float16).astype(F32))

            def pv(p, j0, j1):
                return p.astype(np.float16).astype(F32) @ v16[..., j0:j1, :]
        else:
            if pv_format == "i8":
                v8, p_scale, quantize_p = quant.quantize_v_int8(v), common.INT8_MAX, quant.quantize_p_int8
            else:
                v8, p_scale, quantize_p = quant.quantize_v_e4m3(v), common.E4M3_MAX, quant.quantize_p_e4m3
            vc = exact(lay.kv(v8.codes))
            out_scale = (lay.kv(v8.scale) / F32(p_scale)).astype(F32)

            def pv(p, j0, j1):  # one tile's product in fp32, added to the fp32 accumulator
                return to_f32_acc(exact(quantize_p(p)) @ vc[..., j0:j1, :]) * out_scale

        return Tiles(scores, pv, lse_shift=shift)

    return build


EMULATORS = {fmt: _int8_pv_tiles(pv) for fmt, pv in zip(FORMATS, ("f16", "i8", "f8"))}

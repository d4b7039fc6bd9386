"""The peers timed beside qattn in the same run: torch SDPA's flash and cuDNN backends, SageAttention
1.0.6 and SageAttention2, each as a callable on torch tensors (or None where its library is missing)."""
from __future__ import annotations


PEERS = ("sdpa_flash", "sdpa_cudnn", "sageattn", "sageattn2")


def sageattention2():
    """SageAttention2 (CUDA kernels built from source), or None: the module sageattention2 (its
    package folder renamed, so that it imports beside SageAttention 1.0.6 from PyPI), else
    sageattention itself when that is version 2 (it has the fp8-PV CUDA entry points)."""
    import importlib

    for name in ("sageattention2", "sageattention"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "sageattn_qk_int8_pv_fp8_cuda"):
            return module
    return None


def peer(name: str):
    """A callable (q, k, v, causal) -> out for a peer on torch tensors, or None where its library is
    missing: torch SDPA on one backend, SageAttention's sageattn (1.0.6: int8 QK, fp16 PV, K
    smoothing), or SageAttention2's sageattn ("sageattn2": on sm_90 its wgmma kernel, int8 QK and
    fp8 PV; only where it is not the package "sageattn" already runs)."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if name in ("sageattn", "sageattn2"):
        try:
            import sageattention
        except ImportError:
            sageattention = None
        module = sageattention if name == "sageattn" else sageattention2()
        if module is None or (name == "sageattn2" and module is sageattention):
            return None
        return lambda q, k, v, causal: module.sageattn(q, k, v, tensor_layout="HND", is_causal=causal)
    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[name]

    def run(q, k, v, causal):
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                    enable_gqa=q.shape[1] != k.shape[1])
    return run

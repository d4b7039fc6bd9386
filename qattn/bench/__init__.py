"""Timing qattn beside its peers: CUDA-event timers, the peers, the prefill benchmark."""

"""How a number earns trust: the FP64 reference, the metrics, the emulators' flash loop, the parity job
and the probe (DESIGN §3)."""

"""The format families, one folder each; importing this package registers them all, in this order
(the order of `qattn list` and of the parity job's default formats)."""
from . import dense, int8qk, kv8, decode  # noqa: F401  (one line per family: adding a family is adding it here)

"""`qattn tune`: sweep a format's tiles on the local GPU and store the fastest (docs/tune.md).

candidates (which tiles), build (compiling them in parallel), case (one shape's inputs, reference and
checked launches on the GPU), sweep (check once, time in interleaved rounds, pick the winner), run
(the whole tune, stored in engine/tuned.py's table), command (the CLI).
"""

"""Compile, cache, load and launch kernels; FP64 reference, CPU emulators and metrics."""

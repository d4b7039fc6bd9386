"""What builds and launches any kernel and knows no format: specs and tiles, the registry the format
families fill, Jinja rendering, compilation (NVRTC, clang), the kernel cache, Kernel and its launch plans,
array interop."""

"""Triton kernels and their host-side schedulers. Autograd wiring lives in `opengem.ops`."""

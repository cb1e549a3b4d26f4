"""Plain fp32 PyTorch versions of every op: the specification the kernels are tested against."""

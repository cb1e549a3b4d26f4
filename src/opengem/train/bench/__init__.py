"""Speed benchmarks of the training stack: `opengem bench train | layers | plot` (GEM_SPEC section 8)."""

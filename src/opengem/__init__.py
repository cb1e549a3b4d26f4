"""opengem: a training stack for GEM-style generative recommendation models."""

__version__ = "0.1.0"

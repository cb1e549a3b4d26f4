"""Training: trainer loop, metrics, FLOP/MFU accounting, checkpointing."""

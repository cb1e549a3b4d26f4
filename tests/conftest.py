"""Without a GPU, Triton kernels run in Triton's CPU interpreter.

Set before anything imports triton: importing torch.utils.flop_counter (done by every op that registers
a FLOP formula) loads triton.language, and the interpreter flag is read at that point.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

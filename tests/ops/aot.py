"""Run a script in a Python without ``TRITON_INTERPRET``: ahead-of-time compiles for sm_90 on a CPU machine
(Triton's frontend and ptxas need no GPU; the interpreter replaces ``triton.jit`` kernels at import)."""

import os
import subprocess
import sys
from pathlib import Path


def run_compiled(script: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = Path(__file__).resolve().parents[2] / "src"
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          check=False)

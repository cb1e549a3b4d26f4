"""Make Triton 3.6's interpreter run loops with tensor bounds under NumPy >= 2.3.

The interpreter stores scalars as 1-element arrays and converts them with ``int(array)``, which NumPy
2.3 turned into a TypeError; ``range(lo, hi)`` with bounds loaded from memory then fails. Patch the
conversion to ``.item()``. Import this module after setting ``TRITON_INTERPRET=1``.
"""

import triton.runtime.interpreter as interpreter

_original_patch = interpreter._patch_lang_tensor


def _patch_lang_tensor(tensor, scope) -> None:
    _original_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_lang_tensor

import pytest
import torch

from opengem.jagged import Jagged
from opengem.nn.layers import JaggedTransformerLayer


def test_jagged_transformer_layer_refuses_inputs_naming_the_expected_type_and_width():
    layer = JaggedTransformerLayer(32, 2)
    # a plain tensor had failed in layer_norm on its ``values`` method
    with pytest.raises(TypeError, match=r"JaggedTransformerLayer: x must be a Jagged \[T, d_model\] batch, got Tensor"):
        layer(torch.randn(5, 32))
    with pytest.raises(ValueError, match=r"x.values must be \[T, d_model = 32\], got \(5, 16\)"):
        layer(Jagged.from_lengths(torch.randn(5, 16), torch.tensor([2, 3])))
    assert layer(Jagged.from_lengths(torch.randn(5, 32), torch.tensor([2, 3]))).values.shape == (5, 32)

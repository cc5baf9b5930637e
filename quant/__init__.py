"""bitrl.quant: number formats (FP8, MXFP8, MXFP4, NVFP4), quantized tensors and linear layers, model
quantization, error analysis and corrections."""

from .formats import E2M1, E4M3, E5M2, E8M0, FORMATS, ElementFormat, ScaledFormat, get_format
from .linear import QuantLinear, quantize_model, requantize_
from .quantize import fake_quantize, quantize
from .tensor import QuantizedTensor

__all__ = [
    "E2M1",
    "E4M3",
    "E5M2",
    "E8M0",
    "FORMATS",
    "ElementFormat",
    "QuantLinear",
    "QuantizedTensor",
    "ScaledFormat",
    "fake_quantize",
    "get_format",
    "quantize",
    "quantize_model",
    "requantize_",
]

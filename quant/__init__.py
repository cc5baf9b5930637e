"""bitrl.quant: number formats (FP8, MXFP8, MXFP4, NVFP4), quantized tensors and linear layers, model
quantization, error analysis and corrections.

    from bitrl.quant import quantize, quantize_model, requantize_, error_decomposition

    qt = quantize(w, "mxfp4")                  # QuantizedTensor: packed codes + E8M0 scales
    w_hat = qt.dequantize(torch.bfloat16)
    parts = error_decomposition(w, "mxfp4")    # scale_bias + deadzone + grid_noise == w_hat - w, exactly
    rollout = quantize_model(copy.deepcopy(policy), "nvfp4", source=policy)
    requantize_(rollout, policy)               # after each optimizer step: only what changed
"""

from .analysis import (
    ErrorDecomposition,
    error_decomposition,
    ideal_quantization,
    quantize_macroblock,
    quantize_outlier_fallback,
)
from .aqn import AQN, AQNSchedule
from .formats import E2M1, E4M3, E5M2, E8M0, FORMATS, ElementFormat, ScaledFormat, get_format
from .linear import QuantLinear, quantize_model, requantize_
from .quantize import fake_quantize, quantize
from .tensor import QuantizedTensor

__all__ = [
    "AQN",
    "AQNSchedule",
    "E2M1",
    "E4M3",
    "E5M2",
    "E8M0",
    "FORMATS",
    "ElementFormat",
    "ErrorDecomposition",
    "QuantLinear",
    "QuantizedTensor",
    "ScaledFormat",
    "error_decomposition",
    "fake_quantize",
    "get_format",
    "ideal_quantization",
    "quantize",
    "quantize_macroblock",
    "quantize_model",
    "quantize_outlier_fallback",
    "requantize_",
]

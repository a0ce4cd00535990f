"""manyeyes' model core: our own multi-head attention, GPT and BERT stacks, loaders and tokenizer."""

from manyeyes.model.attention import AttentionOutput, Capture, MultiHeadAttention
from manyeyes.model.errors import CorruptFileError, ModelLoadError, TooLongError
from manyeyes.model.loading import load
from manyeyes.model.runtime import AttentionModel, AttentionResult, ModelInfo, Prediction, pick_device

__all__ = [
    "AttentionModel",
    "AttentionOutput",
    "AttentionResult",
    "Capture",
    "CorruptFileError",
    "ModelInfo",
    "ModelLoadError",
    "MultiHeadAttention",
    "Prediction",
    "TooLongError",
    "load",
    "pick_device",
]

"""manyeyes' model core: our own multi-head attention, GPT and BERT stacks, loaders and tokenizer."""

from model.attention import AttentionOutput, Capture, MultiHeadAttention
from model.errors import ModelLoadError, TooLongError
from model.loading import load
from model.runtime import AttentionModel, AttentionResult, ModelInfo, pick_device

__all__ = [
    "AttentionModel",
    "AttentionOutput",
    "AttentionResult",
    "Capture",
    "ModelInfo",
    "ModelLoadError",
    "MultiHeadAttention",
    "TooLongError",
    "load",
    "pick_device",
]

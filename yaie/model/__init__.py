"""Models the engine runs: configuration, checkpoint loading, the Llama-family decoder, the tokenizer."""

from yaie.model.config import ModelConfig, ModelLoadError, load_config
from yaie.model.llama import LlamaModel
from yaie.model.tokenizer import StreamDecoder, Tokenizer

__all__ = ["LlamaModel", "ModelConfig", "ModelLoadError", "StreamDecoder", "Tokenizer", "load_config"]

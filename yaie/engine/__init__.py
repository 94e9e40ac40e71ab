"""The YAIE inference engine: ``LLM(model).generate(prompts, SamplingParams(...))`` and ``yaie generate``."""

from yaie.engine.kv_cache import ContiguousKVCache
from yaie.engine.llm import DEFAULT_MODEL, LLM, CompletionOutput, RequestOutput
from yaie.engine.sampling import SamplingParams

__all__ = ["ContiguousKVCache", "CompletionOutput", "DEFAULT_MODEL", "LLM", "RequestOutput", "SamplingParams"]

"""The YAIE inference engine: ``LLM(model).generate(prompts, SamplingParams(...))`` and ``yaie generate``."""

from yaie.engine.kv_cache import ContiguousKVCache
from yaie.engine.llm import DEFAULT_MODEL, LLM, CompletionOutput, RequestOutput
from yaie.engine.sampling import SamplingParams
from yaie.engine.scheduler import Request, Scheduler

__all__ = ["ContiguousKVCache", "CompletionOutput", "DEFAULT_MODEL", "LLM", "Request", "RequestOutput",
           "SamplingParams", "Scheduler"]

"""The YAIE inference engine: ``LLM(model).generate(prompts, SamplingParams(...))`` and ``yaie generate``."""

from yaie.engine.llm import DEFAULT_MODEL, LLM
from yaie.engine.output import CompletionOutput, RequestOutput
from yaie.engine.request import Request
from yaie.engine.sampling import SamplingParams
from yaie.engine.scheduler import Scheduler
from yaie.model.contiguous_cache import ContiguousKVCache

__all__ = ["ContiguousKVCache", "CompletionOutput", "DEFAULT_MODEL", "LLM", "Request", "RequestOutput",
           "SamplingParams", "Scheduler"]

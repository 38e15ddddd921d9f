"""weir's offline Python API: `from weir import LLM, SamplingParams`."""

from core.sampling import SamplingParams
from weir.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

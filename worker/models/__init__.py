"""Model implementations, looked up by HF architecture name."""

from worker.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from worker.models.registry import MODEL_REGISTRY, get_model_class

CausalLM = LlamaForCausalLM  # the one model family so far; the type load_model returns

__all__ = [
    "MODEL_REGISTRY",
    "CausalLM",
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "get_model_class",
]

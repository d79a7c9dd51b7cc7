"""Model implementations, looked up by HF architecture name."""

from tandem.worker.models.gemma3 import Gemma3ForCausalLM
from tandem.worker.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from tandem.worker.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from tandem.worker.models.registry import MODEL_REGISTRY, get_model_class

CausalLM = LlamaForCausalLM  # the base every model class extends (Gemma 3's too); the type load_model returns

__all__ = [
    "MODEL_REGISTRY",
    "CausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "get_model_class",
]

"""Model implementations, one file per family; protocol/architectures.py names which class runs each
architecture, and registry.get_model_class finds it."""

from tandem.worker.models.llama import LlamaForCausalLM
from tandem.worker.models.registry import get_model_class

CausalLM = LlamaForCausalLM  # the base every model class extends (Gemma 3's too); the type load_model returns

__all__ = ["CausalLM", "get_model_class"]

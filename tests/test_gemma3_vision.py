"""Gemma 3 with images (HF Gemma3ForConditionalGeneration) on make-model's seeded `gemma3_vision` preset
(launch/vision_model_maker.py, `tiny`: 28-pixel images of 7-pixel patches pooled into 4 tokens, the tiny
Gemma 3 text model): the image encoder's output is transformers' get_image_features, bit for bit near, for
one image and three, through the worker's ops and after the CPU weights are packed; every checkpoint layout
transformers reads loads (the published names, 4.52+'s, what 5's save_pretrained writes) and a weight too
many or too few is refused; the text model runs in the engine as transformers' greedy; the config, sparse as
published ones are, reads as transformers reads it; the processor turns an image into its tokens."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import AutoProcessor, Gemma3Config, Gemma3ForConditionalGeneration

from tandem import SamplingParams
from tandem.kernels.ops import resolve_ops
from tandem.protocol import model_config
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.errors import ModelLoadError
from tandem.protocol.model_config import ModelConfig, read_hf_config
from tandem.protocol.model_info import read_model_info
from tandem.protocol.tokenizer_loader import load_tokenizer
from tandem.worker.layers import ColumnParallelLinear, PackableLinear, QKVParallelLinear, RowParallelLinear
from tandem.worker.loader import load_model
from tandem.worker.model_runner import ModelRunner
from tandem.worker.models.gemma3_mm import Gemma3ForConditionalGeneration as Ours
from tandem.worker.models.siglip import SiglipPatchEmbedding
from tests.encoder_pieces import interleaved
from tests.reference import assert_greedy_parity, greedy
from tests.step_loop import generate

F32 = torch.float32
# Shaped like google/gemma-3-4b-it's config.json: five text fields, the rest transformers' defaults.
PUBLISHED = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:
    return tiny_model("gemma3_vision")


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=F32).eval()


@pytest.fixture(scope="module")
def pixels(model_dir: Path) -> torch.Tensor:
    """Three random images of other sizes than the encoder's, through the model's own image processor."""
    rng = np.random.default_rng(0)
    images = [Image.fromarray((rng.random((20 + 9 * i, 40, 3)) * 255).astype("uint8")) for i in range(3)]
    return AutoProcessor.from_pretrained(model_dir).image_processor(images, return_tensors="pt")["pixel_values"]


def _reference(hf, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf.get_image_features(pixel_values=pixels).pooler_output


@pytest.mark.parametrize("n", [1, 3])
def test_encode_images_is_transformers_get_image_features(model_dir, hf, pixels, n: int) -> None:
    model = load_model(str(model_dir), F32, "cpu")
    assert isinstance(model, Ours)
    want = _reference(hf, pixels[:n])
    got = model.encode_images(pixels[:n])
    assert got.shape == (n, model.mm_tokens_per_image, model.config.hidden_size) == (n, 4, 64)
    assert got.dtype == F32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if n > 1:  # each image its own embeddings
        assert (got[0] - got[1]).abs().max() > 0.01
    model.pack_cpu_weights()  # the weights in the form the worker runs them
    torch.testing.assert_close(model.encode_images(pixels[:n]), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [16, 5])
def test_the_encoding_in_pieces_is_the_encoding(model_dir, hf, pixels, monkeypatch, rows: int) -> None:
    """What the scheduler counts is what the encoder yields: a piece per layer (the tiny encoder's 16
    patches), or with at most 5 patches a piece, one piece for every patch's k and v and 4 blocks of patches
    a layer. Two images' pieces interleaved as steps run them: each equals transformers' encoding of it."""
    monkeypatch.setattr(model_config, "ENCODER_ROWS_PER_PIECE", rows)
    info = read_model_info(model_dir)
    assert (info.image_encoder_pieces, info.image_pieces_per_layer) == ((2, 1) if rows == 16 else (10, 5))
    model = load_model(str(model_dir), F32, "cpu")
    outs, pieces = interleaved([model.image_stages(pixels[i : i + 1]) for i in range(2)])
    assert pieces == info.image_encoder_pieces
    for i in range(2):
        torch.testing.assert_close(outs[i], _reference(hf, pixels[i : i + 1]), rtol=1e-5, atol=1e-6)


def test_every_checkpoint_layout_loads_the_same_weights(model_dir, hf, pixels, tmp_path: Path) -> None:
    published = load_file(model_dir / "model.safetensors")
    assert any(k.startswith("vision_tower.vision_model.") for k in published)
    # transformers 5's save_pretrained of a model it made (of one it loaded it keeps the names it read):
    # vision_tower.* without SigLIP's vision_model level
    saved = tmp_path / "saved"
    made = Gemma3ForConditionalGeneration(hf.config)
    made.load_state_dict(hf.state_dict())
    made.save_pretrained(saved)
    assert not any(".vision_model." in k for k in load_file(saved / "model.safetensors"))
    renamed = tmp_path / "renamed"  # transformers 4.52+'s names
    renamed.mkdir()
    for f in model_dir.glob("*.json"):
        (renamed / f.name).write_bytes(f.read_bytes())
    new = {("model." + k.replace("language_model.model.", "language_model.")): v for k, v in published.items()}
    assert "model.language_model.embed_tokens.weight" in new
    save_file(new, renamed / "model.safetensors", metadata={"format": "pt"})

    base = dict(load_model(str(model_dir), F32, "cpu").named_parameters())
    for d in (saved, renamed):
        other = load_model(str(d), F32, "cpu")
        params = dict(other.named_parameters())
        assert params.keys() == base.keys()
        for name, p in params.items():
            assert torch.equal(p, base[name]), (d.name, name)
        torch.testing.assert_close(other.encode_images(pixels), _reference(hf, pixels), rtol=1e-5, atol=1e-6)
    # and the text model holds transformers' weights (q/k/v fused)
    lm = hf.model.language_model
    assert torch.equal(base["model.embed_tokens.weight"], lm.embed_tokens.weight)
    attn = lm.layers[1].self_attn
    qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(base["model.layers.1.self_attn.qkv_proj.weight"], qkv)
    proj = hf.model.multi_modal_projector.mm_input_projection_weight
    assert torch.equal(base["multi_modal_projector.mm_input_projection.weight"], proj.t())


def test_a_weight_too_many_or_too_few_is_refused(model_dir) -> None:
    hf_cfg = read_hf_config(model_dir)
    cfg = ModelConfig.from_hf(hf_cfg, **Ours.arch_flags(hf_cfg))
    ops = resolve_ops("cpu", F32)
    weights = load_file(model_dir / "model.safetensors")
    Ours(cfg, F32, "cpu", ops).load_weights(weights.items())  # as it is: every weight, none left
    extra = {**weights, "vision_tower.vision_model.head.probe": torch.zeros(1, 1, 32)}
    with pytest.raises(ValueError, match="unexpected weight 'vision_tower.head.probe'"):  # named as loaded
        Ours(cfg, F32, "cpu", ops).load_weights(extra.items())
    for gone in ("vision_tower.vision_model.post_layernorm.bias", "multi_modal_projector.mm_input_projection_weight",
                 "vision_tower.vision_model.encoder.layers.1.self_attn.k_proj.weight",
                 "language_model.model.layers.2.mlp.up_proj.weight"):
        with pytest.raises(ValueError, match="missing"):
            Ours(cfg, F32, "cpu", ops).load_weights((k, v) for k, v in weights.items() if k != gone)


def test_the_encoder_runs_its_linear_layers_through_the_ops(model_dir, pixels) -> None:
    ops = resolve_ops("cpu", F32)
    calls = []

    def linear(x, *args, **kw):
        calls.append(x.shape[0])
        return ops.linear(x, *args, **kw)

    model = load_model(str(model_dir), F32, "cpu", ops=dataclasses.replace(ops, linear=linear))
    tower = model.vision_tower
    layer = tower.encoder.layers[0]
    assert isinstance(tower.embeddings.patch_embedding, SiglipPatchEmbedding)
    assert isinstance(layer.self_attn.qkv_proj, QKVParallelLinear)
    assert isinstance(layer.self_attn.out_proj, RowParallelLinear)
    assert isinstance(layer.mlp.fc1, ColumnParallelLinear) and isinstance(layer.mlp.fc2, RowParallelLinear)
    assert isinstance(model.multi_modal_projector.mm_input_projection, ColumnParallelLinear)
    linears = [m for m in (*tower.modules(), *model.multi_modal_projector.modules()) if isinstance(m, PackableLinear)]
    assert len(linears) == 1 + 4 * 2 + 1  # patches, 2 layers' qkv/out/fc1/fc2, the projection
    model.encode_images(pixels[:2])
    # 16 patches an image through the encoder, 4 pooled tokens an image through the projection
    assert calls == [32] * 9 + [8]


def test_the_text_model_runs_in_the_engine_as_transformers(model_dir) -> None:
    cfg = EngineConfig(model=str(model_dir), dtype="float32", kv_cache_tokens=2048, max_running_requests=4)
    info = read_model_info(cfg.model)
    assert (info.architecture, info.sliding_window, info.image_token_id) == ("Gemma3ForConditionalGeneration",
                                                                            16, 1025)
    runner = ModelRunner(cfg, info)
    assert type(runner.model) is Ours
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 30)]  # the second past the window
    outs = generate(cfg, info, runner, prompts, [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)])
    equal = sum(assert_greedy_parity(outs[f"r{i}"], greedy(model_dir, p, 8), f"prompt {i}")
                for i, p in enumerate(prompts))
    assert equal == len(prompts)


def test_config_reads_as_transformers_reads_it(model_dir) -> None:
    ours = ModelConfig.from_hf(PUBLISHED)
    theirs = Gemma3Config.from_dict(PUBLISHED)
    t, v = theirs.text_config, theirs.vision_config
    assert ours.architecture == "Gemma3ForConditionalGeneration"
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "rms_norm_eps", "sliding_window", "query_pre_attn_scalar",
                  "max_position_embeddings", "final_logit_softcapping"):
        assert getattr(ours, field) == getattr(t, field), field
    assert ours.layer_types == tuple(t.layer_types) and ours.has_sliding_layers
    assert ours.hidden_act == t.hidden_activation and ours.tie_word_embeddings is theirs.tie_word_embeddings is True
    full, local = t.rope_parameters["full_attention"], t.rope_parameters["sliding_attention"]
    assert (ours.rope_theta, ours.local_rope_theta) == (full["rope_theta"], local["rope_theta"]) == (1e6, 1e4)
    assert ours.rope_scaling == {"rope_type": "linear", "factor": 8.0} and ours.local_rope_scaling == {}
    assert ours.eos_token_id == [1, 106]
    vis = ours.vision
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                  "image_size", "patch_size", "hidden_act", "layer_norm_eps"):
        assert getattr(vis, field) == getattr(v, field), field
    assert (vis.image_token_id, vis.boi_token_id, vis.eoi_token_id) == (theirs.image_token_id,
                                                                       theirs.boi_token_id, theirs.eoi_token_id)
    assert (vis.mm_tokens_per_image, vis.patches_per_side, vis.tokens_per_side) == (256, 64, 16)
    text_only = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1,
                 "num_attention_heads": 2, "intermediate_size": 32, "vision_config": PUBLISHED["vision_config"]}
    assert ModelConfig.from_hf(text_only).vision is None  # another architecture's config reads as before
    # the preset's, with the attributes the engine reads off the model
    cfg = ModelConfig.from_hf(read_hf_config(model_dir))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.sliding_window, cfg.vocab_size) == (64, 3, 16, 1088)
    assert (cfg.vision.image_size, cfg.vision.patch_size, cfg.vision.mm_tokens_per_image) == (28, 7, 4)


@pytest.mark.parametrize("field,value,what", [
    ("vision_use_head", True, "vision_config.vision_use_head"),
    ("hidden_act", "relu", "vision_config.hidden_act"),
    ("patch_size", 15, "vision_config.image_size"),
])
def test_a_vision_config_the_encoder_cannot_run_is_refused(field: str, value: object, what: str) -> None:
    bad = {**PUBLISHED, "vision_config": {**PUBLISHED["vision_config"], field: value}}
    with pytest.raises(ModelLoadError, match=what):
        ModelConfig.from_hf(bad)
    with pytest.raises(ModelLoadError, match="mm_tokens_per_image"):
        ModelConfig.from_hf({**PUBLISHED, "mm_tokens_per_image": 255})


def test_the_processor_makes_an_image_its_tokens(model_dir) -> None:
    processor = AutoProcessor.from_pretrained(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    tok = processor.tokenizer
    image_id, boi, eoi = raw["image_token_index"], raw["boi_token_index"], raw["eoi_token_index"]
    assert [tok.image_token_id, tok.boi_token_id, tok.convert_tokens_to_ids(tok.eoi_token)] == [image_id, boi, eoi]
    assert image_id < raw["text_config"]["vocab_size"]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text == "<|im_start|>user\n<start_of_image>What is it?<|im_end|>\n<|im_start|>assistant\n"
    image = Image.fromarray(np.zeros((33, 50, 3), dtype=np.uint8))
    batch = processor(text=text, images=[image], return_tensors="pt")
    assert batch["pixel_values"].shape == (1, 3, 28, 28)
    assert batch["pixel_values"].min() == -1.0  # black, at mean and std 0.5
    ids = batch["input_ids"][0].tolist()
    at = ids.index(boi)
    assert ids[at : at + 6] == [boi] + [image_id] * 4 + [eoi] and ids.count(image_id) == 4
    # the engine's own tokenizer: the image tokens are special, the chat template the same
    engine_tok = load_tokenizer(model_dir)
    assert {"<start_of_image>", "<image_soft_token>", "<end_of_image>"} <= set(engine_tok.all_special_tokens)
    assert engine_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text

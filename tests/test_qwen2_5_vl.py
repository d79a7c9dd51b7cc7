"""Qwen2.5-VL (HF Qwen2_5_VLForConditionalGeneration) on make-model's seeded `qwen2_5_vl` preset
(launch/qwen_vl_model_maker.py, `tiny`: 7-pixel patches merged 2 x 2, windows of 2 x 2 tokens, one of three
blocks attending whole images; the tiny Qwen2 text model): an image of any size encodes as transformers'
get_image_features, images of three sizes one at a time and together, after the CPU weights are packed too;
the multimodal RoPE's positions are transformers' get_rope_index and its rotation transformers'; both
checkpoint layouts load and a weight too many or too few is refused; the text model runs in the engine as
transformers' greedy; the published config reads as transformers reads it; the processor turns an image into
its tokens."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import AutoImageProcessor, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding, apply_rotary_pos_emb

from tandem import SamplingParams
from tandem.kernels.ops import resolve_ops
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.errors import ModelLoadError
from tandem.protocol.model_config import ModelConfig, read_hf_config
from tandem.protocol.model_info import read_model_info
from tandem.protocol.tokenizer_loader import load_tokenizer
from tandem.worker.layers import ColumnParallelLinear, PackableLinear, RowParallelLinear
from tandem.worker.loader import load_model
from tandem.worker.model_runner import ModelRunner
from tandem.worker.models.mrope import apply_mrope, mrope_cos_sin, mrope_positions
from tandem.worker.models.qwen2_5_vision import Qwen2_5_VisionPatchProj
from tandem.worker.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as Ours
from tests import reference
from tests.encoder_pieces import interleaved
from tests.reference import assert_greedy_parity, greedy
from tests.step_loop import generate

F32 = torch.float32
# (height, width) of the test images, and the patch grids the tiny processor makes of them: 6, 12 and 5
# tokens; windows of 2 x 2 tokens, the last row or column of them cut short
SIZES = [(30, 40), (45, 60), (20, 70)]
GRIDS = [[1, 4, 6], [1, 6, 8], [1, 2, 10]]
# Qwen/Qwen2.5-VL-7B-Instruct's config.json: flat, the text model's fields at the top
PUBLISHED = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 128000,
    "max_window_layers": 28, "model_type": "qwen2_5_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064,
}


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:
    return tiny_model("qwen2_5_vl")


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=F32).eval()


@pytest.fixture(scope="module")
def images(model_dir: Path) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Three random images of other sizes through the model's own image processor: each one's pixel rows,
    and their grids."""
    rng = np.random.default_rng(0)
    pil = [Image.fromarray((rng.random((*s, 3)) * 255).astype("uint8")) for s in SIZES]
    out = AutoImageProcessor.from_pretrained(model_dir)(pil, return_tensors="pt")
    grids = out["image_grid_thw"]
    assert grids.tolist() == GRIDS
    return list(out["pixel_values"].split(grids.prod(-1).tolist())), grids


def _reference(hf, pixels: list[torch.Tensor], grids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(hf.get_image_features(pixel_values=torch.cat(pixels), image_grid_thw=grids).pooler_output)


def test_encode_images_is_transformers_get_image_features(model_dir, hf, images) -> None:
    pixels, grids = images
    want = _reference(hf, pixels, grids)
    model = load_model(str(model_dir), F32, "cpu")
    assert isinstance(model, Ours)
    for packed in (False, True):
        if packed:
            model.pack_cpu_weights()  # the weights in the form the worker runs them
        for px, grid, w in zip(pixels, grids.tolist(), want, strict=True):
            got = model.encode_images(px, grid)
            assert got.shape == (model.image_tokens(grid), model.config.hidden_size) == w.shape
            assert got.dtype == F32
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
        # the encoder takes several images at once too (the runs of each length batched)
        torch.testing.assert_close(model.visual(torch.cat(pixels), grids.tolist()), torch.cat(want),
                                   rtol=1e-5, atol=1e-5)
    assert (want[0][0] - want[1][0]).abs().max() > 0.01  # each image its own embeddings
    # about as large as a text token's embedding (make_model's std 0.1 / sqrt(hidden))
    assert 0.003 < float(torch.cat(want).std()) < 0.05
    with pytest.raises(ValueError, match="grid"):
        model.encode_images(pixels[0], [1, 4, 5])
    with pytest.raises(ValueError, match="pixel rows"):
        model.encode_images(pixels[0], [1, 6, 6])


def test_the_encoding_in_pieces_is_the_encoding(model_dir, hf, images) -> None:
    """One piece per encoder block (what the scheduler counts), two images of other sizes interleaved as
    steps run them: each equals transformers' encoding of it."""
    pixels, grids = images
    want = _reference(hf, pixels, grids)
    model = load_model(str(model_dir), F32, "cpu")
    outs, pieces = interleaved([model.image_stages(pixels[i], grids[i].tolist()) for i in range(2)])
    assert pieces == read_model_info(model_dir).image_encoder_pieces == model.config.vision.num_hidden_layers
    for i in range(2):
        torch.testing.assert_close(outs[i], want[i], rtol=1e-5, atol=1e-5)


def _prompt(cfg: Qwen2_5_VLConfig, n_images: int, seed: int) -> tuple[list[int], list[list[int]]]:
    """Text, then per image <|vision_start|> + its image tokens + <|vision_end|> and more text."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1000, (5,), generator=g).tolist()
    grids = [GRIDS[(i + seed) % 3] for i in range(n_images)]
    for t, h, w in grids:
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (t * h * w // 4) + [cfg.vision_end_token_id]
        ids += torch.randint(3, 1000, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
    return ids, grids


@pytest.mark.parametrize("n_images", [0, 1, 3])
def test_mrope_positions_are_transformers_get_rope_index(hf, n_images: int) -> None:
    image_id = hf.config.image_token_id
    for seed in range(3):
        ids, grids = _prompt(hf.config, n_images, seed)
        want, want_delta = hf.model.get_rope_index(
            torch.tensor([ids]), mm_token_type_ids=(torch.tensor([ids]) == image_id).int(),
            image_grid_thw=torch.tensor(grids) if grids else None)
        got, delta = mrope_positions(ids, grids, image_id, 2)
        assert got.dtype == torch.int64 and torch.equal(got, want[:, 0])
        # an image's tokens advance the positions by its longer side only: positions run behind indices
        assert delta == int(want_delta) <= 0 and (delta < 0 or not any(min(g[1:]) > 2 for g in grids))
    if n_images:  # the prompt and the grids must agree
        with pytest.raises(ValueError, match="fewer"):
            mrope_positions(ids, [[1, 8, 8], *grids[1:]], image_id, 2)
        with pytest.raises(ValueError, match="past its"):
            mrope_positions(ids, grids[:-1], image_id, 2)
        with pytest.raises(ValueError, match="no image tokens left"):
            mrope_positions(ids, [*grids, [1, 2, 2]], image_id, 2)


def test_apply_mrope_is_transformers(model_dir, hf) -> None:
    model = load_model(str(model_dir), F32, "cpu")
    ids, grids = _prompt(hf.config, 3, 1)
    positions, _ = mrope_positions(ids, grids, hf.config.image_token_id, 2)
    n, heads, d = positions.shape[1], 4, model.config.head_dim
    x = torch.randn(n, heads, d, generator=torch.Generator().manual_seed(0))
    rotary = Qwen2_5_VLRotaryEmbedding(hf.config.text_config)
    cos, sin = rotary(x, positions[:, None, :])
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    for ops in (resolve_ops("cpu", F32), dataclasses.replace(resolve_ops("cpu", F32), native=False)):
        got = apply_mrope(x, positions, model.rotary, model.mrope_section, ops)
        torch.testing.assert_close(got, want[0].transpose(0, 1), rtol=0, atol=1e-6)
    # text positions (three equal rows) are plain RoPE's
    flat = torch.arange(n)
    plain = model.rotary.cos_sin(flat, n)
    mixed = mrope_cos_sin(model.rotary, flat.expand(3, n), model.mrope_section)
    assert all(torch.equal(a, b) for a, b in zip(plain, mixed, strict=True))
    with pytest.raises(ValueError, match="mrope_section"):
        mrope_cos_sin(model.rotary, positions, [2, 3, 4])


def test_both_checkpoint_layouts_load_the_same_weights(model_dir, hf, images, tmp_path: Path) -> None:
    published = load_file(model_dir / "model.safetensors")
    assert {k.split(".")[0] for k in published} == {"model", "visual", "lm_head"}
    # transformers 5's save_pretrained writes the published names
    saved = tmp_path / "saved"
    hf.save_pretrained(saved)
    assert load_file(saved / "model.safetensors").keys() == published.keys()
    renamed = tmp_path / "renamed"  # transformers 4.52+'s names
    renamed.mkdir()
    for f in model_dir.glob("*.json"):
        (renamed / f.name).write_bytes(f.read_bytes())
    new = {(k if k.startswith("lm_head") else "model." + k.replace("model.", "language_model.", 1)
            if k.startswith("model.") else "model." + k): v for k, v in published.items()}
    assert "model.language_model.embed_tokens.weight" in new and "model.visual.merger.ln_q.weight" in new
    save_file(new, renamed / "model.safetensors", metadata={"format": "pt"})
    base = dict(load_model(str(model_dir), F32, "cpu").named_parameters())
    pixels, grids = images
    other = load_model(str(renamed), F32, "cpu")
    params = dict(other.named_parameters())
    assert params.keys() == base.keys()
    assert all(torch.equal(p, base[name]) for name, p in params.items())
    torch.testing.assert_close(other.encode_images(pixels[1], grids[1].tolist()),
                               _reference(hf, pixels, grids)[1], rtol=1e-5, atol=1e-5)
    # transformers' weights (q/k/v and gate/up fused; the patch conv flattened)
    block = hf.model.visual.blocks[2]
    assert torch.equal(base["visual.blocks.2.attn.qkv.weight"], block.attn.qkv.weight)
    gate_up = torch.cat([block.mlp.gate_proj.bias, block.mlp.up_proj.bias])
    assert torch.equal(base["visual.blocks.2.mlp.gate_up_proj.bias"], gate_up)
    conv = hf.model.visual.patch_embed.proj.weight
    assert torch.equal(base["visual.patch_embed.proj.weight"], conv.reshape(conv.shape[0], -1))
    assert torch.equal(base["model.embed_tokens.weight"], hf.model.language_model.embed_tokens.weight)


def test_a_weight_too_many_or_too_few_is_refused(model_dir) -> None:
    hf_cfg = read_hf_config(model_dir)
    cfg = ModelConfig.from_hf(hf_cfg, **Ours.arch_flags(hf_cfg))
    ops = resolve_ops("cpu", F32)
    weights = load_file(model_dir / "model.safetensors")
    Ours(cfg, F32, "cpu", ops).load_weights(weights.items())  # as it is: every weight, none left
    extra = {**weights, "model.visual.head.probe": torch.zeros(1, 1, 32)}
    with pytest.raises(ValueError, match="unexpected weight 'visual.head.probe'"):  # named as loaded
        Ours(cfg, F32, "cpu", ops).load_weights(extra.items())
    for gone in ("visual.merger.mlp.2.bias", "visual.blocks.1.mlp.up_proj.weight", "visual.patch_embed.proj.weight",
                 "model.layers.1.self_attn.k_proj.bias", "lm_head.weight"):
        with pytest.raises(ValueError, match="missing"):
            Ours(cfg, F32, "cpu", ops).load_weights((k, v) for k, v in weights.items() if k != gone)


def test_the_encoder_runs_its_linear_layers_through_the_ops(model_dir, images) -> None:
    ops = resolve_ops("cpu", F32)
    calls = []

    def linear(x, *args, **kw):
        calls.append(x.shape[0])
        return ops.linear(x, *args, **kw)

    model = load_model(str(model_dir), F32, "cpu", ops=dataclasses.replace(ops, linear=linear))
    visual = model.vision_tower
    assert visual is model.visual and isinstance(visual.patch_embed["proj"], Qwen2_5_VisionPatchProj)
    block = visual.blocks[0]
    assert isinstance(block.attn.qkv, ColumnParallelLinear) and isinstance(block.attn.proj, RowParallelLinear)
    assert isinstance(block.mlp.gate_up_proj, ColumnParallelLinear)
    assert isinstance(block.mlp.down_proj, RowParallelLinear)
    assert sum(isinstance(m, PackableLinear) for m in visual.modules()) == 1 + 4 * 3 + 2
    pixels, grids = images
    model.encode_images(pixels[0], grids[0].tolist())
    # 24 patches through the patch embedding and 3 blocks' 4 linears, 6 merged tokens through the merger's 2
    assert calls == [24] * 13 + [6] * 2


def test_the_text_model_runs_in_the_engine_as_transformers(model_dir, hf) -> None:
    cfg = EngineConfig(model=str(model_dir), dtype="float32", kv_cache_tokens=2048, max_running_requests=4)
    info = read_model_info(cfg.model)
    assert (info.architecture, info.image_token_id) == ("Qwen2_5_VLForConditionalGeneration", 1026)
    runner = ModelRunner(cfg, info)
    assert type(runner.model) is Ours
    # transformers' reference for this model: AutoModelForCausalLM does not know Qwen2.5-VL's config
    reference._models.setdefault(f"{model_dir}:{F32}", hf)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 30)]
    outs = generate(cfg, info, runner, prompts, [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)])
    equal = sum(assert_greedy_parity(outs[f"r{i}"], greedy(model_dir, p, 8), f"prompt {i}")
                for i, p in enumerate(prompts))
    assert equal == len(prompts)


def test_config_reads_as_transformers_reads_it(model_dir) -> None:
    ours = ModelConfig.from_hf(PUBLISHED)
    theirs = Qwen2_5_VLConfig.from_dict(PUBLISHED)
    t, v = theirs.text_config, theirs.vision_config
    assert ours.architecture == "Qwen2_5_VLForConditionalGeneration"
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "rms_norm_eps", "max_position_embeddings", "hidden_act"):
        assert getattr(ours, field) == getattr(t, field), field
    assert ours.head_dim == t.hidden_size // t.num_attention_heads == 128
    assert ours.rope_theta == t.rope_parameters["rope_theta"] == 1e6 and ours.rope_scaling == {}
    assert ours.layer_types == () and not ours.has_sliding_layers
    assert ours.tie_word_embeddings is theirs.tie_word_embeddings is False
    assert (ours.bos_token_id, ours.eos_token_id) == (151643, 151645)
    vis = ours.vision
    assert vis.dynamic and vis.mrope_section == tuple(t.rope_parameters["mrope_section"]) == (16, 24, 24)
    for ours_name, theirs_name in (("hidden_size", "hidden_size"), ("intermediate_size", "intermediate_size"),
                                   ("num_hidden_layers", "depth"), ("num_attention_heads", "num_heads"),
                                   ("patch_size", "patch_size"), ("spatial_merge_size", "spatial_merge_size"),
                                   ("temporal_patch_size", "temporal_patch_size"), ("window_size", "window_size"),
                                   ("out_hidden_size", "out_hidden_size"), ("num_channels", "in_channels")):
        assert getattr(vis, ours_name) == getattr(v, theirs_name), ours_name
    assert vis.fullatt_block_indexes == tuple(v.fullatt_block_indexes)
    assert vis.rope_theta == v.rope_parameters["rope_theta"] == 10_000.0
    assert (vis.image_token_id, vis.boi_token_id, vis.eoi_token_id) == (
        theirs.image_token_id, theirs.vision_start_token_id, theirs.vision_end_token_id)
    # the preset's (transformers 5's nested layout), with the attributes the engine reads off the model
    hf_cfg = read_hf_config(model_dir)
    cfg = ModelConfig.from_hf(hf_cfg)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.head_dim) == (64, 2, 1088, 16)
    assert cfg.vision.image_token_id == hf_cfg["image_token_id"] == 1026
    assert (cfg.vision.mrope_section, cfg.vision.window_size, cfg.vision.fullatt_block_indexes) == ((2, 3, 3), 28,
                                                                                                  (1,))
    model = Ours(dataclasses.replace(cfg, **Ours.arch_flags(hf_cfg)), F32, "meta", resolve_ops("cpu", F32))
    assert (model.image_token_id, model.spatial_merge_size, model.mrope_section) == (1026, 2, (2, 3, 3))
    assert (model.vision_start_token_id, model.vision_end_token_id) == (1024, 1025)


@pytest.mark.parametrize("where,value,what", [
    ("vision_config", {"hidden_act": "gelu"}, "vision_config.hidden_act"),
    ("vision_config", {"num_heads": 12}, "vision_config.num_heads"),
    ("vision_config", {"fullatt_block_indexes": [32]}, "vision_config.fullatt_block_indexes"),
    ("vision_config", {"window_size": 14}, "vision_config.window_size"),
    ("rope_scaling", {"type": "mrope", "mrope_section": [16, 24, 16]}, "mrope_section"),
])
def test_a_config_the_model_cannot_run_is_refused(where: str, value: dict, what: str) -> None:
    bad = {**PUBLISHED, where: {**PUBLISHED[where], **value}}
    with pytest.raises(ModelLoadError, match=what):
        ModelConfig.from_hf(bad)


def test_the_processor_makes_an_image_its_tokens(model_dir, images) -> None:
    raw = json.loads((model_dir / "config.json").read_text())
    image_id, start, end = raw["image_token_id"], raw["vision_start_token_id"], raw["vision_end_token_id"]
    assert image_id < raw["text_config"]["vocab_size"]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n"
    tok = load_tokenizer(model_dir)  # the engine's own: the image tokens special, the chat template Qwen's way
    assert {"<|vision_start|>", "<|image_pad|>", "<|vision_end|>"} <= set(tok.all_special_tokens)
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
    assert tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]) == [start, image_id, end]
    # the image processor alone loads anywhere: a 40 x 30 image is 6 tokens
    image = Image.fromarray(np.zeros((30, 40, 3), dtype=np.uint8))
    out = AutoImageProcessor.from_pretrained(model_dir)([image], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 6]] and out["pixel_values"].shape == (24, 3 * 2 * 7 * 7)

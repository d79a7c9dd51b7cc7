"""Images: time to first token of a 1-image prompt against transformers' `generate` on the same checkpoint,
and text requests' time to first token while 8 image requests are being encoded against the same requests
with nothing else running (and, as a control, beside 8 text requests as long as the image prompts: the same
prefill work with nothing to encode). One run, both sides measured in it, `lscpu` printed with the figures:

    python -m tandem.benchmarks.vision_ttft --model DIR [--runs 5] [--dtype float32] [--out FILE]

Every image is new to the engine (random pixels per request), so nothing comes from the prefix or encoder
caches. Both sides run the model's own processor; transformers' time includes its processor call, tandem's
the client's (frontend/image_prompt.py) and everything to the first streamed token.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

QUESTION = "Describe the picture."


def _picture(seed: int, side: int = 320) -> Any:
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (side, side, 3), dtype=np.uint8))


def _messages(image: Any | None, text: str = QUESTION) -> list[dict]:
    parts = [{"type": "image", "image": image}] if image is not None else []
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def transformers_ttft(model: str, runs: int, dtype: str) -> list[float]:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    proc = AutoProcessor.from_pretrained(model)
    m = AutoModelForImageTextToText.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    out = []
    for i in range(runs + 1):  # the first warms up
        t0 = time.perf_counter()
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        inp = proc(text=text, images=[_picture(1000 + i)], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            m.generate(**inp, max_new_tokens=1, do_sample=False)
        if i:
            out.append(time.perf_counter() - t0)
    return out


async def _first_token(client: Any, prompt: Any) -> float:
    t0 = time.perf_counter()
    async for d in client.stream(prompt, {"max_tokens": 2, "temperature": 0, "ignore_eos": True}):
        if d.token_ids:
            return time.perf_counter() - t0
    raise RuntimeError("no token")


async def tandem_figures(model: str, runs: int, dtype: str, busy: int, **options: Any,
                         ) -> dict[str, list[float]]:
    from tandem import AsyncClient

    async with AsyncClient.launch(model, dtype=dtype, **options) as c:
        await _first_token(c, _messages(_picture(1)))  # warm up
        one = [await _first_token(c, _messages(_picture(2000 + i))) for i in range(runs)]
        texts = [_messages(None, f"Question {i}: what is {i} plus {i}?") for i in range(runs)]
        alone = [await _first_token(c, t) for t in texts]
        filler = _same_length_text(model)

        async def beside(make: Any) -> list[float]:
            out = []
            for r in range(runs):  # each text request arrives while `busy` others are in the engine
                others = [asyncio.create_task(_first_token(c, make(r * busy + k))) for k in range(busy)]
                # an image's pixels are made in the client first: wait until the engine holds them all
                while (s := await c.stats()).running + s.waiting < busy and not all(t.done() for t in others):
                    await asyncio.sleep(0.002)
                out.append(await _first_token(c, texts[r]))
                await asyncio.gather(*others)
            return out

        loaded = await beside(lambda i: _messages(_picture(3000 + i)))
        control = await beside(lambda i: _messages(None, f"{i} {filler}"))
    return {"one_image": one, "text_alone": alone, "text_beside_images": loaded, "text_beside_texts": control}


def _same_length_text(model: str) -> str:
    """Text whose prompt is as many tokens as an image prompt's (the control: the same prefill work with
    no image to encode)."""
    from tandem.frontend.image_prompt import ImagePrompter

    p = ImagePrompter(model)
    want = len(p.prompt(_messages(_picture(0)), [_picture(0)])[0])
    words = want
    while len(p.prompt(_messages(None, "x " * words), [])[0]) > want and words > 1:
        words -= 1
    return "x " * (words - 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a vision-language model directory")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--busy", type=int, default=8, help="image requests being encoded beside the text ones")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--encoder-tokens-per-step", type=int, help="the engine's (default: its default)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    opts = {} if args.encoder_tokens_per_step is None else {"encoder_tokens_per_step": args.encoder_tokens_per_step}
    t = asyncio.run(tandem_figures(args.model, args.runs, args.dtype, args.busy, **opts))
    hf = transformers_ttft(args.model, args.runs, args.dtype)

    def ms(xs: list[float]) -> str:
        return f"{1000 * statistics.median(xs):.0f} ms (min {1000 * min(xs):.0f}, max {1000 * max(xs):.0f})"

    med = {k: statistics.median(v) for k, v in t.items()}
    lines = [
        f"model {args.model}, {args.dtype}, {opts or 'default engine options'}, median of {args.runs} "
        "(after a warm-up)",
        "",
        "| figure | tandem | baseline | ratio |",
        "|---|---|---|---|",
        f"| TTFT, 1 image | {ms(t['one_image'])} | transformers generate: {ms(hf)} | "
        f"{statistics.median(hf) / med['one_image']:.2f}x faster |",
        f"| text TTFT beside {args.busy} image requests | {ms(t['text_beside_images'])} | "
        f"the same alone: {ms(t['text_alone'])} | {med['text_beside_images'] / med['text_alone']:.2f}x slower |",
        f"| text TTFT beside {args.busy} text requests of the image prompts' length | "
        f"{ms(t['text_beside_texts'])} | the same alone | {med['text_beside_texts'] / med['text_alone']:.2f}x "
        "slower |",
    ]
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    text = "\n".join(lines) + f"\n\n```\n{cpu}```\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

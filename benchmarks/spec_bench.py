"""`tandem bench spec`: speculative decoding (ngram) on vs off in one run, on a repetitive workload
(prompts that hold most of their answer: a function to give a docstring, a paragraph to repeat), open
questions whose answers are new text, and random tokens, at several batch sizes: output tok/s and the
acceptance rate. The asks go through the model's chat template when it has one: an instruct model copies
only when asked in its own format. (A small greedy model often loops on random tokens, which drafts then
predict well: the open questions are the workload where drafts rarely match.)

The prompts are generated here, seeded, never downloaded.
"""
from __future__ import annotations

import dataclasses
import os
import random
import time
from typing import Any

from tandem.benchmarks.workload import random_prompts
from tandem.kernels.native.cpu_caps import cpu_caps
from tandem.protocol.engine_config import EngineConfig

_WORDS = ("alpha beta gamma delta value total count index result buffer name item list map key "
          "score limit offset width height price amount").split()


def _code(rng: random.Random) -> str:
    """A small generated Python function."""
    name = "_".join(rng.sample(_WORDS, 2))
    args = rng.sample(_WORDS, 3)
    lines = [f"def {name}({', '.join(args)}):"]
    for i in range(rng.randrange(6, 12)):
        a, b = rng.sample(args, 2)
        lines.append(f"    {rng.choice(_WORDS)}_{i} = {a} * {rng.randrange(2, 99)} + {b}")
    lines.append(f"    return {args[0]}")
    return "\n".join(lines)


_SUBJECTS = ("The old bridge", "Our team", "The new library", "A small bakery", "The river", "The council",
             "My neighbour", "The museum", "The night train", "The village school")
_EVENTS = ("opened", "closed", "was rebuilt", "moved", "grew", "was painted", "was sold", "changed its hours")
_WHEN = ("in the spring of 1998", "last winter", "after the storm", "on a quiet Sunday", "two years ago",
         "during the festival")
_WHY = ("because the roads were flooded", "so that more people could visit", "after a long debate",
        "to save money", "when the owners retired")


def _passage(rng: random.Random) -> str:
    """A paragraph of plain sentences."""
    return " ".join(f"{rng.choice(_SUBJECTS)} {rng.choice(_EVENTS)} {rng.choice(_WHEN)} {rng.choice(_WHY)}."
                    for _ in range(rng.randrange(6, 10)))


def repetitive_prompts(n: int, seed: int) -> list[str]:
    """Editing code and repeating a paragraph: the answer copies most of the prompt."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append(
                f"Add a docstring to this Python function. Reply with the whole function.\n\n```python\n"
                f"{_code(rng)}\n```"
            )
        else:
            out.append(f"Repeat this text exactly, word for word:\n\n{_passage(rng)}")
    return out


_TOPICS = (
    "a lighthouse keeper",
    "the history of bread",
    "how bees talk",
    "a city under the sea",
    "learning to ride a bicycle",
    "why the sky changes colour",
    "a robot that paints",
    "winter in a forest",
)
_ASKS = ("Write a short story about {}.", "Explain {} to a child.", "Give five surprising facts about {}.",
         "Write a poem about {}.")


def open_prompts(n: int, seed: int) -> list[str]:
    """Open questions: the answer is new text, little of it in the prompt."""
    rng = random.Random(seed)
    return [rng.choice(_ASKS).format(rng.choice(_TOPICS)) for _ in range(n)]


def as_chat(model: str, asks: list[str]) -> list[str]:
    """Each ask as a user turn in the model's chat template (an instruct model answers it; the
    repetitive asks are copied only then), or as plain text when the model has no template."""
    from tandem.protocol.tokenizer_loader import load_tokenizer

    tok = load_tokenizer(model)
    if not getattr(tok, "chat_template", None):
        return asks
    return [
        tok.apply_chat_template([{"role": "user", "content": a}], tokenize=False, add_generation_prompt=True)
        for a in asks
    ]


# Small batches run this many requests in all, a batch at a time: one request alone is too few to time.
MIN_REQUESTS = 4


def num_requests(batch: int) -> int:
    """Requests a batch size's row runs: `batch` at a time, at least MIN_REQUESTS in all."""
    return batch * max(1, -(-MIN_REQUESTS // batch))


def _measure(client: Any, prompts: list, batch: int, output_len: int) -> dict[str, Any]:
    from tandem import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    before = client.stats()
    t0 = time.perf_counter()
    comps = []
    for g in range(0, len(prompts), batch):
        comps += client.generate_batch(prompts[g : g + batch], params, progress=False)
    dt = time.perf_counter() - t0
    after = client.stats()
    drafts = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    n = sum(len(c.token_ids) for c in comps)
    return {
        "tok_s": n / dt, "tokens": n, "requests": len(prompts), "steps": after.steps - before.steps,
        "acceptance": accepted / drafts if drafts else 0.0, "draft_tokens": drafts,
        "outputs": [c.token_ids for c in comps],
    }


def run(cfg: EngineConfig, batches: list[int], k: int, output_len: int, seed: int) -> dict[str, Any]:
    from tandem import Client, SamplingParams

    n = {b: num_requests(b) for b in batches}  # requests per batch size, run `b` at a time
    workloads = {
        "repetitive": {b: as_chat(cfg.model, repetitive_prompts(n[b], seed + b)) for b in batches},
        "open": {b: as_chat(cfg.model, open_prompts(n[b], seed + b)) for b in batches},
        "random": {b: random_prompts(cfg.model, n[b], (64, 128), seed + b) for b in batches},
    }
    on_cfg = dataclasses.replace(cfg, speculative_method="ngram", num_speculative_tokens=k)
    off_cfg = dataclasses.replace(cfg, speculative_method=None)
    on: dict[str, Any] = {}
    off: dict[str, Any] = {}
    print(f"speculative decoding (ngram, K={k}) on vs off: greedy, output {output_len} tokens; "
          f"each workload on then off, back to back; batches under {MIN_REQUESTS} run {MIN_REQUESTS} "
          "requests, a batch at a time")
    print(cpu_caps().describe())
    print(f"{'workload':>10} {'batch':>5} {'on tok/s':>9} {'off tok/s':>9} {'speedup':>8} {'accept':>7} "
          f"{'steps on/off':>12} {'same':>5} {'load':>5}", flush=True)
    # Both engines up at once (an idle one uses no CPU), each workload measured on then off back to back:
    # on a machine shared with other work, drifting load then hits both sides of a ratio alike.
    with (
        Client.launch(cfg.model, **on_cfg.options()) as c_on,
        Client.launch(cfg.model, **off_cfg.options()) as c_off,
    ):
        for c in (c_on, c_off):
            c.generate([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        for name, by_batch in workloads.items():
            for b, prompts in by_batch.items():
                key = f"{name}/{b}"
                a = on[key] = _measure(c_on, prompts, b, output_len)
                o = off[key] = _measure(c_off, prompts, b, output_len)
                # greedy: speculation changes no token
                same = a["same_outputs"] = a["outputs"] == o["outputs"]
                a["load_average"] = os.getloadavg()[0]  # other work on the cores while it ran
                print(
                    f"{name:>10} {b:>5} {a['tok_s']:>9.1f} {o['tok_s']:>9.1f} {a['tok_s'] / o['tok_s']:>7.2f}x "
                    f"{100 * a['acceptance']:>6.1f}% {a['steps']:>5}/{o['steps']:<6} {'yes' if same else 'NO':>5} "
                    f"{a['load_average']:>5.1f}",
                    flush=True,
                )
    for r in (*on.values(), *off.values()):
        del r["outputs"]
    return {"benchmark": "spec", "k": k, "batches": batches, "cpu": cpu_caps().describe(), "spec_on": on,
            "spec_off": off}

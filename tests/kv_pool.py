"""A test-side stand-in for the engine's KV bookkeeping, to run a model's forward directly."""
from __future__ import annotations

import torch

from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.kv_cache import KVCache


class Pool:
    """Test-side stand-in for the engine: hands out random non-contiguous slots and request rows."""

    def __init__(self, model, num_slots: int = 400, max_reqs: int = 16, seed: int = 0,
                 kv_dtype: torch.dtype | None = None, swa: bool = False, max_context: int = 128,
                 device: torch.device | str = "cpu") -> None:
        """swa: the model's sliding-window layers get a pool of their own, each slot mapped to a random
        one."""
        self.device = torch.device(device)
        cfg = model.config
        sliding = (
            frozenset(i for i in range(cfg.num_hidden_layers) if cfg.is_sliding(i)) if swa else frozenset()
        )
        self.kv = KVCache(
            cfg.num_hidden_layers,
            num_slots,
            cfg.num_key_value_heads,
            cfg.head_dim,
            kv_dtype or model.dtype,
            self.device,
            max_reqs=max_reqs,
            max_context=max_context,
            swa_slots=num_slots if swa else 0,
            swa_layers=sliding,
        )
        g = torch.Generator().manual_seed(seed)
        self.free_slots = torch.randperm(num_slots, generator=g).tolist()
        self.free_rows = torch.randperm(max_reqs, generator=g).tolist()
        self.free_swa = torch.randperm(num_slots, generator=g).tolist()

    def add(self, length: int) -> int:
        row = self.free_rows.pop()
        slots = [self.free_slots.pop() for _ in range(length)]
        self.kv.req_to_token[row, :length] = torch.tensor(slots)
        if self.kv.swa_map is not None:
            self.kv.map_swa(torch.tensor(slots), torch.tensor([self.free_swa.pop() for _ in slots]))
        return row

    def batch(self, reqs: list[tuple[int, list[int], int]], all_logits: bool = False) -> ForwardBatch:
        """reqs: (row, new token ids, seq_len after this step)."""
        ids, locs, rows, seq_lens, ext = [], [], [], [], []
        for row, toks, seq_len in reqs:
            ids += toks
            locs += self.kv.req_to_token[row, seq_len - len(toks) : seq_len].tolist()
            rows.append(row)
            seq_lens.append(seq_len)
            ext.append(len(toks))
        logits_idx = list(range(len(ids))) if all_logits else None
        return ForwardBatch.from_lists(ids, locs, rows, seq_lens, ext, logits_idx, device=self.device)

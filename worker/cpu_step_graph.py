"""Decode steps on CPU replayed from a recorded list of C kernel calls: the CPU twin of decode_graphs.py.

At batch 1 a small model's CPU decode step is mostly Python dispatch (some eleven ops a layer, each a call
with its checks) rather than the weights streaming through the quantized products. So once, at start, the
worker records the forward as nodes of kernels/csrc/step_graph.c: every op's C kernel with its arguments
bound to persistent buffers (token ids, positions, KV slots, request rows, lengths), the KV pools, the weights
and scratch, up to the logits when the LM head is a quantized product (else compute_logits runs after the
replay). A decode step writes its inputs into those buffers and replays the list with one call, which runs
the whole step in one parallel region of the worker's threads; sampling runs after it as in the eager path.
The row count is an argument of the replay, so one recording serves every decode batch up to `max_batch`
without padding rows.

Each node calls the kernel the eager forward calls, with the arguments it would get, so a replay gives the
eager forward's bits (tests hold them equal; K/V written to a float16 or bfloat16 pool are rounded as torch
rounds them). It applies where every op of a step has a C kernel: CPU, a float32 model, the C kernels built,
the `cpu` attention backend, one rank, every linear layer running from GGUF blocks or from a float32 or bf16
weight the C kernel takes (for up to DENSE_MAX_ROWS rows: a recording then serves batches up to that), a
Llama/Qwen2/Qwen3 or Gemma 3 decoder (its sliding layers: their window, RoPE table and, with a pool of their
own, slots mapped into it), or an MoE one whose MoE layers are one C call each (kernels/native/moe.py; no
shared expert). Its last node is greedy sampling's argmax when the LM head is one and the model does not
transform its logits. --enforce-eager turns it off.
"""

from __future__ import annotations

import logging

import torch

from tandem.kernels.native import paged_attention, quant_linear
from tandem.kernels.native import step_graph as sg
from tandem.kernels.native.paged_attention import KV_TYPES
from tandem.kernels.native.quant_linear import QuantRows
from tandem.kernels.native.quant_pack import QuantWeight
from tandem.protocol.engine_config import EngineConfig
from tandem.worker.attention_backend import CpuBackend
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.kv_cache import KVCache
from tandem.worker.layers.linear import PackableLinear
from tandem.worker.layers.moe import FusedMoE
from tandem.worker.models.gemma3 import Gemma3ForCausalLM

log = logging.getLogger(__name__)


def cpu_graph_applies(cfg: EngineConfig, model: torch.nn.Module, kv: KVCache) -> bool:
    """Whether CpuStepGraph can record this model (see the module doc)."""
    backend = getattr(model, "attn_backend", None)
    if cfg.enforce_eager or cfg.tp_size != 1 or kv.device.type != "cpu" or kv.dtype not in KV_TYPES:
        return False
    if not isinstance(backend, CpuBackend) or not backend.native or not sg.available():
        return False
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers or not all(hasattr(x, "self_attn") and _mlp_records(getattr(x, "mlp", None)) for x in layers):
        return False
    linears = [m for m in model.modules() if isinstance(m, PackableLinear)]
    return bool(linears) and all(m.quant is not None or m.dense is not None for m in linears)


def graph_batch(model: torch.nn.Module, max_batch: int) -> int:
    """The most decode rows a recording serves: a float weight's product runs in the C kernel (a node) only
    up to DENSE_MAX_ROWS rows (more go to torch in the eager path, whose bits the replay gives)."""
    dense = [m.dense for m in model.modules() if isinstance(m, PackableLinear) and m.dense is not None]
    dense += [m.head_dense for m in model.modules() if getattr(m, "head_dense", None) is not None]
    return min([max_batch, *(quant_linear.DENSE_MAX_ROWS[w.qtype] for w in dense)])


def _stored(layer: PackableLinear) -> QuantWeight | QuantRows:
    """What a layer's product runs from in the C kernel: its blocks or its float weight."""
    w = layer.quant or layer.dense
    if w is None:
        raise ValueError("a linear layer the C kernel does not take (cpu_graph_applies says so)")
    return w


def _mlp_records(mlp: torch.nn.Module | None) -> bool:
    """A dense SwiGLU, or an MoE layer run by its C kernel in one call (one node) without a shared expert
    (Qwen2-MoE's would take nodes of its own: those models run eagerly)."""
    if isinstance(mlp, FusedMoE):
        return mlp.native and mlp.shared_expert is None
    return hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj")


class CpuStepGraph:
    """Runs decode batches of up to max_batch requests by replaying one recorded step."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, max_batch: int, max_context: int) -> None:
        max_batch = graph_batch(model, max_batch)
        self.model, self.kv, self.max_batch = model, kv, max_batch
        self.num_runs = 0  # decode steps run through here (the tests check that they were)
        # [max_batch] int64: each row's argmax of the logits, the ARGMAX node's output (None: no such node)
        self.greedy: torch.Tensor | None = None
        i64 = {"dtype": torch.int64}
        self.ids, self.positions, self.slots, self.rows, self.lens = (torch.zeros(max_batch, **i64) for _ in range(5))
        self.swa_slots = torch.zeros(max_batch, **i64)  # the step's slots in the sliding layers' own pool
        self._inputs = {"input_ids": self.ids, "positions": self.positions, "out_cache_loc": self.slots,
                        "req_pool_indices": self.rows, "seq_lens": self.lens}
        for rotary in model.rotaries():
            rotary.reserve(max_context)  # the tables are never grown between recording and replay
        self._keep: list[torch.Tensor] = []  # every buffer a node points into
        self.threads = max(1, torch.get_num_threads())  # the attention's scratch is per thread, for this many
        self._nodes: list[list[int]] = []
        self._record(max_batch, max_context)
        self.nodes = torch.tensor(self._nodes, dtype=torch.int64)
        log.info("CPU step graph: %d nodes for decode batches up to %d", len(self._nodes), max_batch)

    def can_run(self, batch: ForwardBatch) -> bool:
        """A pure decode batch whose every request wants its one logit row, within max_batch."""
        b = batch.batch_size
        return 0 < b <= self.max_batch and batch.all_decode and batch.logits_indices.numel() == b

    def greedy_tokens(self, rows: int) -> torch.Tensor | None:
        """After run: the last replay's argmax of each row's logits (torch.argmax's answer; a copy), or None
        when the graph has no ARGMAX node (the LM head after the replay, or a model that transforms its
        logits, as Gemma's softcap does)."""
        return None if self.greedy is None else self.greedy[:rows].clone()

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The batch's float32 logits [B, vocab], as model.forward(batch, kv) gives them."""
        if not self.can_run(batch):
            raise ValueError("not a decode batch this graph takes (see can_run)")
        b = batch.batch_size
        for name, buf in self._inputs.items():
            buf[:b].copy_(getattr(batch, name))
        if self.kv.swa_map is not None:
            torch.index_select(self.kv.swa_map, 0, batch.out_cache_loc, out=self.swa_slots[:b])
        if batch.max_seq_len > self.model.rotary.cos.shape[0]:
            raise ValueError(f"position {batch.max_seq_len} past the recorded rotary table")
        sg.run(self.nodes, b, min(torch.get_num_threads(), self.threads))
        self.num_runs += 1
        if self.logits is not None:  # a view of the graph's buffer: the next replay writes over it
            return self.model.finish_logits(self.logits[:b])
        return self.model.compute_logits(self.final[:b])

    # ---- recording -------------------------------------------------------------------------------
    def _buf(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = torch.zeros(shape, dtype=dtype)
        self._keep.append(t)
        return t

    def _node(self, kind: int, *args: int) -> None:
        if len(args) > sg.NODE_ARGS:
            raise ValueError("too many node arguments")
        self._nodes.append([kind, *args, *[0] * (sg.NODE_ARGS - len(args))])

    def _norm(self, x: torch.Tensor, delta: torch.Tensor | None, norm: torch.nn.Module, out: torch.Tensor) -> None:
        fn = sg.entry_points()["add_rms_norm"]
        n = x.shape[1]
        self._node(sg.NORM, fn, x.data_ptr(), x.stride(0), sg.ptr(delta), 0 if delta is None else delta.stride(0),
                   norm.weight.data_ptr(), n, sg.float_bits(norm.eps), out.data_ptr(), out.stride(0))

    def _linear(self, layer: PackableLinear, x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None) -> None:
        self._product(_stored(layer), layer.int8_activations and layer.quant is not None, x, y, bias)

    def _product(self, w: QuantWeight | QuantRows, int8: bool, x: torch.Tensor, y: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        """One node per packed part (a fused layer may mix GGUF types), each into its own columns of y,
        adding its columns' bias as the eager product adds the whole bias after; the kernel the layer's
        eager product calls (float32 or int8 activations, quantized into the graph's one scratch)."""
        ep = sg.entry_points()
        q8 = (ep["quantize_q8"], ep["quant_linear_q8"], self._q8.data_ptr()) if int8 else (0, 0, 0)
        col = 0
        for part in w.parts if isinstance(w, QuantRows) else (w,):
            self._node(sg.QLINEAR, ep["quant_linear"], x.data_ptr(), part.in_features, x.stride(0),
                       part.data.data_ptr(), part.kind, part.out_features, y.data_ptr() + 4 * col, y.stride(0),
                       0 if bias is None else bias.data_ptr() + 4 * col, quant_linear.PARALLEL_MIN_MACS, *q8)
            col += part.out_features

    def _moe(self, mlp: FusedMoE, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, y: torch.Tensor) -> None:
        """The C call the eager MoE layer makes (kernels/native/moe.py), routing into ids / wts."""
        w13, w2 = mlp.experts.packed13, mlp.experts.packed2
        assert w13 is not None and w2 is not None and mlp._router is not None  # _mlp_records checked
        self._node(sg.MOE, sg.entry_points()["moe"], x.data_ptr(), x.shape[1], x.stride(0), mlp._router.data_ptr(),
                   w13.num_experts, mlp.top_k, int(mlp.renormalize), ids.data_ptr(), wts.data_ptr(),
                   w13.pointers.data_ptr(), w13.kind, w13.out_features, w2.pointers.data_ptr(), w2.kind,
                   w2.in_features, y.data_ptr(), y.stride(0))

    def _rotary(self, x: torch.Tensor, heads: int, out: torch.Tensor, rot: object = None) -> None:
        """x: a [B, width] buffer whose first heads * D floats of each row are the heads to rotate; rot: the
        RoPE table (default: the model's)."""
        rot, d = rot or self.model.rotary, out.shape[-1]
        self._node(sg.ROTARY, sg.entry_points()["rotary"], x.data_ptr(), x.stride(0), d, rot.cos.data_ptr(),
                   rot.sin.data_ptr(), d, heads, self.positions.data_ptr(), out.data_ptr())

    def _head_norm(self, x_ptr: int, ld: int, heads: int, norm: torch.nn.Module, out: torch.Tensor) -> None:
        d = out.shape[-1]
        self._node(sg.HEAD_NORM, sg.entry_points()["add_rms_norm"], x_ptr, ld, heads, norm.weight.data_ptr(), d,
                   sg.float_bits(norm.eps), out.data_ptr(), out.stride(0))

    def _attention(self, i: int, q: torch.Tensor, H: int, k: torch.Tensor, v_ptr: int, ld_v: int,
                   out: torch.Tensor, scale: float, window: int) -> None:
        """Layer i's K/V written (to its own pool's slots when it has one) and its H query heads (the first
        of q's rows) attended."""
        kv, D = self.kv, q.shape[-1]
        kp, vp = kv.k[i], kv.v[i]
        mapped = window and kv.swa_map is not None
        Hkv = k.shape[1]
        self._node(sg.KV_WRITE, k.data_ptr(), k.stride(0), v_ptr, ld_v, kp.data_ptr(), vp.data_ptr(), Hkv * D,
                   (self.swa_slots if mapped else self.slots).data_ptr(), KV_TYPES[kv.dtype])
        rtt = kv.req_to_token
        self._node(sg.ATTENTION, sg.entry_points()["paged_attention"], q.data_ptr(), q.stride(0), q.stride(1),
                   kp.data_ptr(), vp.data_ptr(), kp.stride(0), rtt.data_ptr(), rtt.stride(0),
                   self.rows.data_ptr(), self.lens.data_ptr(), self._slot_buf.data_ptr(), H, Hkv, D,
                   sg.float_bits(scale), out.data_ptr(), self._work.data_ptr(), self._work_stride,
                   paged_attention.PARALLEL_MIN_KEYS, KV_TYPES[kv.dtype], window,
                   kv.swa_map.data_ptr() if mapped else 0)

    def _record(self, mb: int, max_context: int) -> None:
        m, kv = self.model, self.kv
        layers = m.model.layers
        attn0 = layers[0].self_attn
        H, Hkv, D = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        hidden = m.model.embed_tokens.weight.shape[1]
        qkv_w = _stored(attn0.qkv_proj).out_features
        dense = [x.mlp for x in layers if not isinstance(x.mlp, FusedMoE)]
        inter2 = max((_stored(mlp.gate_up_proj).out_features for mlp in dense), default=2)
        top_k = max((x.mlp.top_k for x in layers if isinstance(x.mlp, FusedMoE)), default=1)
        h, x, o, down = (self._buf(mb, hidden) for _ in range(4))
        self.final = self._buf(mb, hidden)
        qkv, attn_out = self._buf(mb, qkv_w), self._buf(mb, H, D)
        gate_up, act = self._buf(mb, inter2), self._buf(mb, inter2 // 2)
        ids, wts = self._buf(mb, top_k, dtype=torch.int64), self._buf(mb, top_k)  # each MoE layer's routing
        qk_norm = attn0.q_norm is not None
        if qk_norm:
            qn, kn, q, k = self._buf(mb, H, D), self._buf(mb, Hkv, D), self._buf(mb, H, D), self._buf(mb, Hkv, D)
        else:
            rot = self._buf(mb, H + Hkv, D)
            q, k = rot, rot[:, H:]
        group = H // Hkv
        self._slot_buf = self._buf(mb, kv.req_to_token.shape[1], dtype=torch.int64)
        self._work_stride = group * (-(-max_context // 8) * 8)  # a thread's scores
        self._work = self._buf(self.threads * self._work_stride)
        # The int8 products' quantized activations, one scratch for all (the widest input: a layer's or the head's)
        widths = [mod.quant.in_features for mod in m.modules()
                  if isinstance(mod, PackableLinear) and mod.quant and mod.int8_activations]
        self._q8 = self._buf(quant_linear.q8_bytes(mb, max(widths + [hidden])) if widths else 0, dtype=torch.uint8)
        gemma = isinstance(m, Gemma3ForCausalLM)
        if gemma:
            normed, post = self._buf(mb, hidden), self._buf(mb, hidden)  # a branch's output, normed

        emb = m.model.embed_tokens.weight
        self._node(sg.EMBED, emb.data_ptr(), hidden, self.ids.data_ptr(), h.data_ptr(), h.stride(0),
                   sg.float_bits(float(m.embed_scale)) if gemma else 0)
        delta: torch.Tensor | None = None  # what joins the residual stream before the next norm
        for i, layer in enumerate(layers):
            a = layer.self_attn
            window = getattr(a, "window", 0)
            self._norm(h, delta, layer.input_layernorm, x)
            self._linear(a.qkv_proj, x, qkv, a.qkv_proj.bias)
            if qk_norm:
                table = m.rotary_local if window else m.rotary
                self._head_norm(qkv.data_ptr(), qkv.stride(0), H, a.q_norm, qn)
                self._head_norm(qkv.data_ptr() + a.q_size * 4, qkv.stride(0), Hkv, a.k_norm, kn)
                self._rotary(qn.view(mb, -1), H, q, table)
                self._rotary(kn.view(mb, -1), Hkv, k, table)
            else:
                self._rotary(qkv, H + Hkv, rot)
            v_ptr = qkv.data_ptr() + (a.q_size + a.kv_size) * 4
            self._attention(i, q, H, k, v_ptr, qkv.stride(0), attn_out, a.scale, window)
            self._linear(a.o_proj, attn_out.view(mb, -1), o, a.o_proj.bias)
            mlp = layer.mlp
            if gemma:  # h += norm(attention); x = norm(h); ...; delta = norm(mlp)
                self._norm(o, None, layer.post_attention_layernorm, normed)
                self._norm(h, normed, layer.pre_feedforward_layernorm, x)
            else:
                self._norm(h, o, layer.post_attention_layernorm, x)
            if isinstance(mlp, FusedMoE):
                self._moe(mlp, x, ids, wts, down)
                delta = down
                continue
            self._linear(mlp.gate_up_proj, x, gate_up, mlp.gate_up_proj.bias)
            kind, fn = (sg.GELU_MUL, "gelu_mul") if gemma else (sg.SILU_MUL, "silu_mul")
            self._node(kind, sg.entry_points()[fn], gate_up.data_ptr(), gate_up.stride(0), inter2 // 2,
                       act.data_ptr(), act.stride(0))
            self._linear(mlp.down_proj, act, down, mlp.down_proj.bias)
            delta = down
            if gemma:
                self._norm(down, None, layer.post_feedforward_layernorm, post)
                delta = post
        self._norm(h, delta, m.model.norm, self.final)
        head = m.model.embed_tokens if m.lm_head is None else m.lm_head
        self.logits: torch.Tensor | None = None  # [mb, vocab] when the LM head is a node
        hq = head.head_quant or head.head_dense
        if hq is not None and head.tp_size == 1 and hq.out_features == head.shard:  # else compute_logits runs
            self.logits = self._buf(mb, hq.out_features)
            self._product(hq, head.int8_activations and head.head_quant is not None, self.final, self.logits, None)
            if not m.transforms_logits:  # the tokens greedy sampling takes from these very logits
                self.greedy = self._buf(mb, dtype=torch.int64)
                self._node(sg.ARGMAX, sg.entry_points()["argmax"], self.logits.data_ptr(), self.logits.stride(0),
                           hq.out_features, self.greedy.data_ptr())

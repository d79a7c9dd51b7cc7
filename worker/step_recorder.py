"""Records a model's CPU decode step as step-graph nodes by running the model's own forward once
(worker/cpu_step_graph.py replays them), the way a CUDA graph is captured.

The forward runs on the graph's input buffers with every module's Ops, and the model's attention backend,
swapped for recording ones: each op (norm, activation, rotary, linear product, MoE layer, attention with its
K/V write) appends the node of the C kernel its eager call runs, bound to real buffers, instead of computing.
torch's own ops in the forward meet a dispatch guard: a view passes (it only moves a pointer), a few have a
node (an embedding lookup, a residual add, the embedding's scale folded into its lookup) or are read by one
(the rows of a RoPE table at the step's positions, which the rotary node reads from the table itself; the
rows that get logits, all of them in a decode step), and any other refuses the recording with its name. So
a model replays exactly what its forward computes, or steps eagerly: no recording code per model.

Every buffer an op makes is a fresh temporary while recording; worker/step_buffers.py then gives each
memory by its live range.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.kernels.native import paged_attention, quant_linear
from tandem.kernels.native import step_graph as sg
from tandem.kernels.native.paged_attention import KV_TYPES
from tandem.kernels.native.quant_linear import QuantRows, dense_takes
from tandem.kernels.native.step_graph import Node, Ptr
from tandem.kernels.ops import Ops
from tandem.worker.attention_backend import AttentionBackend
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.kv_cache import KVCache
from tandem.worker.step_buffers import lay_out

F32 = torch.float32
aten = torch.ops.aten


class Unrecordable(Exception):
    """The forward reached an op with no node (the message names it): the model steps eagerly."""


def _rows(t: torch.Tensor, dims: int = 2) -> bool:
    """A float32 tensor of `dims` dimensions whose last is contiguous (what the C kernels take)."""
    return t.dtype == F32 and t.dim() == dims and t.stride(-1) == 1


class StepRecorder:
    """Records one decode step of up to batch.batch_size rows (the row count is the replay's argument)."""

    # Ops fields -> the method recording them; a field not here refuses (as does removing one: the tests do).
    RECORDERS = {"add_rms_norm": "add_rms_norm", "silu_mul": "silu_mul", "gelu_mul": "gelu_mul",
                 "rotary": "rotary", "linear": "linear", "moe_layer": "moe_layer", "lora_add": "lora_add"}

    def __init__(self, kv: KVCache, batch: ForwardBatch, swa_slots: torch.Tensor, max_context: int,
                 threads: int) -> None:
        self.kv, self.batch, self.swa_slots = kv, batch, swa_slots
        self.mb, self.max_context, self.threads = batch.batch_size, max_context, threads
        self.nodes: list[Node] = []
        self.int8 = False  # the recorded Ops' int8 activations (set by `recording`)
        self._temps: dict[int, torch.Tensor] = {}  # storage address -> the temporary owning it
        self._gathers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # address -> (table, positions)
        self._scratch: dict[str, int] = {}  # shared scratch -> bytes its largest user needs
        self._quiet = 0  # > 0: the recorder's own torch calls pass the guard

    # ---- recording -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self, model: torch.nn.Module) -> Iterator[None]:
        """Inside: model's forward records instead of computing (its modules' ops and backend swapped)."""
        swapped: list[tuple[Any, str, Any]] = []
        backend = _RecordingBackend(self)
        for m in model.modules():
            if isinstance(getattr(m, "ops", None), Ops):
                self.int8 = m.ops.int8_activations
                swapped.append((m, "ops", m.ops))
                m.ops = self._ops(m.ops)
            if isinstance(getattr(m, "attn_backend", None), AttentionBackend):
                swapped.append((m, "attn_backend", m.attn_backend))
                m.attn_backend = backend
        try:
            with _Guard(self), torch.inference_mode():
                yield
        finally:
            for m, name, value in reversed(swapped):
                setattr(m, name, value)

    def _ops(self, ops: Ops) -> Ops:
        def refuse(name: str) -> Callable[..., Any]:
            def op(*args: Any, **kwargs: Any) -> Any:
                raise Unrecordable(f"Ops.{name}")
            return op

        calls = {
            f.name: (getattr(self, self.RECORDERS[f.name]) if f.name in self.RECORDERS else refuse(f.name))
            for f in dataclasses.fields(ops)
            if callable(getattr(ops, f.name))
        }
        return dataclasses.replace(ops, **calls)

    def temp(self, *shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
        """A buffer an op makes: not written while recording (so, at any size, its pages are never touched);
        `finish` gives it pool memory, or keeps it as an output."""
        # a plain tensor: the replay's outputs are written after
        with self.quiet(), torch.inference_mode(False):
            t = torch.empty(shape, dtype=dtype)
        self._temps[t.untyped_storage().data_ptr()] = t
        return t

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def scratch(self, name: str, nbytes: int) -> Ptr:
        self._scratch[name] = max(self._scratch.get(name, 0), nbytes)
        return Ptr(name)

    # ---- the ops' recorders (signatures: kernels/ops.py's) -------------------------------------------
    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        if weight.dtype != F32 or not weight.is_contiguous():
            raise Unrecordable("add_rms_norm with a weight the C kernel does not take")
        if _rows(x) and (delta is None or (_rows(delta) and delta.shape == x.shape)):
            out = self.temp(*x.shape)
            ldd = 0 if delta is None else delta.stride(0)
            if delta is None and self.nodes and self.nodes[-1].kind == sg.ADD:  # the add, folded in
                add = self.nodes[-1]
                if add.arg("x") == Ptr.of(x) and add.arg("ldx") == x.stride(0) and add.arg("n") == x.shape[1]:
                    self.nodes.pop()
                    delta, ldd = add.arg("delta"), add.arg("ldd")  # type: ignore[assignment]
            self.nodes.append(
                Node(
                    sg.NORM,
                    x=x,
                    ldx=x.stride(0),
                    delta=delta,
                    ldd=ldd,
                    w=weight,
                    n=x.shape[1],
                    eps=eps,
                    out=out,
                    ldo=out.stride(0),
                )
            )
            return out
        if _rows(x, 3) and delta is None and x.stride(1) == x.shape[2]:  # each token's heads, a row each
            out = self.temp(*x.shape)
            self.nodes.append(Node(sg.HEAD_NORM, x=x, ld_token=x.stride(0), heads=x.shape[1], w=weight,
                                   D=x.shape[2], eps=eps, out=out, ld_out_token=out.stride(0)))
            return out
        raise Unrecordable("add_rms_norm of a layout the C kernel does not take")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._act(sg.SILU_MUL, gate_up)

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._act(sg.GELU_MUL, gate_up)

    def _act(self, kind: int, gate_up: torch.Tensor) -> torch.Tensor:
        if not _rows(gate_up) or gate_up.shape[1] % 2:
            raise Unrecordable("an activation of a layout the C kernel does not take")
        out = self.temp(gate_up.shape[0], gate_up.shape[1] // 2)
        self.nodes.append(Node(kind, gate_up=gate_up, ldg=gate_up.stride(0), n=out.shape[1], out=out,
                               ldo=out.stride(0)))
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, s = (self._gathers.get(t.untyped_storage().data_ptr()) for t in (cos, sin))
        if c is None or s is None or c[1] is not s[1] or not _rows(x, 3) or x.shape[2] % 2:
            raise Unrecordable("rotary from tables other than a RoPE table's rows at the step's positions")
        (cos_table, positions), sin_table = c, s[0]
        out = self.temp(*x.shape)
        self.nodes.append(Node(sg.ROTARY, x=x, ldx=x.stride(0), ldh=x.stride(1), cos=cos_table, sin=sin_table,
                               D=x.shape[2], H=x.shape[1], positions=positions, out=out))
        return out

    def linear(self, x: torch.Tensor, quant: Any, dense: Any, weight: Any, packed: Any,
               bias: torch.Tensor | None) -> torch.Tensor:
        """kernels/linear_product.py's choice: the blocks, or a float weight for rows the kernel takes."""
        w = quant if quant is not None else dense if dense is not None and dense_takes(dense, x) else None
        if (
            w is None
            or not _rows(x)
            or (bias is not None and (bias.dtype != F32 or not bias.is_contiguous()))
        ):
            raise Unrecordable("a linear product in torch (no weight form the C kernel takes)")
        int8 = self.int8 and quant is not None
        y = self.temp(x.shape[0], w.out_features)
        ep = sg.entry_points()
        q8 = self.scratch("q8", quant_linear.q8_bytes(x.shape[0], w.in_features)) if int8 else None
        col = 0
        for part in w.parts if isinstance(w, QuantRows) else (w,):  # each into its own columns of y
            self.nodes.append(Node(
                sg.QLINEAR, x=x, K=part.in_features, ldx=x.stride(0), w=part.data, kind=part.kind,
                N=part.out_features, y=Ptr.of(y, 4 * col), ldy=y.stride(0),
                bias=None if bias is None else Ptr.of(bias, 4 * col), min_macs=quant_linear.PARALLEL_MIN_MACS,
                quantize_part=ep["quantize_q8"] if int8 else 0, q8_part=ep["quant_linear_q8"] if int8 else 0,
                q8=q8))
            col += part.out_features
        return y

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: Any,
                 cols: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
        """Each row's adapter's delta into y; the rows' slots (rows.slot_of_row) are the replay's input."""
        whole = a.is_contiguous() and b.is_contiguous()
        if not (_rows(x) and _rows(y) and a.dtype == b.dtype == F32 and whole):
            raise Unrecordable("a LoRA delta of a layout the C kernel does not take")
        tmp = self.scratch("lora_tmp", 4 * y.shape[0] * a.shape[1])  # x A^T between the two phases' nodes
        for phase in (0, 1):
            self.nodes.append(Node(sg.LORA, y=y, ldy=y.stride(0), x=x, ldx=x.stride(0),
                                   slots=rows.slot_of_row, a=a, b=b, r=a.shape[1], k=a.shape[2], n=b.shape[2],
                                   cols=cols, parts=cols.shape[0] - 1, ranks=ranks, tmp=tmp, phase=phase))
        return y

    def moe_layer(self, x: torch.Tensor, w13: Any, w2: Any, top_k: int, renormalize: bool,
                  router: torch.Tensor) -> torch.Tensor:
        if not _rows(x):
            raise Unrecordable("an MoE layer of a layout the C kernel does not take")
        ids, wts = self.temp(x.shape[0], top_k, dtype=torch.int64), self.temp(x.shape[0], top_k)
        y = self.temp(*x.shape)
        self.nodes.append(
            Node(
                sg.MOE,
                x=x,
                H=x.shape[1],
                ldx=x.stride(0),
                router=router,
                E=w13.num_experts,
                k=top_k,
                renorm=int(renormalize),
                ids=ids,
                wts=wts,
                w13=w13.pointers,
                kind13=w13.kind,
                N13=w13.out_features,
                w2=w2.pointers,
                kind2=w2.kind,
                I=w2.in_features,
                y=y,
                ldy=y.stride(0),
            )
        )
        return y

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                  slot_map: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Layer `layer`'s K/V written (to the sliding layers' own pool through its map) and q attended."""
        kv, b = self.kv, self.batch
        D, H, Hkv = q.shape[2], q.shape[1], k.shape[1]
        heads_in_rows = all(_rows(t, 3) and t.stride(1) == D for t in (k, v))
        if not _rows(q, 3) or not heads_in_rows or kv.dtype not in KV_TYPES or (
                slot_map is not None and slot_map is not kv.swa_map):
            raise Unrecordable("attention of a layout the C kernel does not take")
        kp, vp, rtt, pool = kv.k[layer], kv.v[layer], kv.req_to_token, KV_TYPES[kv.dtype]
        mapped = bool(window) and slot_map is not None
        self.nodes.append(
            Node(
                sg.KV_WRITE,
                k=k,
                ldk=k.stride(0),
                v=v,
                ldv=v.stride(0),
                k_pool=kp,
                v_pool=vp,
                width=Hkv * D,
                slots=self.swa_slots if mapped else b.out_cache_loc,
                pool_type=pool,
            )
        )
        work_stride = H // Hkv * (-(-self.max_context // 8) * 8)  # a thread's scores
        out = self.temp(q.shape[0], H, D)
        self.nodes.append(
            Node(
                sg.ATTENTION,
                q=q,
                ldq=q.stride(0),
                ldqh=q.stride(1),
                k_pool=kp,
                v_pool=vp,
                slot_stride=kp.stride(0),
                rtt=rtt,
                ld_rtt=rtt.stride(0),
                rows=b.req_pool_indices,
                lens=b.seq_lens,
                slot_buf=self.scratch("attn_slots", 8 * self.mb * rtt.shape[1]),
                H=H,
                Hkv=Hkv,
                D=D,
                scale=scale,
                out=out,
                work=self.scratch("attn_work", 4 * self.threads * work_stride),
                work_stride=work_stride,
                min_keys=paged_attention.PARALLEL_MIN_KEYS,
                pool_type=pool,
                window=window,
                slot_map=kv.swa_map if mapped else None,
            )
        )
        return out

    # ---- torch's ops in the forward (the guard's) -----------------------------------------------------
    def torch_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func.is_view:  # a view moves a pointer; anything that copies under a view's name is refused
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() != args[0].untyped_storage(
                    ).data_ptr():
                raise Unrecordable(f"torch op {func} (a copy)")
            return out
        packet = func.overloadpacket
        if packet is aten.embedding and _rows(args[0]) and args[1] is self.batch.input_ids:
            table = args[0]
            out = self.temp(self.mb, table.shape[1])
            self.nodes.append(Node(sg.EMBED, table=table, hidden=table.shape[1], ids=args[1], out=out,
                                   ld_out=out.stride(0), scale=None))
            return out
        if packet is aten.mul_ and self.nodes and self.nodes[-1].kind == sg.EMBED and (
                self.nodes[-1].arg("out") == Ptr.of(args[0]) and self.nodes[-1].arg("scale") == 0):
            scale = args[1]
            if not isinstance(scale, torch.Tensor) or (scale.dim() == 0 and scale.dtype == F32):
                with self.quiet():
                    self.nodes[-1].set("scale", sg.float_bits(float(scale)))
                return args[0]
        if packet is aten.add_ and kwargs.get("alpha", 1) == 1 and len(args) == 2:
            x, d = args
            if isinstance(d, torch.Tensor) and _rows(x) and _rows(d) and d.shape == x.shape:
                self.nodes.append(Node(sg.ADD, x=x, ldx=x.stride(0), delta=d, ldd=d.stride(0), n=x.shape[1]))
                return x
        if packet is aten.index and len(args[1]) == 1:
            table, (idx,) = args[0], args[1]
            if idx is self.batch.logits_indices:  # a decode step wants every row's logits, in order
                with self.quiet():
                    return table.view(table.shape)
            if idx is self.batch.positions and table.dim() == 2 and table.is_contiguous():
                # never filled: a node reads the table
                rows = self.temp(self.mb, table.shape[1], dtype=table.dtype)
                self._gathers[rows.untyped_storage().data_ptr()] = (table, idx)
                return rows
        raise Unrecordable(f"torch op {func}")

    def finish(self, outputs: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The nodes as the replayer takes them, and the buffers they point into (worker/step_buffers.py);
        outputs are the buffers read after the replay."""
        if any(p.base in self._gathers for node in self.nodes for p in node.pointers()):
            raise Unrecordable("a kernel reading gathered rows torch never computed")
        return lay_out(self.nodes, self._temps, outputs, self._scratch)


class _Guard(TorchDispatchMode):
    """Every torch op the forward runs while recording: the recorder's own pass, the rest it judges."""

    def __init__(self, rec: StepRecorder) -> None:
        super().__init__()
        self.rec = rec

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Recent torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable unless this says no, and the
        # wrapper's first call imports torch._dynamo: 1.2 s of a worker's start. Nothing here runs compiled.
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.rec._quiet:
            return func(*args, **(kwargs or {}))
        with self.rec.quiet():
            return self.rec.torch_op(func, args, kwargs or {})


class _RecordingBackend(AttentionBackend):
    """The attention backend while recording: its plan is the layer kind's window and slot map."""

    name = "recording"

    def __init__(self, rec: StepRecorder) -> None:
        self.rec = rec

    def plan(
        self, batch: ForwardBatch, kv: KVCache, window: int = 0, slot_map: torch.Tensor | None = None
    ) -> Any:
        return window, slot_map

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: KVCache,
        plan: Any,
        scale: float,
    ) -> torch.Tensor:
        return self.rec.attention(layer_id, q, k, v, *plan, scale)

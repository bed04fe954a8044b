"""Weight-holding layers that run float, INT8 or INT4 weights.

INT4 (the store's ``int4-asym-g32``: ``weight: uint8 [N, K/2]``, ``weight_scale`` / ``weight_zero``: bf16
``[N, K/32]``) is repacked once loaded for the CPU int4 kernel and runs it at every M (``compute.kernels.int4``);
after that ``weight`` holds the kernel's packing (opaque, same shape) and scale / zero are views of its table.

INT8 is the store's ``int8-absmax-per-row`` scheme: ``weight: int8 [N, K]``,
``weight_scale: fp32 [N]``, ``w ~= q * scale[:, None]``. Weights are assigned
(``assign``), never copied twice: an int8 weight stays int8 in memory; a float
weight is converted at most once, to the activation dtype.

Kernel choice per phase (measured on a 2-core AVX2 box without AVX-512, torch 2.13
CPU, 2 threads, min of 15 runs, microseconds; ``int8mm`` is
``torch.ops.aten._weight_int8pack_mm`` with bf16 activations; every figure below is
from that CPU, and the AVX-512 picture that follows differs):

    shape N x K    M     bf16 F.linear  int8mm(bf16)  fp32 F.linear  int8mm(fp32 x)
    576 x 576      1            43          22            32            239
    576 x 576      8           311          85           115           2777
    576 x 576      32         1228         346           234          11461
    576 x 576      512       17326        3889          2231              -
    1536 x 576     1           111          61           103            704
    1536 x 576     128       12508        2768          1463              -
    576 x 1536     1           135          83           127            735
    576 x 1536     512       43292       15768          5858              -
    49152 x 576    1          3570        2648          8962          23234
    49152 x 576    8         26726        9528         51895         268438

That CPU (AVX2, no AVX512-BF16/AMX) has no native bf16 GEMM, so bf16 ``F.linear``
loses everywhere and fp32 ``F.linear`` wins from M ~ 32 on; ``int8mm`` wins for
decode-sized M with bf16 activations and is 10-30x slower with fp32 activations.
Per decoder layer of SmolLM2-135M (its 7 linears, int8 weights, bf16 activations,
min of 15 interleaved runs, ms)::

    M                  16     32     48     64     96    128    256
    int8mm           2.63   4.87   7.49   7.11   8.38  15.61  31.11
    dequant + fp32  15.70  14.72  11.37   8.40   9.68   9.21  30.00

A whole SmolLM2-shaped forward (30 layers, random weights): decode of 1 sequence
takes 38 ms with int8 weights (int8mm), 47 ms with bf16 weights, 73 ms with fp32;
a 512-token prefill 1.57 s with int8 weights (dequant path), 1.48 s with fp32
weights, 2.69 s if int8mm were used, 7.1 s with bf16 weights.

On an AVX-512 CPU with avx512_bf16 / avx512_vnni (AMD EPYC, Zen 4 class; see
FIELD-NOTES) the picture is another one: oneDNN runs bf16 ``F.linear`` natively
(``brg_matmul:avx512_core_bf16``), so bf16 weights win prefill there (HF transformers in
bf16: 512-token prefill 0.54 s against our 1.47 s, 32 streams ~264 tok/s against ~151);
``int8mm`` is no GEMM on x86 (int8 -> fp32 inside each 4x4 output tile), its cost linear
in M (3072 x 576: ~100 us at M = 1, ~1.5 ms at M = 32). The rule below is the AVX2
one; it is now only the ``fixed`` mode and the fallback before a plan is set: each machine measures
its own choice per M bucket (``compute/kernels/int8.py``, ``matmul``'s ``plan``). It is *correct* on every CPU.

What ``int8mm`` needs of its inputs (torch 2.13; ``tests/compute/kernels/test_dispatch.py`` runs
it under every ``ATEN_CPU_CAPABILITY`` the machine has), measured on the AVX-512 box:

    dispatch level   weight address   input address   K            outside these
    avx512           16-byte          32-byte         K % 16 == 0  SIGSEGV at M >= 2..4, NaN at M = 1
    avx2             any              16-byte         K % 8 == 0   SIGSEGV at M >= 4
    default          any              any             any          -

so every tensor handed to a kernel is ``ALIGN`` (64) byte aligned (``aligned``: shards
place tensor data at 64-byte offsets of page-aligned buffers, anything else is copied once
at load; an unaligned activation is copied per call), and ``int8mm`` runs only for
K % ``INT8MM_K_MULTIPLE`` == 0 (else the dequant path below, at any M).

Hence (crossover near M = 100 on the AVX2 box):

- int8 weight, M <= ``int8mm_max_m`` (default 64): ``int8mm`` on the input cast to
  bf16 (the kernel's fast path), output cast back to the activation dtype;
- otherwise (prefill-sized M): dequantize the weight on the fly to fp32 (a
  transient, freed after the call) and run fp32 ``F.linear``.

The INT8 runtime keeps the residual stream in fp32: with bf16 activations end to
end, SmolLM2's residual stream (|x| up to ~220 by layer 9) loses enough precision
that greedy answers change ("L'Étoile..." instead of "The capital of France is
Paris."); casting only each matmul's input to bf16 keeps the answer and the speed.

Linears that read the same input are fused (``FusedLinear``: q/k/v, gate/up): one
kernel call over the stacked rows ``[N0 + N1 + ..., K]`` instead of one per linear
(at M = 1 with int8 weights, q/k/v fused take 47 us instead of 64 us). Each HF
linear stays a module of its own name (``LinearPart``), so the store's tensors load
by name; its tensors are copied once into the fused buffer and it keeps views of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from compute.errors import WeightMismatch
from compute.kernels import int4, int8
from compute.kernels.int8 import (  # noqa: F401 - the int8 kernel's needs live beside it; re-exported (model, tests)
    ALIGN,
    INT8MM_K_MULTIPLE,
    aligned,
    dequantize_scratch,
    is_aligned,
)
from paramstore.quant import dequantize_int8 as dequantize  # noqa: F401 - re-exported: the store's int8 scheme

INT8MM_MAX_M = 64  # largest M that uses the int8 kernel (see the table above)


def matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, scale_bf16: torch.Tensor | None,
           bias: torch.Tensor | None, int8mm_max_m: int, cast: bool = True, plan: tuple[str, ...] | None = None,
           w_bf16: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x: [M, K] @ w: [N, K]^T (+ bias) -> [M, N]; the kernel is chosen by w's dtype and M.

    ``plan``: the kernel per M bucket measured on this machine (``compute.kernels.int8``; ``w_bf16``
    is the ``bf16`` kernel's copy); without one, the fixed rule below (int8mm up to
    ``int8mm_max_m``, dequant beyond). The result is in x's dtype; with ``cast=False`` a
    kernel's bf16 output is returned as is, for a caller that promotes it anyway (``x32 + y``
    adds in fp32: the same numbers).
    """
    if w.dtype != torch.int8:
        return F.linear(x, w, bias)
    if plan is not None:
        y = int8.run(plan[int8.bucket(x.shape[0])], x, w, scale, scale_bf16, w_bf16)
        y = y if y.dtype == x.dtype or (not cast and y.dtype == torch.bfloat16) else y.to(x.dtype)
    elif x.shape[0] <= int8mm_max_m and w.shape[1] % INT8MM_K_MULTIPLE == 0 and w.device.type == "cpu":
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(aligned(xb.contiguous()), w, scale_bf16)
        y = y if x.dtype == torch.bfloat16 or not cast else y.to(x.dtype)
    else:
        y = F.linear(x.to(torch.float32), dequantize_scratch(w, scale)).to(x.dtype)
    return y if bias is None else y + bias


class _KernelPlan:
    """The measured kernel per M bucket of an int8 linear (``compute.kernels.int8``), and the copy it needs.

    ``use_kernels`` is called once the weights are in, by ``Transformer.use_kernels``; the plan is
    assigned last, after any bf16 copy exists, so a forward in another thread sees either the old
    plan or the new one with its copy.
    """

    plan: tuple[str, ...] | None = None
    w_bf16: torch.Tensor | None = None  # [N, K] bf16: only if a bucket chose the ``bf16`` kernel

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        raise NotImplementedError

    def prepare_plan(self, plan: Sequence[str]) -> None:
        """The bf16 copy ``plan`` needs, made now (any thread); the current plan is unchanged."""
        qs = self.int8_weight()
        if qs is not None and "bf16" in plan and self.w_bf16 is None:
            self.w_bf16 = aligned(int8.bf16_weight(*qs))

    def use_kernels(self, plan: Sequence[str] | None) -> None:
        qs = self.int8_weight()
        if qs is None or plan is None:
            self.plan, self.w_bf16 = None, None
            return
        if len(plan) != len(int8.BUCKETS) or any(k not in int8.KERNELS for k in plan):
            raise ValueError(f"a kernel plan names one of {int8.KERNELS} per bucket, got {plan!r}")
        self.prepare_plan(plan)
        self.plan = tuple(plan)
        if "bf16" not in plan:
            self.w_bf16 = None


class _WeightSlot(_KernelPlan, nn.Module):
    """Shared loading logic: ``weight`` (float or int8), optional ``weight_scale`` and ``bias``."""

    def __init__(self, out_features: int, in_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.dtype = dtype  # activation dtype; float weights are converted to it once, at load
        self.register_buffer("weight", torch.empty(out_features, in_features), persistent=True)
        self.register_buffer("weight_scale", None)
        self.register_buffer("weight_zero", None)  # int4 only
        self.register_buffer("bias", torch.empty(out_features) if bias else None)
        self._scale_act: torch.Tensor | None = None  # scale in bf16, for int8mm
        self._sz: torch.Tensor | None = None  # int4, once repacked: the kernel's scale/zero [K/32, N, 2] bf16

    INT4 = False  # whether an int4 weight may load here (the linears; not the embedding)

    @property
    def is_int8(self) -> bool:
        return self.weight.dtype == torch.int8

    @property
    def is_int4(self) -> bool:
        return self.weight.dtype == torch.uint8

    def _groups(self) -> tuple[int, int]:
        return (self.out_features, self.in_features // int4.GROUP)

    def prepare(self, leaf: str, t: torch.Tensor) -> torch.Tensor:
        """Check one tensor by its leaf name (``weight``, ``weight_scale``, ``bias``) -> its runtime form."""
        if leaf == "weight" and t.dtype == torch.uint8:  # int4 codes, two per byte
            if not self.INT4 or self.in_features % int4.GROUP:
                raise WeightMismatch(f"an int4 weight cannot load into {type(self).__name__} with K = "
                                     f"{self.in_features} (int4 needs a linear with K % {int4.GROUP} == 0)")  # fmt: skip
            _check_shape(t, (self.out_features, self.in_features // 2), leaf)
            if t.device.type != "cpu":
                raise WeightMismatch(f"int4 weights run on the CPU only (got one on {t.device}): a node elsewhere "
                                     "loads an int4 import dequantized (compute.modeling.loader)")  # fmt: skip
            return t if t.is_contiguous() else t.contiguous()
        if leaf in ("weight_scale", "weight_zero") and t.dim() == 2:  # int4 groups
            _check_shape(t, self._groups(), leaf)
            return t.to(torch.bfloat16)
        if leaf == "weight":
            _check_shape(t, (self.out_features, self.in_features), leaf)
            if t.dtype != torch.int8:
                t = _as_dtype(t, self.dtype)
            return t if t.is_contiguous() else t.contiguous()
        if leaf == "weight_scale":
            _check_shape(t, (self.out_features,), leaf)
            return t.to(torch.float32)
        if leaf == "bias" and self.bias is not None:
            _check_shape(t, (self.out_features,), leaf)
            return _as_dtype(t, self.dtype)
        raise WeightMismatch(f"unexpected tensor {leaf!r} for {type(self).__name__}")

    def load(self, leaf: str, t: torch.Tensor) -> None:
        """Assign one tensor by its leaf name (no copy when it is already in its runtime form, and aligned)."""
        self._assign(leaf, aligned(self.prepare(leaf, t)))

    def _assign(self, leaf: str, t: torch.Tensor) -> None:
        setattr(self, leaf, t)
        if leaf == "weight_scale" and t.dim() == 1:  # int8 (int4's scale is per group)
            self._scale_act = t.to(torch.bfloat16)

    def missing(self) -> list[str]:
        """Leaf names still unloaded."""
        out = [n for n in ("weight", "bias") if getattr(self, n) is not None and getattr(self, n).is_meta]
        if not self.weight.is_meta and self.is_int8 and self.weight_scale is None:
            out.append("weight_scale")
        if not self.weight.is_meta and self.is_int4:
            out.extend(n for n in ("weight_scale", "weight_zero") if getattr(self, n) is None)
        return out

    def _int4_loaded(self) -> bool:
        """An int4 weight with its scale and zero, not repacked yet."""
        return (self._sz is None and not self.weight.is_meta and self.is_int4 and self.weight_scale is not None
                and self.weight_zero is not None)  # fmt: skip

    def share(self, other: _WeightSlot) -> None:
        """Use ``other``'s tensors (tied embeddings): the same storage, no copy."""
        self.weight, self.weight_scale, self._scale_act = other.weight, other.weight_scale, other._scale_act

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self.weight, self.weight_scale) if self.is_int8 and self.weight_scale is not None else None


class Linear(_WeightSlot):
    """y = x @ W^T (+ b) with W float, INT8 or INT4; picks the kernel by M and dtype."""

    INT4 = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        int8mm_max_m: int = INT8MM_MAX_M,
    ) -> None:
        super().__init__(out_features, in_features, bias, dtype)
        self.int8mm_max_m = int8mm_max_m

    def load(self, leaf: str, t: torch.Tensor) -> None:
        super().load(leaf, t)
        if self._int4_loaded():  # the last of weight / scale / zero: repack for the kernel, release the stored
            w, self._sz = int4.repack_or_mismatch(self.weight, self.weight_scale, self.weight_zero)
            self.weight = w
            self.weight_scale, self.weight_zero = int4.scale_zero_views(self._sz)

    def int4_weight(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self.weight, self._sz) if self._sz is not None else None

    def forward(self, x: torch.Tensor, cast: bool = True) -> torch.Tensor:
        # x: [M, K] -> [M, N] (cast=False: see ``matmul``)
        if self._sz is not None:
            return int4.output(int4.run(x, self.weight, self._sz, self.w_bf16), x, self.bias, cast)
        return matmul(x, self.weight, self.weight_scale, self._scale_act, self.bias, self.int8mm_max_m, cast,
                      self.plan, self.w_bf16)  # fmt: skip


class LinearPart(_WeightSlot):
    """One HF linear (e.g. ``q_proj``) whose rows ``[offset, offset + N)`` live in a ``FusedLinear``.

    Loading copies each tensor into the fused buffer; the part keeps views of it
    (for ``missing`` and for readers of ``.weight``). It has no forward of its own.
    """

    INT4 = True

    def __init__(self, fused: FusedLinear, offset: int, out_features: int, bias: bool) -> None:
        super().__init__(out_features, fused.in_features, bias, fused.dtype)
        self.offset = offset
        object.__setattr__(self, "_fused", fused)  # a back reference, not a submodule

    def load(self, leaf: str, t: torch.Tensor) -> None:
        self._assign(leaf, self._fused.put(self, leaf, self.prepare(leaf, t)))
        self._fused.repack_int4()


class FusedLinear(_KernelPlan, nn.Module):
    """Several linears over the same input as one: y = x @ [W_0; W_1; ...]^T -> [M, N_0 + N_1 + ...].

    ``parts`` are the per-linear modules to register under their HF names. The fused
    tensors are plain attributes (not buffers: the HF names are the parts'),
    allocated when the first part arrives, in its dtype.
    """

    def __init__(self, in_features: int, out_features: Sequence[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32, int8mm_max_m: int = INT8MM_MAX_M) -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, sum(out_features), dtype
        self.int8mm_max_m = int8mm_max_m
        offsets = [sum(out_features[:i]) for i in range(len(out_features))]
        self.parts = tuple(LinearPart(self, o, n, bias) for o, n in zip(offsets, out_features))
        self.w: torch.Tensor | None = None  # [N, K] float or int8
        self.scale: torch.Tensor | None = None  # [N] fp32 (int8 only)
        self.scale_bf16: torch.Tensor | None = None  # [N] bf16, for int8mm
        self.b: torch.Tensor | None = None  # [N] or None
        self.groups: dict[str, torch.Tensor] = {}  # int4 while loading: weight_scale / weight_zero [N, K/32] bf16
        self.sz: torch.Tensor | None = None  # int4, once repacked: the kernel's [K/32, N, 2] bf16

    def put(self, part: LinearPart, leaf: str, t: torch.Tensor) -> torch.Tensor:
        """Copy ``part``'s tensor into its rows of the fused buffer; returns the view."""
        n, rows = self.out_features, slice(part.offset, part.offset + part.out_features)
        if leaf == "weight":
            if self.w is None:
                self.w = torch.empty(n, t.shape[1], dtype=t.dtype, device=t.device)  # int4: [N, K/2]
            elif self.w.dtype != t.dtype:
                raise WeightMismatch(f"weight dtype {t.dtype} differs from its fused siblings' {self.w.dtype}")
            dst = self.w[rows]
        elif leaf in ("weight_scale", "weight_zero") and t.dim() == 2:  # int4 groups
            if leaf not in self.groups:
                self.groups[leaf] = torch.empty(n, t.shape[1], dtype=torch.bfloat16, device=t.device)
            dst = self.groups[leaf][rows]
        elif leaf == "weight_scale":
            if self.scale is None:
                self.scale = torch.empty(n, device=t.device)
                self.scale_bf16 = torch.empty(n, dtype=torch.bfloat16, device=t.device)
            self.scale_bf16[rows] = t
            dst = self.scale[rows]
        else:  # bias
            if self.b is None:
                self.b = torch.empty(n, dtype=t.dtype, device=t.device)
            dst = self.b[rows]
        dst.copy_(t)
        return dst

    def repack_int4(self) -> None:
        """Once every part's int4 weight, scale and zero are in: repack the fused rows for the kernel and point
        the parts at views of the result (the stored copies are released)."""
        if self.sz is not None or not all(p._int4_loaded() for p in self.parts):
            return
        self.w, self.sz = int4.repack_or_mismatch(self.w, self.groups["weight_scale"], self.groups["weight_zero"])
        self.groups = {}
        for p in self.parts:
            rows = slice(p.offset, p.offset + p.out_features)
            p.weight, p._sz = self.w[rows], self.sz
            p.weight_scale, p.weight_zero = int4.scale_zero_views(self.sz, rows)

    def forward(self, x: torch.Tensor, cast: bool = True) -> torch.Tensor:
        # x: [M, K] -> [M, N_0 + N_1 + ...] (cast=False: see ``matmul``)
        if self.sz is not None:
            return int4.output(int4.run(x, self.w, self.sz, self.w_bf16), x, self.b, cast)
        return matmul(x, self.w, self.scale, self.scale_bf16, self.b, self.int8mm_max_m, cast, self.plan, self.w_bf16)

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self.w, self.scale) if self.w is not None and self.w.dtype == torch.int8 else None

    def int4_weight(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the repacked weight, its scale/zero table) once an int4 weight is in; ``w_bf16`` its optional copy."""
        return (self.w, self.sz) if self.sz is not None else None


class Embedding(_WeightSlot):
    """Token embedding; an INT8 table is dequantized row by row on lookup."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(num_embeddings, embedding_dim, False, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, D]
        if not self.is_int8:
            return F.embedding(ids, self.weight)
        return (self.weight[ids].to(torch.float32) * self.weight_scale[ids, None]).to(self.dtype)


def _check_shape(t: torch.Tensor, shape: tuple[int, ...], leaf: str) -> None:
    if tuple(t.shape) != shape:
        raise WeightMismatch(f"{leaf}: expected shape {shape}, got {tuple(t.shape)}")


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if not t.is_floating_point():
        raise WeightMismatch(f"expected a float tensor, got {t.dtype}")
    return t if t.dtype == dtype else t.to(dtype)

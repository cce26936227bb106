"""The real test model: SmolLM2-135M-Instruct converted from its GGUF to a plain HF folder.

The conversion (tests/_smollm2.py) runs once per GGUF and transformers version and is cached on
disk; these tests check that the folder is a plain checkpoint (no GGUF left in it) that gives
the GGUF-loaded model's logits bit for bit, and that the WEB text split is stable.
"""

import json

import pytest
import torch

from tests import _smollm2


def test_folder_is_a_plain_checkpoint(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config  # nothing tells transformers to read a GGUF
    assert not list(smollm2_dir.glob("*.gguf"))
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)
    assert (smollm2_dir / "model.safetensors").is_file() and (smollm2_dir / "tokenizer.json").is_file()


def test_plain_load_gives_the_gguf_logits_exactly(smollm2_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True)
    assert model.dtype == torch.float32
    # recorded at conversion from the GGUF-loaded model (transformers' own GGUF dequantization)
    ref = torch.load(smollm2_dir / _smollm2.REFERENCE_FILE)
    ids = tokenizer(_smollm2.REFERENCE_PROMPT, return_tensors="pt").input_ids
    assert torch.equal(ids, ref["input_ids"])  # the tokenizer survived the conversion too
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.equal(logits, ref["logits"]), (logits - ref["logits"]).abs().max().item()
    # and the model is a language model, not noise: "heavens" -> " and" is the top next token
    nxt = tokenizer.decode(logits[0, -1].argmax().item())
    assert nxt.strip() == "and", nxt


def test_cache_is_written_atomically_and_reused(smollm2_dir, tmp_path, monkeypatch):
    assert _smollm2.smollm2_dir() == smollm2_dir  # the completed folder is found again
    calls = []

    def killed(gguf, out, source):
        calls.append(out)
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # the run is stopped halfway through writing

    monkeypatch.setattr(_smollm2, "_convert", killed)
    with pytest.raises(KeyboardInterrupt):
        _smollm2.smollm2_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []  # no half folder left behind to be trusted later

    def complete(gguf, out, source):
        calls.append(out)
        (out / "config.json").write_text("{}")
        (out / _smollm2._DONE).write_text(json.dumps(source))

    monkeypatch.setattr(_smollm2, "_convert", complete)
    first = _smollm2.smollm2_dir(tmp_path)
    assert _smollm2.smollm2_dir(tmp_path) == first and len(calls) == 2  # converted once, then reused
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
    assert json.loads((first / _smollm2._DONE).read_text())["gguf"] == _smollm2.GGUF_NAME


def test_web_text_split_is_deterministic_and_disjoint(web_text):
    again = _smollm2.web_text()
    assert again == web_text
    assert len(web_text.heldout) > 100 and len(web_text.calibration) > 9 * len(web_text.heldout) - 10
    assert not set(web_text.heldout) & set(web_text.calibration)
    text = web_text.heldout_text()
    assert "{" not in text and "}" not in text  # footnotes removed
    assert text.startswith("Now this is the history of the generations of the sons of Noah")  # Genesis 10

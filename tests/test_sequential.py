"""Block-by-block quantization from safetensors (quantkit.quantize_pretrained, sequential path).

References are the in-memory path on the same checkpoint: the model loaded with
``from_pretrained`` and quantized with ``quantkit.quantize``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import quantkit
from quantkit.pipeline.emit import _affine
from quantkit.sequential import _run as _sequential
from quantkit.sequential._run import quantize_pretrained, parse_size
from quantkit.quantizers import QuantConfig, W8A8Quantizer

transformers = pytest.importorskip("transformers")


def _llama(path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def _bert(path):
    torch.manual_seed(1)
    cfg = transformers.BertConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64)
    transformers.BertModel(cfg).eval().save_pretrained(path)
    return path


def _batches(kind: str, n: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(2)
    out = []
    for i in range(n):
        ids = torch.randint(0, 96, (2, 8), generator=g)
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, 5 + i % 2:] = 0  # padding: padding-aware observers leave these tokens out
        batch = {"input_ids": ids, "attention_mask": mask}
        if kind == "bert":
            batch["token_type_ids"] = torch.zeros(2, 8, dtype=torch.long)
        out.append(batch)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"llama": _llama(root / "llama"), "bert": _bert(root / "bert")}


def _in_memory(path, batches, quantizer):
    model = transformers.AutoModelForCausalLM.from_pretrained(path) if "llama" in str(path) else \
        transformers.AutoModel.from_pretrained(path)
    return quantkit.quantize(model.eval(), batches[0], batches, quantizer, progress=False)


def _assert_same_model(a: torch.nn.Module, b: torch.nn.Module, records_a, records_b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    int8 = [k for k in sa if sa[k].dtype == torch.int8]
    assert len(int8) >= 6, int8  # the linears' weights are folded to int8
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert records_a == records_b  # every scale and zero point, weights and activations


@pytest.fixture(scope="module")
def llama_artifact(checkpoints, tmp_path_factory):
    """The sequential path's artifact of the tiny Llama (default W8A8: min-max observers)."""
    out = tmp_path_factory.mktemp("artifact") / "llama-int8"
    return quantize_pretrained(checkpoints["llama"], _batches("llama"), out=out, sequential=True, progress=False)


# min-max observers for weights in every case; activations: min-max, or the MSE histogram search
@pytest.mark.parametrize("kind,observer", [("llama", "minmax"), ("llama", "mse"), ("bert", "mse")])
def test_sequential_equals_in_memory(checkpoints, kind, observer, monkeypatch, request):
    path = checkpoints[kind]
    batches = _batches(kind)
    quantizer = W8A8Quantizer(QuantConfig(act_observer=observer))
    loaded: list[set] = []
    real = _sequential._Run._load_weights

    def spy(self, block):  # which checkpoint tensors each block reads
        real(self, block)
        loaded.append({self.sources[t] for t in block.attributes if t in self.sources})

    monkeypatch.setattr(_sequential._Run, "_load_weights", spy)
    monkeypatch.setattr(_affine, "_CHUNK_BYTES", 1000)  # weights are quantized in several slices
    spilled: list[bool] = []
    finish = _sequential.ActivationCache.finish
    monkeypatch.setattr(_sequential.ActivationCache, "finish",
                        lambda self, b: (spilled.append(self.next_memory is None), finish(self, b)))
    # a 4 KiB budget: the activations handed between blocks are read back from disk
    seq = quantize_pretrained(path, batches, quantizer, sequential=True, max_memory=4096, progress=False)
    assert spilled and all(spilled[:-1])  # every block but the tail hands values on
    ref = _in_memory(path, batches, quantizer)
    _assert_same_model(seq, ref, seq.meta["quantkit_qparams"], ref.meta["quantkit_qparams"])
    n_layers = 2
    assert len(loaded) == n_layers + 2  # head, one block per layer, tail
    unit = "model.layers." if kind == "llama" else "encoder.layer."
    for i, keys in enumerate(loaded[1:-1]):  # a layer's block reads that layer's tensors only
        assert keys and all(k.startswith(f"{unit}{i}.") for k in keys), keys
    assert all(unit not in k for k in loaded[0] | loaded[-1])
    # the q/dq model computes what the in-memory one does
    assert torch.equal(_logits(seq, batches[0]), _logits(ref, batches[0]))
    if (kind, observer) == ("llama", "minmax"):  # the streamed artifact holds the same tensors
        loaded = quantkit.load(request.getfixturevalue("llama_artifact"))
        state = {k.removeprefix("model."): v for k, v in loaded.state_dict().items()}
        assert sorted(state) == sorted(ref.state_dict())
        assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())
        assert torch.equal(_logits(loaded, batches[1]), _logits(ref, batches[1]))
        # an ordinary .pt2: torch's own reader takes it too (our file; torch.export.load unpickles)
        program = torch.export.load(str(request.getfixturevalue("llama_artifact") / "model.pt2"))
        assert torch.equal(_logits(program.module(), batches[1]), _logits(ref, batches[1]))


def _logits(model, batch):
    out = model(**batch)
    return out["logits"] if "logits" in out else out["last_hidden_state"]


_CHILD = textwrap.dedent("""
    import sys, torch
    sys.path.append({root!r})  # appended: tests/kernels/ must not shadow the hub package transformers imports
    from tests.test_sequential import _batches
    from quantkit.sequential._run import quantize_pretrained
    quantize_pretrained({model!r}, _batches("llama"), out={out!r}, sequential=True, progress=False)
""")


def test_interrupted_run_resumes_to_the_same_artifact(checkpoints, llama_artifact, tmp_path, monkeypatch):
    path, full = checkpoints["llama"], llama_artifact
    out = tmp_path / "resumed"
    env = {**os.environ, _sequential.KILL_AFTER_ENV: "1"}  # SIGKILL once head and layer 0 are done
    code = _CHILD.format(root=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), model=str(path), out=str(out))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not out.exists()
    partial = _sequential.PartialDir.beside(out)
    assert json.loads((partial / "state.json").read_text())["done"] == 1
    ran: list[int] = []
    real = _sequential._Run._load_weights
    monkeypatch.setattr(_sequential._Run, "_load_weights", lambda self, b: (ran.append(b.index), real(self, b)))
    quantize_pretrained(path, _batches("llama"), out=out, sequential=True, resume=True, progress=False)
    assert ran == [2, 3]  # layer 1 and the tail: blocks 0 (head) and 1 (layer 0) were not run again
    assert not partial.exists()
    a, b = quantkit.load(full), quantkit.load(out)
    _assert_same_model(a, b, json.loads((full / "quantization.json").read_text())["tensors"],
                       json.loads((out / "quantization.json").read_text())["tensors"])
    assert torch.equal(_logits(a, _batches("llama")[1]), _logits(b, _batches("llama")[1]))


def _rewrite(src, dst, edit):
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("damage,message", [
    ("missing", "has no tensor 'model.layers.1.mlp.up_proj.weight'"),
    ("shape", "tensor 'model.layers.1.mlp.up_proj.weight' in .* has shape \\[64, 31\\], the model expects \\[64, 32\\]"),
])
def test_damaged_checkpoint_fails_naming_the_tensor(checkpoints, tmp_path, damage, message):
    key = "model.layers.1.mlp.up_proj.weight"

    def edit(t):
        if damage == "missing":
            del t[key]
        else:
            t[key] = t[key][:, :31].contiguous()

    path = _rewrite(checkpoints["llama"], tmp_path / "bad", edit)
    out = tmp_path / "out"
    with pytest.raises(quantkit.QuantkitError, match=message) as info:
        quantize_pretrained(path, _batches("llama"), out=out, sequential=True, progress=False)
    assert "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]  # no output, no partial directory


def test_max_memory_chooses_the_path(checkpoints, monkeypatch):
    calls = []
    monkeypatch.setattr(_sequential, "_in_memory", lambda *a, **k: calls.append("memory"))
    monkeypatch.setattr(_sequential._Run, "run", lambda self: calls.append("sequential"))
    path = checkpoints["llama"]
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    quantize_pretrained(path, _batches("llama"), max_memory=int(size * 1.2), progress=False)
    # the in-memory path also holds the captured graph and its export (tens of MiB, measured), not only 2x weights
    quantize_pretrained(path, _batches("llama"), max_memory=size * 3 + (1 << 30), progress=False)
    quantize_pretrained(path, _batches("llama"), progress=False)
    assert calls == ["sequential", "memory", "memory"]


@pytest.mark.parametrize("text,expected", [("4GiB", 4 * 2**30), ("512MB", 512 * 10**6), ("1.5G", 1_500_000_000),
                                           ("100", 100), ("2 MiB", 2 * 2**20), (4096, 4096)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["4 GB RAM", "-1", "0", "GiB", "4i"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_cli_max_memory_quantizes_block_by_block(checkpoints, tmp_path, capsys):
    from quantkit.cli import main

    calib = tmp_path / "calib"
    calib.mkdir()
    g = torch.Generator().manual_seed(3)
    for i in range(4):  # token ids of sequences of different lengths: padded and masked per batch
        torch.save(torch.randint(0, 96, (5 + i,), generator=g), calib / f"s{i}.pt")
    out = tmp_path / "out"
    args = ["quantize", str(checkpoints["llama"]), "--calib", str(calib), "--out", str(out), "--batch-size", "2"]
    assert main(args + ["--max-memory", "lots"]) == 2
    assert "--max-memory" in capsys.readouterr().err
    # the checkpoint is ~200 KB, but a budget is kept with the graph too (quantkit.sequential._budget)
    assert main(args + ["--sequential", "--max-memory", "100MiB", "--quiet"]) == 0
    doc = json.loads((out / "quantization.json").read_text())
    assert doc["source"]["sequential"] is True and doc["source"]["max_memory"] == "100MiB"
    # the block-by-block CLI records the scheme's config like the in-memory one: the default static W8A8
    from quantkit.quantizers import QuantConfig, SchemeConfig
    assert doc["config"]["type"] == "QuantConfig", doc.get("config")
    cfg = SchemeConfig.from_dict(doc["config"])
    assert isinstance(cfg, QuantConfig) and cfg.dynamic is False
    qmodel = quantkit.load(out)
    assert qmodel.meta["quantkit_config"] == cfg
    ids = torch.randint(0, 96, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    got = qmodel(input_ids=ids, attention_mask=mask)["logits"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["llama"]).eval()(
        input_ids=ids, attention_mask=mask).logits
    sqnr = 10 * torch.log10(ref.pow(2).mean() / (got - ref).pow(2).mean())
    assert sqnr > 25, f"int8 vs float logits SQNR {sqnr:.1f} dB"
    assert not _sequential.PartialDir.beside(out).exists()


def test_awq_is_refused_before_any_block_runs(checkpoints, tmp_path):
    quantizer = W8A8Quantizer(QuantConfig(weight_algorithm="awq"))
    with pytest.raises(quantkit.QuantkitError, match="weight_algorithm='awq' .* not supported block by block"):
        quantize_pretrained(checkpoints["llama"], _batches("llama"), quantizer, out=tmp_path / "o", sequential=True,
                            progress=False)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_while_writing_resumes_without_running_blocks(checkpoints, llama_artifact, tmp_path, monkeypatch):
    path, out = checkpoints["llama"], tmp_path / "out"
    real_finish = _sequential._Run._finish

    def interrupted(self, partial):
        raise KeyboardInterrupt  # Ctrl-C once every block is done, before the artifact is written

    monkeypatch.setattr(_sequential._Run, "_finish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize_pretrained(path, _batches("llama"), out=out, sequential=True, progress=False)
    assert not out.exists()
    monkeypatch.setattr(_sequential._Run, "_finish", real_finish)
    ran: list[int] = []
    real = _sequential._Run._load_weights
    monkeypatch.setattr(_sequential._Run, "_load_weights", lambda self, b: (ran.append(b.index), real(self, b)))
    quantize_pretrained(path, _batches("llama"), out=out, sequential=True, resume=True, progress=False)
    assert ran == []
    a, b = quantkit.load(llama_artifact).state_dict(), quantkit.load(out).state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("layers,unit", [(1, ("model.layers", 1)), (3, ("model.layers", 3))])
def test_partition_finds_the_layers_from_the_graph(tmp_path, layers, unit):
    from quantkit.pipeline._meta_capture import capture_without_weights, empty_model
    from quantkit.pipeline._partition import find_repeated_unit, partition

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp_path)  # config.json only: the capture reads no weights
    gm = capture_without_weights(empty_model(tmp_path), _batches("llama")[0])
    assert find_repeated_unit(gm) == unit
    blocks = partition(gm)
    assert [b.name for b in blocks] == ["head"] + [f"model.layers.{i}" for i in range(layers)] + ["tail"]
    for i, b in enumerate(blocks[1:-1]):  # each layer's block reads exactly that layer's weights
        assert b.attributes and all(a.startswith(f"model.layers.{i}.") for a in b.attributes)
        assert len(b.inputs) >= 3  # hidden states, mask, rotary cos and sin cross the boundary
    assert "lm_head.weight" in blocks[-1].attributes and "model.embed_tokens.weight" in blocks[0].attributes


def test_config_is_a_preset_name_or_a_scheme_config(checkpoints, tmp_path):
    """quantize_pretrained(config=) gives its quantizer's model on both paths and records the config;
    quantizer= with config=, or an unknown name, is one line."""
    from quantkit.quantizers import get_scheme
    from quantkit.quantizers._scheme import SchemeError

    path, batches = checkpoints["llama"], _batches("llama")
    seq = quantize_pretrained(path, batches, config="w8a8", sequential=True, progress=False)
    ref = quantize_pretrained(path, batches, W8A8Quantizer(), sequential=True, progress=False)
    _assert_same_model(seq, ref, seq.meta["quantkit_qparams"], ref.meta["quantkit_qparams"])
    assert seq.meta["quantkit_config"] == get_scheme("w8a8")
    out = quantize_pretrained(path, batches, config=get_scheme("w8a8"), sequential=False, out=tmp_path / "a",
                              progress=False)
    assert quantkit.load(out).meta["quantkit_config"] == get_scheme("w8a8")
    with pytest.raises(SchemeError, match="pass quantizer= or config=, not both"):
        quantize_pretrained(path, batches, W8A8Quantizer(), config="w8a8")
    with pytest.raises(SchemeError, match="w9a9.*w8a8"):
        quantize_pretrained(path, batches, config="w9a9")

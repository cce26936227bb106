"""Adversarial config.json sizes, and a memory budget that holds (issue 26, items 4 and 10).

A config whose sizes are impossible (negative, zero, non-integer, absurd) or do not match the
checkpoint (layers it does not have, a vocabulary that is not the embedding's row count) fails
in one line naming the field and its value, on the in-memory path, the block-by-block path
and in ``quantkit eval``, before any module is constructed. Each case checks the failure
contract of ``tests/_hostile.py``: the exit code, exactly one stderr line, unchanged inputs
and nothing left at ``--out``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from quantkit import QuantkitError, _hf, _sizing
from quantkit.cli import main
from tests._hostile import _fails, _tree

transformers = pytest.importorskip("transformers")

# the checks read config.json and the safetensors headers only (measured well under 1 s);
# generous for a loaded CI box, and far below the minutes an absurd config used to take
FAST_S = 10
VOCAB, HIDDEN, LAYERS = 96, 32, 2


# --- fixtures ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A random tiny Llama (2 layers, hidden 32, vocab 96) saved with save_pretrained."""
    path = tmp_path_factory.mktemp("cfg") / "llama"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                                   num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def calib_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calib")
    g = torch.Generator().manual_seed(3)
    for i in range(4):
        torch.save(torch.randint(0, VOCAB, (6 + i,), generator=g), path / f"s{i}.pt")
    return path


def _edited(src: Path, dst: Path, **fields) -> Path:
    """A copy of the checkpoint ``src`` whose config.json has ``fields`` set."""
    shutil.copytree(src, dst)
    doc = json.loads((dst / "config.json").read_text())
    doc.update(fields)
    (dst / "config.json").write_text(json.dumps(doc))
    return dst


class _Built:
    """Counts model modules constructed while active: transformers' classes and the layers
    that hold weights (observers, which are modules too, are not the model)."""

    def __init__(self, monkeypatch):
        self.count = 0
        init = torch.nn.Module.__init__

        def counting(module, *a, **k):
            if type(module).__module__.startswith("transformers") or isinstance(
                    module, (torch.nn.Linear, torch.nn.Embedding)):
                self.count += 1
            init(module, *a, **k)

        monkeypatch.setattr(torch.nn.Module, "__init__", counting)


def _quantize_fails(model: Path, calib: Path, out: Path, capsys, monkeypatch, *extra) -> str:
    built = _Built(monkeypatch)
    t = time.perf_counter()
    line = _fails(["quantize", str(model), "--calib", str(calib), "--out", str(out), "--quiet", *extra],
                  capsys, code=1, inputs=[model, calib], out=out)
    elapsed = time.perf_counter() - t
    assert built.count == 0, f"{built.count} modules were constructed before the config was refused: {line}"
    assert elapsed < FAST_S, f"took {elapsed:.1f} s: {line}"
    return line


@pytest.fixture(autouse=True)
def _warm(llama_dir):
    """Import what the CLI imports once, so that a case's time is its own checks."""
    _hf.model_class(llama_dir)


# --- impossible or inconsistent sizes: both quantize paths -----------------------------------

CASES = {
    # field, value, what the one line must say beside the field and value
    "absurd-layers": ("num_hidden_layers", 10 ** 9, f"checkpoint has {LAYERS} layers"),
    "absurd-vocab": ("vocab_size", 10 ** 12, f"{VOCAB} rows"),
    "negative-layers": ("num_hidden_layers", -3, "not a positive integer"),
    "zero-hidden": ("hidden_size", 0, "not a positive integer"),
    "float-width": ("intermediate_size", 64.0, "not a positive integer"),
    "string-heads": ("num_attention_heads", "4", "not a positive integer"),
    "bool-layers": ("num_hidden_layers", True, "not a positive integer"),
    "one-layer-too-many": ("num_hidden_layers", LAYERS + 1, f"checkpoint has {LAYERS} layers"),
    "vocab-off-by-one": ("vocab_size", VOCAB + 1, f"{VOCAB} rows"),
    "hidden-mismatch": ("hidden_size", 48, "no tensor of the checkpoint has a dimension of 48"),
    "absurd-width": ("intermediate_size", 10 ** 12, "larger than every dimension"),
    "absurd-positions": ("max_position_embeddings", 10 ** 12, "more positions"),
}


@pytest.mark.parametrize("path", ["in-memory", "sequential"])
@pytest.mark.parametrize("case", list(CASES))
def test_impossible_config_is_one_line(case, path, llama_dir, calib_dir, tmp_path, capsys, monkeypatch):
    field, value, says = CASES[case]
    model = _edited(llama_dir, tmp_path / "model", **{field: value})
    extra = ["--sequential"] if path == "sequential" else []
    line = _quantize_fails(model, calib_dir, tmp_path / "out", capsys, monkeypatch, *extra)
    assert f"{field} = {json.dumps(value)}" in line, line
    assert says in line, line


def test_allow_missing_weights_does_not_build_a_model_larger_than_memory(llama_dir, calib_dir, tmp_path, capsys,
                                                                          monkeypatch):
    """--allow-missing-weights lets missing layers through, but a billion of them is refused
    from the sizes alone: the model config.json describes would not fit this machine."""
    model = _edited(llama_dir, tmp_path / "model", num_hidden_layers=10 ** 9)
    line = _quantize_fails(model, calib_dir, tmp_path / "out", capsys, monkeypatch, "--allow-missing-weights")
    assert "for its weights alone" in line and "--max-memory" in line, line
    # independent expectation: a layer of this checkpoint times 10**9 is terabytes
    with open(model / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    layer0 = sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items()
                 if k.startswith("model.layers.0."))
    assert layer0 * 10 ** 9 > 2 ** 40


def test_in_memory_model_larger_than_memory(llama_dir, calib_dir, tmp_path, capsys, monkeypatch):
    """A consistent config whose weights do not fit the memory left: one line pointing to the
    block-by-block path, before the checkpoint is loaded."""
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    weights = (model / "model.safetensors").stat().st_size
    monkeypatch.setattr(_hf, "available_memory", lambda: weights // 4)
    line = _quantize_fails(model, calib_dir, tmp_path / "out", capsys, monkeypatch)
    assert "for its weights alone" in line and "--max-memory" in line, line


def test_eval_refuses_an_edited_config_before_building(llama_dir, calib_dir, tmp_path, capsys, monkeypatch):
    """quantkit eval rebuilds the float model from config.json: an absurd vocab there (edited
    after quantizing) is refused in one line before anything is built."""
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    art = tmp_path / "art"
    assert main(["quantize", str(model), "--calib", str(calib_dir), "--out", str(art), "--quiet",
                 "--batch-size", "2"]) == 0
    capsys.readouterr()
    doc = json.loads((model / "config.json").read_text())
    doc["vocab_size"] = 10 ** 12
    (model / "config.json").write_text(json.dumps(doc))
    built = _Built(monkeypatch)
    line = _fails(["eval", str(art), "--data", str(calib_dir), "--quiet"], capsys, code=1, inputs=[model, art])
    assert "vocab_size = 1000000000000" in line and f"{VOCAB} rows" in line, line
    assert built.count == 0


def test_header_that_lies_about_its_tensors(llama_dir, calib_dir, tmp_path, capsys, monkeypatch):
    """A safetensors header claiming a tensor far larger than the file is refused from the
    header; no byte of the claimed range is read."""
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    f = model / "model.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = "model.embed_tokens.weight"
    header[name]["shape"] = [10 ** 12, HIDDEN]
    text = json.dumps(header).encode()
    f.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    line = _quantize_fails(model, calib_dir, tmp_path / "out", capsys, monkeypatch)
    assert "model.safetensors" in line and "not a valid safetensors file" in line, line


# --- any architecture: names and shapes, not a Llama formula ---------------------------------

def _checkpoint(directory: Path, config: dict, tensors: dict[str, tuple[int, ...]]) -> Path:
    from safetensors.torch import save_file

    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: torch.zeros(s) for k, s in tensors.items()}, str(directory / "model.safetensors"))
    return directory


GPT2_LIKE = {"transformer.wte.weight": (50, 8), "transformer.wpe.weight": (16, 8),
             **{f"transformer.h.{i}.mlp.c_fc.weight": (8, 32) for i in range(3)}}


@pytest.mark.parametrize("config,needle", [
    ({"n_layer": 4, "n_embd": 8, "vocab_size": 50, "n_positions": 16}, "n_layer = 4 but the checkpoint has 3 layers"),
    ({"n_layer": 3, "n_embd": 8, "vocab_size": 51, "n_positions": 16}, "vocab_size = 51 but the checkpoint's "
                                                                        "embedding transformer.wte.weight has 50 rows"),
    ({"n_layer": 3, "n_embd": 8, "vocab_size": 50, "n_positions": 17}, "n_positions = 17 but the checkpoint's "
                                                                        "position table transformer.wpe.weight"),
    ({"n_layer": 3, "vocab_size": 50, "text_config": {"num_hidden_layers": 10 ** 9}},
     "text_config.num_hidden_layers = 1000000000 but the checkpoint has 3 layers"),
])
def test_sizes_are_read_from_names_and_shapes(config, needle, tmp_path):
    """GPT-2 style names (``transformer.h.N``, ``wte``, ``wpe``) and a nested sub-config: the
    same rules, no architecture formula (and nothing is built: these are not real models)."""
    path = _checkpoint(tmp_path / "m", config, GPT2_LIKE)
    before = _tree(path)
    with pytest.raises(QuantkitError) as info:
        _sizing.check_config(path)
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert _tree(path) == before


def test_consistent_configs_pass(tmp_path):
    """The checks do not refuse what transformers itself saves (several architectures)."""
    T = transformers
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    models = {
        "bert": lambda: T.BertForSequenceClassification(T.BertConfig(vocab_size=100, **small)),
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100)),
        "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4,
                                                              vocab_size=100, d_kv=8)),
        "distilbert": lambda: T.DistilBertModel(T.DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=4,
                                                                   hidden_dim=64)),
        "albert": lambda: T.AlbertModel(T.AlbertConfig(vocab_size=100, embedding_size=16, **small)),
    }
    for name, make in models.items():
        torch.manual_seed(0)
        make().save_pretrained(tmp_path / name)
        size = _sizing.check_config(tmp_path / name)
        assert size.weight_bytes == sum(t.numel() * t.element_size() for t in _load(tmp_path / name).values())
        assert size.layers in (1, 2), (name, size)


def _load(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# --- a memory budget is a promise ------------------------------------------------------------

# runs a command and reports its own children's peak RSS: a fresh interpreter without torch,
# since Linux carries ru_maxrss across exec from the image a child was forked from (the pytest
# process would otherwise be counted)
_LAUNCHER = r"""
import json, resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(json.dumps({"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
                  "maxrss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def _peak(cmd: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", _LAUNCHER, *cmd], capture_output=True, text=True, check=True,
                          env={**os.environ, "TQDM_DISABLE": "1"})
    return json.loads(done.stdout)


def _random_llama(path: Path, *, hidden: int, intermediate: int, layers: int, vocab: int) -> int:
    """A random-weight Llama checkpoint (save_pretrained layout) written tensor by tensor; its bytes."""
    from safetensors.torch import save_file

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                   num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                   num_key_value_heads=hidden // 64, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.LlamaForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.ones(s) if k.endswith("norm.weight") else torch.randn(s, generator=g) * 0.02
               for k, s in shapes.items()}
    path.mkdir(parents=True)
    cfg.save_pretrained(path)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_max_memory_is_kept(tmp_path):
    """``--max-memory 160MiB`` on a 210 MiB fp32 Llama (6 layers, hidden 768, vocab 8192; the
    in-memory path would need ~500 MiB): the CLI chooses the block-by-block path, says so in
    one line, and its child's peak RSS stays within the budget plus the baseline of a child
    that imports torch, transformers (with the model class, which transformers imports
    lazily) and quantkit and does nothing else."""
    model = tmp_path / "llama"
    weights = _random_llama(model, hidden=768, intermediate=2048, layers=6, vocab=8192)
    budget = 160 * 2 ** 20
    assert budget < 0.8 * weights  # well below the checkpoint (and a third of what the in-memory path needs)
    calib = tmp_path / "calib"
    calib.mkdir()
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        torch.save(torch.randint(0, 8192, (24,), generator=g), calib / f"s{i}.pt")
    base = _peak([sys.executable, "-c", "import torch, transformers, quantkit, quantkit.cli; "
                                        "transformers.LlamaForCausalLM"])
    assert base["rc"] == 0, base["stderr"][-2000:]
    out = tmp_path / "out"
    run = _peak([sys.executable, "-m", "quantkit", "quantize", str(model), "--calib", str(calib), "--out", str(out),
                 "--max-memory", "160MiB", "--seq-len", "32"])
    assert run["rc"] == 0, run["stderr"][-2000:]
    lines = [ln for ln in run["stdout"].splitlines() if ln.startswith("memory:")]
    assert len(lines) == 1 and "block by block" in lines[0], run["stdout"]
    assert json.loads((out / "quantization.json").read_text())["source"]["sequential"] is True
    over = run["maxrss"] - base["maxrss"]
    assert over <= budget, (f"peak RSS {run['maxrss'] / 2**20:.0f} MiB is {over / 2**20:.0f} MiB above the "
                            f"baseline {base['maxrss'] / 2**20:.0f} MiB, more than --max-memory 160MiB")


def test_budget_too_small_for_any_batch_is_refused(llama_dir, calib_dir, tmp_path, capsys):
    """A budget the block-by-block path cannot keep even with one sequence per batch: one
    line with the size it needs, before any block runs (nothing written)."""
    line = _fails(["quantize", str(llama_dir), "--calib", str(calib_dir), "--out", str(tmp_path / "out"),
                   "--max-memory", "1MiB"], capsys, code=1, inputs=[llama_dir, calib_dir], out=tmp_path / "out")
    assert "--max-memory 1 MiB is too small to quantize block by block" in line, line
    assert not any(p.name.startswith(".out.") for p in tmp_path.iterdir())


@pytest.mark.parametrize("size", ["lots", "-1GiB", "0", "0.0000001KiB", "nan", "inf", "4 GB RAM", "1e9"])
def test_bad_max_memory_is_a_usage_error(size, llama_dir, calib_dir, tmp_path, capsys):
    line = _fails(["quantize", str(llama_dir), "--calib", str(calib_dir), "--out", str(tmp_path / "out"),
                   "--max-memory", size], capsys, code=2, inputs=[llama_dir, calib_dir], out=tmp_path / "out")
    assert "--max-memory" in line, line


def test_path_choice_is_reported(llama_dir, calib_dir, tmp_path, capsys):
    """A budget the in-memory path fits: it is taken, and one line says so (none with --quiet)."""
    args = ["quantize", str(llama_dir), "--calib", str(calib_dir), "--batch-size", "2", "--max-memory", "4GiB"]
    assert main(args + ["--out", str(tmp_path / "a")]) == 0
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("memory:")]
    assert len(said) == 1 and "quantizing in memory" in said[0] and "4 GiB" in said[0], said
    assert json.loads((tmp_path / "a" / "quantization.json").read_text())["source"].get("sequential") is not True
    from quantkit.cli import _inputs, _sequential

    quiet = SimpleNamespace(max_memory="4GiB", sequential=False, resume=False, quiet=True, seq_len=128, batch_size=2)
    assert _sequential.wanted(quiet, _inputs.ModelSpec("hf", path=str(llama_dir))) is False
    assert capsys.readouterr().out == ""

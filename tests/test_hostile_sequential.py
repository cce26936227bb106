"""The block-by-block path under attack and faults (issue 26, items 1, 2, 3 and 11).

``--sequential`` keeps its progress in ``.OUT.quantkit-partial`` beside ``--out``. These tests put
other people's things there (the calibration directory, the model, a user directory, a file, links),
plant links inside it, tamper with what it holds or with the model between a kill and ``--resume``,
and SIGKILL a writer during save. Every refusal is checked against the CLI's failure contract
(``tests/_hostile.py``): the exit code, one stderr line, inputs unchanged by hash, nothing written
outside ``--out``; and what sits at the progress path is still there, unchanged.

The partial runs are made by a real SIGKILL (``QUANTKIT_TEST_KILL_AFTER_BLOCK``) in a child process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import quantkit
from quantkit._fsutil import lock_dir
from quantkit.cli import main
from quantkit.export import _atomic
from quantkit.sequential import _run as _sequential
from quantkit.sequential._state import PartialDir
from tests._hostile import _fails, _tree
from tests.cli_factories import mlp_quantize_args, write_mlp_inputs

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
_CLI = "import sys; from quantkit.cli import main; sys.exit(main(sys.argv[1:]))"


def _llama(path: Path) -> Path:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    (path / "special_tokens_map.json").write_text("{}\n")  # a tokenizer file, part of the fingerprint
    return path


def _calib(path: Path, seed: int = 3) -> Path:
    path.mkdir()
    g = torch.Generator().manual_seed(seed)
    for i in range(4):
        torch.save(torch.randint(0, 96, (5 + i,), generator=g), path / f"s{i}.pt")
    return path


def _args(model: Path, calib: Path, out: Path, *extra: str) -> list[str]:
    return ["quantize", str(model), "--calib", str(calib), "--out", str(out), "--batch-size", "2", "--sequential",
            "--quiet", *extra]


def _everything(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (links as their targets, directories as 'dir') and each file's sha256."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The tiny Llama and its calibration directory (never modified by any test)."""
    root = tmp_path_factory.mktemp("inputs")
    return _llama(root / "llama"), _calib(root / "calib")


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory):
    """The artifact of an uninterrupted --sequential run."""
    model, calib = inputs
    out = tmp_path_factory.mktemp("reference") / "out"
    assert main(_args(model, calib, out)) == 0
    return out


@pytest.fixture(scope="module")
def killed(inputs, tmp_path_factory):
    """(work dir, --out, pristine copy of the progress directory) of a run SIGKILLed after block 1."""
    model, calib = inputs
    work = tmp_path_factory.mktemp("killed")
    out = work / "out"
    env = {**os.environ, _sequential.KILL_AFTER_ENV: "1"}
    proc = subprocess.run([sys.executable, "-c", _CLI, *_args(model, calib, out)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    partial = PartialDir.beside(out)
    assert json.loads((partial / "state.json").read_text())["done"] == 1
    pristine = tmp_path_factory.mktemp("pristine") / "partial"
    shutil.copytree(partial, pristine, symlinks=True)
    return work, out, pristine


def _fresh_partial(killed) -> tuple[Path, Path]:
    """(--out, progress dir) with the killed run's progress directory as it was left."""
    work, out, pristine = killed
    partial = PartialDir.beside(out)
    if os.path.lexists(partial):
        shutil.rmtree(partial)
    shutil.copytree(pristine, partial, symlinks=True)
    for p in work.iterdir():  # what an earlier test left beside it
        if p != partial:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    return out, partial


def _lock_holder(path: Path) -> subprocess.Popen:
    """Another process holding ``path``'s flock (it prints "locked" once it does, then sleeps)."""
    return subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                             "fd = os.open(sys.argv[1], os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
                             "print('locked', flush=True)\ntime.sleep(300)", str(path)],
                            stdout=subprocess.PIPE, text=True)


def _same_artifact(a: Path, b: Path) -> None:
    """Same tensors, same qparam records (model.pt2's bytes also hold per-process stack traces)."""
    sa, sb = quantkit.load(a).state_dict(), quantkit.load(b).state_dict()
    assert sorted(sa) == sorted(sb) and len(sa) >= 10
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    ja, jb = (json.loads((d / "quantization.json").read_text()) for d in (a, b))
    assert ja["tensors"] == jb["tensors"]


def _refused(argv, capsys, *, code: int, inputs: list[Path], work: Path, kept: Path) -> str:
    """The failure contract, and nothing at all changed in ``work`` (``kept`` is what sits at the
    progress path: still there)."""
    before = _everything(work)
    line = _fails(argv, capsys, code=code, inputs=inputs)
    assert _everything(work) == before, "something was written, changed or removed beside --out"
    assert os.path.lexists(kept)
    return line


# --- 1. never delete what is not ours ------------------------------------------------------------

def test_calib_dir_at_the_progress_path_is_refused_and_kept(inputs, tmp_path, capsys):
    model, _ = inputs
    out = tmp_path / "out"
    calib = _calib(PartialDir.beside(out))  # --calib is where the progress directory would go
    line = _refused(_args(model, calib, out), capsys, code=2, inputs=[model, calib], work=tmp_path, kept=calib)
    assert "progress" in line and "input" in line, line
    assert sorted(p.name for p in calib.iterdir()) == [f"s{i}.pt" for i in range(4)]


@pytest.mark.parametrize("resume", [False, True])
def test_model_dir_at_the_progress_path_is_refused_and_kept(inputs, tmp_path, capsys, resume):
    src, calib = inputs
    out = tmp_path / "out"
    model = PartialDir.beside(out)
    shutil.copytree(src, model)
    line = _refused(_args(model, calib, out, *(["--resume"] if resume else [])), capsys, code=2,
                    inputs=[model, calib], work=tmp_path, kept=model / "model.safetensors")
    assert "would overwrite the input" in line, line


def test_model_dir_at_the_progress_path_is_refused_by_the_api(inputs, tmp_path):
    """quantize_pretrained itself (no CLI check in front): the progress directory is never an input."""
    src, _ = inputs
    out = tmp_path / "out"
    model = PartialDir.beside(out)
    shutil.copytree(src, model)
    before = _everything(tmp_path)
    batches = [{"input_ids": torch.randint(0, 96, (2, 6)), "attention_mask": torch.ones(2, 6, dtype=torch.long)}]
    with pytest.raises(quantkit.QuantkitError, match="would overwrite the input") as info:
        _sequential.quantize_pretrained(model, batches, out=out, sequential=True, progress=False)
    assert "\n" not in str(info.value)
    assert _everything(tmp_path) == before


@pytest.mark.parametrize("kind", ["user-dir", "empty-dir", "file", "other-output-marker"])
@pytest.mark.parametrize("resume", [False, True])
def test_foreign_thing_at_the_progress_path_is_refused_and_kept(inputs, tmp_path, capsys, kind, resume, killed):
    model, calib = inputs
    out = tmp_path / "out"
    partial = PartialDir.beside(out)
    if kind == "user-dir":
        partial.mkdir()
        (partial / "thesis.tex").write_text("years of work\n")
        (partial / "state.json").write_text('{"version": 2, "done": 1}\n')  # looks like ours, is not
    elif kind == "empty-dir":
        partial.mkdir()
    elif kind == "file":
        partial.write_text("a user's file\n")
    else:  # a real progress directory, of another --out (its marker holds that output's run id)
        shutil.copytree(killed[2], partial, symlinks=True)
    line = _refused(_args(model, calib, out, *(["--resume"] if resume else [])), capsys, code=1,
                    inputs=[model, calib, partial], work=tmp_path, kept=partial)
    assert str(partial) in line and ("not this run's" in line or "not a directory" in line), line


@pytest.mark.parametrize("target", ["user-dir", "calib"])
def test_symlinked_progress_dir_is_refused_and_its_target_untouched(inputs, tmp_path, capsys, target):
    model, calib = inputs
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    victim = calib if target == "calib" else tmp_path / "victim"
    if target == "user-dir":
        victim.mkdir()
        (victim / "notes.txt").write_text("mine\n")
    os.symlink(victim, PartialDir.beside(out))
    before = _tree(victim)
    line = _refused(_args(model, calib, out), capsys, code=2 if target == "calib" else 1, inputs=[model, calib],
                    work=work, kept=PartialDir.beside(out))
    assert (f"the progress directory {str(PartialDir.beside(out))!r} is a symbolic link" in line) \
        if target == "user-dir" else ("would overwrite the input" in line), line
    assert _tree(victim) == before


# --- 2. writes never follow links ----------------------------------------------------------------

def test_planted_tmp_links_are_not_followed_and_resume_still_matches(inputs, killed, reference, tmp_path, capsys):
    """Slow (a resumed run, ~15 s): the links must survive a whole run that writes beside them."""
    model, calib = inputs
    out, partial = _fresh_partial(killed)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for name in ("state.json.tmp", "block_0002.safetensors.tmp", "observers_0002.safetensors.tmp", "x.tmp"):
        os.symlink(victim, partial / name)
    assert main(_args(model, calib, out, "--resume")) == 0, capsys.readouterr().err
    assert victim.read_text() == "precious\n"
    assert not os.path.lexists(partial)
    _same_artifact(out, reference)


def test_planted_link_inside_the_progress_dir_is_refused(inputs, killed, tmp_path, capsys):
    """A link where the next block's activations go: refused in one line, its target untouched."""
    model, calib = inputs
    out, partial = _fresh_partial(killed)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine\n")
    os.symlink(victim, partial / "acts" / "0002")
    before = _tree(victim)
    line = _refused(_args(model, calib, out, "--resume"), capsys, code=1, inputs=[model, calib, victim],
                    work=killed[0], kept=partial)
    assert "symbolic link" in line, line
    assert _tree(victim) == before


@pytest.mark.parametrize("resume", [False, True])
def test_a_second_run_on_the_same_output_is_refused(inputs, killed, capsys, resume):
    """While a run holds the progress directory (its flock), another run of the same --out neither
    discards it nor resumes from under it."""
    model, calib = inputs
    out, partial = _fresh_partial(killed)
    holder = _lock_holder(partial)
    try:
        assert holder.stdout.readline().strip() == "locked"
        line = _refused(_args(model, calib, out, *(["--resume"] if resume else [])), capsys, code=1,
                        inputs=[model, calib, partial], work=killed[0], kept=partial)
        assert "another quantkit run is using the progress directory" in line, line
    finally:
        holder.kill()
        holder.wait()


# --- 3. resume verifies what it trusts -----------------------------------------------------------

def _edit_safetensors(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _zero_int8(tensors):
    key = next(k for k, v in tensors.items() if k.startswith("q:") and v.dtype == torch.int8)
    tensors[key] = torch.zeros_like(tensors[key])


def _max_val(tensors):
    key = next(k for k in tensors if k.endswith("max_val"))
    tensors[key] = torch.full_like(tensors[key], 1e6)


def _scale_acts(tensors):
    key = next(k for k, v in tensors.items() if v.is_floating_point())
    tensors[key] = tensors[key] * 5


@pytest.mark.parametrize("name,edit,then_resume", [("block_0001.safetensors", _zero_int8, True),
                                                   ("observers_0001.safetensors", _max_val, "no-resume"),
                                                   ("acts/0001/batch_000000.safetensors", _scale_acts, False)])
def test_tampered_file_is_refused_naming_it_then_a_clean_resume_matches(inputs, killed, reference, capsys, name,
                                                                         edit, then_resume):
    """The refusal is immediate; the one clean resume after it (block file) takes a run's time."""
    model, calib = inputs
    out, partial = _fresh_partial(killed)
    original = (partial / name).read_bytes()
    _edit_safetensors(partial / name, edit)
    assert (partial / name).read_bytes() != original
    line = _refused(_args(model, calib, out, "--resume"), capsys, code=1, inputs=[model, calib, partial],
                    work=killed[0], kept=partial)
    assert name in line and "changed after it was written" in line and "--no-resume" in line, line
    if not then_resume:  # one clean resume is enough (each takes a run's time)
        return
    if then_resume == "no-resume":  # what the line says to do: start over, and get the uninterrupted result
        assert main(_args(model, calib, out, "--resume", "--no-resume")) == 0, capsys.readouterr().err
        _same_artifact(out, reference)
        assert not partial.exists()
        return
    (partial / name).write_bytes(original)  # put back: the resumed run equals the uninterrupted one
    assert main(_args(model, calib, out, "--resume")) == 0, capsys.readouterr().err
    _same_artifact(out, reference)


def _state_digest(body: dict) -> str:
    """An attacker's consistent state record: the canonical JSON's sha256 (as a forger would compute it)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@pytest.mark.parametrize("done", ["abc", None, -3, 10**9, True, 1.5])
def test_malformed_done_is_one_line(inputs, killed, capsys, done):
    model, calib = inputs
    out, partial = _fresh_partial(killed)
    state = json.loads((partial / "state.json").read_text())
    body = {k: v for k, v in state.items() if k != "sha256"}
    body["done"] = done
    (partial / "state.json").write_text(json.dumps({**body, "sha256": _state_digest(body)}))
    line = _refused(_args(model, calib, out, "--resume"), capsys, code=1, inputs=[model, calib, partial],
                    work=killed[0], kept=partial)
    assert "damaged" in line and "done" in line and "without --resume" in line, line


@pytest.mark.parametrize("damage", ["not-json", "a-list", "edited-without-digest", "link", "files-table"])
def test_damaged_state_is_one_line(inputs, killed, tmp_path, capsys, damage):
    model, calib = inputs
    out, partial = _fresh_partial(killed)
    state_file = partial / "state.json"
    state = json.loads(state_file.read_text())
    if damage == "not-json":
        state_file.write_text('{"version": 2, "done": ')
    elif damage == "a-list":
        state_file.write_text("[1, 2]")
    elif damage == "edited-without-digest":
        state_file.write_text(json.dumps({**state, "done": 0}))
    elif damage == "link":  # to a copy of the real one: still not read through a link
        (tmp_path / "state.json").write_text(state_file.read_text())
        state_file.unlink()
        os.symlink(tmp_path / "state.json", state_file)
    else:
        body = {k: v for k, v in state.items() if k != "sha256"}
        body["files"] = {"block_0000.safetensors": "not a digest"}
        state_file.write_text(json.dumps({**body, "sha256": _state_digest(body)}))
    line = _refused(_args(model, calib, out, "--resume"), capsys, code=1, inputs=[model, calib, partial],
                    work=killed[0], kept=partial)
    assert "damaged" in line and "state.json" in line and "without --resume" in line, line


def _edit_config(model: Path) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3
    (model / "config.json").write_text(json.dumps(cfg))


def _edit_weights(model: Path) -> None:
    _edit_safetensors(model / "model.safetensors",
                      lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"] * 2))


def _edit_tokenizer(model: Path) -> None:
    (model / "special_tokens_map.json").write_text('{"pad_token": "<pad>"}\n')


@pytest.mark.parametrize("part,message", [
    ("config", "config.json changed since the partial run"),
    ("weights", "the checkpoint file 'model.safetensors' changed since the partial run"),
    ("tokenizer", "the tokenizer file 'special_tokens_map.json' changed since the partial run"),
    ("calibration", "the calibration data changed since the partial run"),
    ("recipe", "the recipe changed since the partial run"),
])
def test_a_changed_input_is_named_on_resume(inputs, killed, tmp_path, capsys, part, message):
    src, src_calib = inputs
    out, partial = _fresh_partial(killed)
    model, calib, extra = src, src_calib, []
    if part in ("config", "weights", "tokenizer"):  # the same model directory's contents, edited after the kill
        model = shutil.copytree(src, tmp_path / "llama")
        {"config": _edit_config, "weights": _edit_weights, "tokenizer": _edit_tokenizer}[part](model)
    elif part == "calibration":
        calib = shutil.copytree(src_calib, tmp_path / "calib")
        torch.save(torch.arange(6) % 96, calib / "s0.pt")
    else:
        extra = ["--observer", "mse"]
    line = _refused(_args(model, calib, out, "--resume", *extra), capsys, code=1, inputs=[model, calib, partial],
                    work=killed[0], kept=partial)
    assert message in line and "run again with --no-resume" in line, line


def test_progress_dir_is_ours_and_gone_after_a_run(inputs, killed, reference):
    """The killed run's directory: our marker, mode 0700, a digest for every file it holds."""
    _, _, pristine = killed
    marker = json.loads((pristine / "quantkit-partial.json").read_text())
    assert marker["kind"] == "quantkit block-by-block progress" and len(marker["run_id"]) == 32
    assert (pristine.stat().st_mode & 0o777) == 0o700
    state = json.loads((pristine / "state.json").read_text())
    recorded = state["files"]
    for p in pristine.rglob("*.safetensors"):  # every tensor file the run would trust has its digest
        rel = p.relative_to(pristine).as_posix()
        assert recorded.get(rel) == hashlib.sha256(p.read_bytes()).hexdigest(), rel
    assert {"config.json", "tokenizer", "checkpoint", "recipe", "calibration", "quantkit", "torch"} <= set(
        state["fingerprint"])
    assert not PartialDir.beside(reference).exists()
    assert sorted(p.name for p in reference.parent.iterdir()) == ["out"]


# --- 11. leftovers of a SIGKILLed save -----------------------------------------------------------

_HOLD = r"""
import pathlib, sys, time
from quantkit.export import _artifact
from quantkit.cli import main
ready = pathlib.Path(sys.argv[1])
real = _artifact.write_program
def write_program(program, directory):
    path = real(program, directory)
    ready.write_text(str(directory))
    time.sleep(300)
    return path
_artifact.write_program = write_program
sys.exit(main(sys.argv[2:]))
"""


def test_sigkilled_save_leftover_is_removed_by_the_next_write(tmp_path, capsys):
    """A real SIGKILL during save, the child not yet reaped (a zombie answers kill(pid, 0), so the
    pid alone said 'alive' and the leftover stayed): the next write to the same --out removes it.
    Slow (~30 s): a child process up to its save, then a whole CLI write."""
    weights, calib = write_mlp_inputs(tmp_path, 64)
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(ready), *mlp_quantize_args(weights, calib, out)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the child never reached the save"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        while Path(f"/proc/{proc.pid}").exists() and b") Z" not in Path(f"/proc/{proc.pid}/stat").read_bytes():
            time.sleep(0.02)
        left = [p.name for p in work.iterdir()]
        assert len(left) == 1 and left[0].startswith(".out.quantkit-tmp-"), left
        os.kill(proc.pid, 0)  # positive control: the dead writer's pid still answers (not reaped)
        inputs = [weights, calib]
        before = {str(p): _tree(p) for p in inputs}
        assert main(mlp_quantize_args(weights, calib, out)) == 0, capsys.readouterr().err
        assert sorted(p.name for p in work.iterdir()) == ["out"]  # the leftover is gone
        assert all(_tree(p) == before[str(p)] for p in inputs)
    finally:
        proc.kill()
        proc.wait()


def test_leftover_on_a_recycled_pid_is_removed_but_a_live_writer_is_kept(tmp_path):
    """Leftover names carry a pid that may be reused (by this very process, in a container): the
    writer's flock decides. A directory whose writer still holds its lock is left alone."""
    out = tmp_path / "out"
    recycled = tmp_path / f".out.quantkit-tmp-{os.getpid()}-lk0a1b2c3d"  # our pid, nobody holds it
    recycled.mkdir()
    (recycled / "model.pt2").write_bytes(b"half")
    holder = tmp_path / f".out.quantkit-tmp-{os.getppid()}-lk0badc0de"
    holder.mkdir()
    child = _lock_holder(holder)
    try:
        assert child.stdout.readline().strip() == "locked"
        assert _atomic._pid_alive(os.getpid())  # positive control: the pid alone says "alive"
        _atomic.recover(out)
        assert sorted(p.name for p in tmp_path.iterdir()) == [holder.name]
    finally:
        child.kill()
        child.wait()
    _atomic.recover(out)  # its writer gone: now it goes too
    assert list(tmp_path.iterdir()) == []



def test_progress_files_are_plain_safetensors_with_their_digest(tmp_path):
    """The progress directory's own writer (no link followed, digest as it writes) makes files that
    safetensors' reader takes back exactly, every dtype the run stores included."""
    from safetensors.torch import load_file

    from quantkit.sequential._files import Ledger

    g = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(4, generator=g).bfloat16(),
               "i8": torch.randint(-128, 127, (2, 3), generator=g, dtype=torch.int8), "scalar": torch.tensor(2.5),
               "empty": torch.zeros(0, 4), "mask": torch.tensor([True, False, True]),
               "fp8": torch.randn(6, generator=g).to(torch.float8_e4m3fn), "i64": torch.arange(7),
               "view": torch.arange(12.0).reshape(3, 4)[:, 1], "obs\x00max_val": torch.tensor([1.0, -2.0])}
    ledger = Ledger(tmp_path)
    digest = ledger.save_tensors(tensors, tmp_path / "block_0000.safetensors")
    assert digest == hashlib.sha256((tmp_path / "block_0000.safetensors").read_bytes()).hexdigest()
    assert ledger.digests == {"block_0000.safetensors": digest}
    back = load_file(str(tmp_path / "block_0000.safetensors"))
    assert sorted(back) == sorted(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape, k
        assert torch.equal(back[k].view(torch.uint8), t.contiguous().view(torch.uint8)) if t.dim() else \
            torch.equal(back[k], t), k
    assert [p.name for p in tmp_path.iterdir()] == ["block_0000.safetensors"]  # no temporary file left


def test_atomic_tmp_dir_is_private_while_written_and_ordinary_after(tmp_path):
    """export/_atomic.py's temporary directory: mode 0700 and locked while written, a fresh name
    (never an existing path), the umask's mode once it is swapped in."""
    out = tmp_path / "out"
    with _atomic.atomic_dir(out) as tmp:
        assert (tmp.stat().st_mode & 0o777) == 0o700 and not tmp.is_symlink()
        assert ".out.quantkit-tmp-" in tmp.name and "-lk" in tmp.name
        with pytest.raises(BlockingIOError):  # its writer holds the lock: recover() leaves it alone
            lock_dir(tmp)
        _atomic.recover(out)
        assert tmp.is_dir()
        (tmp / "f").write_text("x")
    umask = os.umask(0o22)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

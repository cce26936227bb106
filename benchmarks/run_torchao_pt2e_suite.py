"""Run torchao's own PT2E test suite with quantkit's prepare/convert substituted for torchao's.

torchao's ``test/quantization/pt2e/test_quantize_pt2e.py`` is the judge: every test that calls
``prepare_pt2e`` / ``convert_pt2e`` runs ``quantkit.prepare`` / ``quantkit.convert`` instead
(``prepare_qat_pt2e`` stays torchao's: quantkit has no QAT flow, but its fake-quantized graphs
go through ``quantkit.convert``). The patching conftest is written next to the extracted test
file, so the names are replaced before the test module imports them. torchao's files are only
read into a temporary directory, never copied into this repository.

Usage::

    python benchmarks/run_torchao_pt2e_suite.py                       # torchao v0.18.0 from the mirror
    python benchmarks/run_torchao_pt2e_suite.py --checkout ~/src/ao   # a torchao checkout
    python benchmarks/run_torchao_pt2e_suite.py --torchao             # torchao's own flow (the baseline)
    python benchmarks/run_torchao_pt2e_suite.py -k fold_quantize      # a subset (pytest -k)

Prints ``N of M passed`` and the failing tests' names, each with pytest's reason or, for the
deliberate differences listed in ``DIFFERENCES``, why quantkit behaves otherwise.

Measured (torch 2.13, torchao 0.18.0, 2 CPU cores): torchao's flow 64 of 64; quantkit's 62 of 64
(58 before float8 support, 38 before issue 12); the two failures are the ``DIFFERENCES`` below.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MIRROR = "/work/.mirror/pytorch+ao/repo"
TEST_DIR = "test/quantization/pt2e"
TEST_FILE = "test_quantize_pt2e.py"

# failures that are quantkit's deliberate behaviour, not bugs
DIFFERENCES = {
    "test_allow_implicit_sharing_with_shared_input_edge":
        "reads the observers off the model passed to prepare_pt2e; quantkit.prepare never modifies its input",
    "test_quantize_kwargs": "expects tensor keyword arguments to be refused (quantkit observes them, out= excepted) "
                            "and reads q/dq off the model passed to convert_pt2e (quantkit.convert never modifies its input)",
}

# the conftest written next to the test file: swaps the flow functions in every module that
# holds a reference to them before the test module is imported
CONFTEST = '''\
import logging

import torch  # noqa: F401
import torchao.quantization.pt2e.quantize_pt2e as _qp
import torchao.testing.pt2e.utils as _tu

logging.getLogger("torchao").setLevel(logging.ERROR)

if {substitute}:
    import quantkit

    def _prepare_pt2e(model, quantizer):
        return quantkit.prepare(model, quantizer)

    def _convert_pt2e(model, use_reference_representation=False, fold_quantize=True):
        return quantkit.convert(model, fold_quantize=fold_quantize)

    for _mod in (_qp, _tu):
        _mod.prepare_pt2e = _prepare_pt2e
        _mod.convert_pt2e = _convert_pt2e
'''


def _extract(mirror: str, tag: str, dest: Path) -> Path:
    archive = subprocess.run(["git", "-C", mirror, "archive", tag, TEST_DIR], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest / TEST_DIR


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--checkout", help="a torchao checkout (its test/quantization/pt2e is used)")
    src.add_argument("--mirror", default=MIRROR, help=f"a torchao git repository (default {MIRROR})")
    ap.add_argument("--tag", default="v0.18.0", help="tag or commit to extract from --mirror (default v0.18.0)")
    ap.add_argument("--torchao", action="store_true", help="run torchao's own flow (no substitution)")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds for the whole pytest run")
    ap.add_argument("--log", help="write pytest's full output to this file")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="torchao_pt2e_"))
    try:
        if args.checkout:
            tests = tmp / TEST_DIR
            shutil.copytree(Path(args.checkout) / TEST_DIR, tests)
        else:
            tests = _extract(args.mirror, args.tag, tmp)
        (tests / "conftest.py").write_text(CONFTEST.format(substitute=not args.torchao))
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "no:randomly",
               "--rootdir", str(tests), TEST_FILE]
        if args.keyword:
            cmd += ["-k", args.keyword]
        env = dict(os.environ, COLUMNS="400", PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                        os.environ.get("PYTHONPATH")])))
        proc = subprocess.run(cmd, cwd=tests, env=env, capture_output=True, text=True, timeout=args.timeout)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = proc.stdout + proc.stderr
    if args.log:
        Path(args.log).write_text(out)
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) \S+::(\S+)", out, re.M)))
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", out.splitlines()[-1] if out.strip() else "")}
    passed = counts.get("passed", 0)
    total = passed + counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    flow = "torchao" if args.torchao else "quantkit"
    print(f"{passed} of {total} passed ({flow} prepare/convert; {counts.get('skipped', 0)} skipped)")
    for name in failed:
        line = next((ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR")) and f"::{name}" in ln), "")
        reason = DIFFERENCES.get(name) or (line.split(" - ", 1)[1][:200] if " - " in line else "")
        print(f"  FAILED {name}: {reason}")
    if total == 0:
        print(out[-3000:])
    return 0 if passed == total and total > 0 else 1


if __name__ == "__main__":
    sys.exit(main())

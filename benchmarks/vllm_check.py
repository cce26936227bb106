"""Load quantkit's compressed-tensors W8A8 export in vLLM (issue 20): static and dynamic per-token.

A random tiny Llama (the GPU machine has no network) is quantized with quantkit, exported with
``quantkit.export_compressed_tensors`` (which checks it with transformers first), then loaded by
``vllm.LLM`` and run greedily; the greedy tokens are compared with transformers' model of the same
checkpoint. Prints one markdown row per scheme; exit 1 if vLLM refuses a checkpoint.

    python benchmarks/vllm_check.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch


def _export(work: Path, scheme: str) -> Path:
    import transformers
    from torchao.quantization.pt2e.quantizer import ComposableQuantizer

    import quantkit
    from quantkit import _hf
    from quantkit.quantizers import EmbeddingQuantizer, QuantConfig, W8A8Quantizer

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                                   max_position_embeddings=256)
    src = work / "llama"
    if not src.exists():
        transformers.LlamaForCausalLM(cfg).save_pretrained(str(src))
    model = transformers.LlamaForCausalLM.from_pretrained(str(src)).eval()
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 1024, (4, 32), generator=gen),
                "attention_mask": torch.ones(4, 32, dtype=torch.long)} for _ in range(3)]
    config = QuantConfig() if scheme == "static" else QuantConfig(dynamic=True, granularity="per-token")
    gm = quantkit.capture(model, batches[0], dynamic_shapes=_hf.dynamic_shapes(batches[0]))
    prepared = quantkit.prepare(gm, ComposableQuantizer([EmbeddingQuantizer(), W8A8Quantizer(config)]))
    quantkit.calibrate(prepared, batches[:2], progress=False)
    out = work / f"llama-w8a8-{scheme}"
    quantkit.export_compressed_tensors(quantkit.convert(prepared), src, out, inputs=batches[2:], overwrite=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    args = parser.parse_args()
    import transformers
    import vllm

    work = Path(args.out or tempfile.mkdtemp(prefix="vllm-check-"))
    prompts = [[int(t) for t in torch.randint(0, 1024, (16,), generator=torch.Generator().manual_seed(i))]
               for i in range(4)]
    print(f"vllm {vllm.__version__}, transformers {transformers.__version__}\n")
    print("| scheme | vLLM loads | greedy tokens equal to transformers' (of 4x8) |")
    print("|---|---|---|")
    failed = 0
    for scheme in ("static", "per-token"):
        ckpt = _export(work, scheme)
        try:
            llm = vllm.LLM(model=str(ckpt), enforce_eager=True, gpu_memory_utilization=0.3, dtype="bfloat16",
                           max_model_len=256)
            params = vllm.SamplingParams(temperature=0.0, max_tokens=8)
            outs = llm.generate([vllm.TokensPrompt(prompt_token_ids=p) for p in prompts], params)
            got = [list(o.outputs[0].token_ids) for o in outs]
            del llm
        except Exception as exc:  # vLLM's refusal is the finding
            print(f"| {scheme} | no: {type(exc).__name__}: {str(exc).splitlines()[0][:200]} | |")
            failed += 1
            continue
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16).cuda().eval()
        same = 0
        with torch.no_grad():
            for p, g in zip(prompts, got):
                ref = hf.generate(torch.tensor([p]).cuda(), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
                same += sum(a == b for a, b in zip(ref, g))
        print(f"| {scheme} | yes | {same} / {8 * len(prompts)} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Make the tiny pre-quantized checkpoints under tests/quant/fixtures/ with the real tools that write each format.

Each step runs in a scratch virtual environment that has its tool (never the project's .venv); see
tests/quant/fixtures/README.md for the environments, versions and the exact commands. Steps:

  base OUT                      a seeded random 2-layer Llama (hidden 128) + the tests' tiny tokenizer, float16
  fp8 BASE OUT --weights channel|tensor
                                llmcompressor oneshot, FP8 weights (per-channel or per-tensor scales) and dynamic
                                per-token FP8 activations, saved in the compressed-tensors format
  gptq BASE OUT --group 128|-1 [--asym]
                                gptqmodel, 4-bit GPTQ (desc_act false), saved in the GPTQ (v1) format
  awq BASE OUT [--asym]         gptqmodel's AWQ quantizer, 4-bit group 128, saved in the AWQ GEMM format
  autoawq BASE OUT              AutoAWQ, 4-bit group 128 with zero points, GEMM layout
  reference DIR                 transformers' own loading of DIR (in the tool's environment): greedy tokens of
                                PROMPTS and the teacher-forced top-1 of TEACHER_TEXT, written to DIR/reference.json

Every step writes DIR/made_by.json: the tool, its version, the torch / transformers versions and the command.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [  # the 8 prompts of the greedy-equality tests (tests/quant/test_prequantized_models.py)
    "The quick brown fox",
    "Batch inference runs",
    "Hello world! What is",
    "a block holds sixteen",
    "Paris. The capital of",
    "0123456789",
    "many prompts together;",
    "the lazy dog jumps over",
]
MAX_NEW_TOKENS = 16
TEACHER_TEXT = " ".join([
    "The quick brown fox jumps over the lazy dog.",
    "Batch inference runs many prompts together; a block holds sixteen tokens.",
    "Hello world! 0123456789 What is the capital of France? Paris.",
] * 3)
CALIBRATION = [  # a few short texts: the tools need calibration samples, the fixtures need only their format
    "The quick brown fox jumps over the lazy dog.",
    "Batch inference runs many prompts together; a block holds sixteen tokens.",
    "Hello world! 0123456789 What is the capital of France? Paris.",
    "A block holds sixteen tokens and many prompts run together in one batch.",
    "The lazy dog sleeps while the quick brown fox runs over the hill.",
    "What is the capital of Italy? Rome. What is the capital of Spain? Madrid.",
    "Numbers: 9876543210, 1357924680 and 2468013579 are ten digits long.",
    "Inference engines schedule prefill and decode tokens under one budget.",
]


def _versions(*packages: str) -> dict[str, str]:
    out = {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _record(out: Path, tool: str, extra: dict) -> None:
    """DIR/made_by.json: what made this checkpoint, so it can be made again."""
    made_by = {"tool": tool, "versions": _versions(tool, "torch", "transformers", "compressed-tensors",
                                                   "llmcompressor", "gptqmodel", "autoawq"),
               "python": sys.version.split()[0], "command": " ".join(["python", *sys.argv]), **extra}
    (out / "made_by.json").write_text(json.dumps(made_by, indent=2) + "\n")


def make_base(out: Path) -> None:
    """The float checkpoint every format starts from (not committed: the formats are)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO))
    from tests.conftest import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.05,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    _train(model, tokenizer)  # a few hundred steps on the calibration texts: varied greedy outputs, not one token
    model = model.eval().to(torch.float16)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    _record(out, "transformers", {"format": "float16 (base, not quantized)"})


def _train(model, tokenizer, steps: int = 300) -> None:
    """Fit the random model to CALIBRATION (seeded, CPU, a few seconds), so greedy text follows the corpus."""
    import torch

    batch = [tokenizer(t, add_special_tokens=False).input_ids for t in CALIBRATION]
    width = max(map(len, batch))
    ids = torch.tensor([row + [tokenizer.eos_token_id] * (width - len(row)) for row in batch])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"base model: final training loss {loss.item():.3f}")


def make_fp8(base: Path, out: Path, weights: str) -> None:
    """llmcompressor: FP8 e4m3 weights with ``weights`` scales and dynamic per-token FP8 activations."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype="float16")
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    if weights == "channel":
        recipe = QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])
    else:  # FP8_DYNAMIC with one scale per weight tensor
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
        recipe = QuantizationModifier(ignore=["lm_head"], config_groups={"group_0": {
            "targets": ["Linear"], "weights": {**fp8, "strategy": "tensor", "dynamic": False},
            "input_activations": {**fp8, "strategy": "token", "dynamic": True}}})
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(str(out), save_compressed=True)
    tokenizer.save_pretrained(str(out))
    _record(out, "llmcompressor", {"format": f"compressed-tensors float-quantized FP8, {weights} weight scales, "
                                             "dynamic per-token activations"})


def make_gptq(base: Path, out: Path, group: int, asym: bool) -> None:
    """gptqmodel: 4-bit GPTQ, ``group`` (-1 = per channel), symmetric unless ``asym``, desc_act false."""
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base))
    # act_group_aware (a quantization-time order, not a layout) needs groups: off for one group per channel
    config = QuantizeConfig(bits=4, group_size=group, desc_act=False, sym=not asym, act_group_aware=group > 0)
    model = GPTQModel.load(str(base), config, device="cpu")
    model.quantize(CALIBRATION, batch_size=1, tokenizer=tokenizer)
    model.save(str(out))
    tokenizer.save_pretrained(str(out))
    _record(out, "gptqmodel", {"format": f"GPTQ 4-bit, group {group}, {'asym' if asym else 'sym'}, desc_act false"})


def make_awq(base: Path, out: Path, asym: bool) -> None:
    """gptqmodel's AWQ: 4-bit, group 128, GEMM layout; zero points fitted with ``asym`` (``zero_point: true``),
    else symmetric (``zero_point: false``, its qzeros all 8)."""
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base))
    config = QuantizeConfig(bits=4, group_size=128, quant_method="awq", format="gemm", sym=not asym)
    model = GPTQModel.load(str(base), config, device="cpu")
    # the default AWQ backend for GEMM is the CUDA kernel ("AWQ: CUDA is not available"): the torch one packs on CPU
    model.quantize(CALIBRATION, batch_size=1, tokenizer=tokenizer, backend=BACKEND.TORCH)
    model.save(str(out))
    tokenizer.save_pretrained(str(out))
    _record(out, "gptqmodel", {"format": f"AWQ 4-bit, group 128, {'zero points' if asym else 'symmetric'}, GEMM"})


def make_autoawq(base: Path, out: Path) -> None:
    """AutoAWQ (the AWQ authors' packaging): 4-bit, group 128, zero points, GEMM layout, on CPU."""
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base))
    model = AutoAWQForCausalLM.from_pretrained(str(base))
    model.quantize(tokenizer, quant_config={"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"},
                   calib_data=CALIBRATION, max_calib_seq_len=64, n_parallel_calib_samples=1, max_calib_samples=8)
    model.save_quantized(str(out))
    tokenizer.save_pretrained(str(out))
    _record(out, "autoawq", {"format": "AWQ 4-bit, group 128, zero points, GEMM layout"})


def make_reference(model_dir: Path) -> None:
    """transformers' own loading of ``model_dir`` on CPU in float32: greedy tokens and teacher-forced top-1.

    compressed-tensors FP8 runs its dynamic per-token activation quantization (fake-quantized) in forward, as a
    GPU would: that top-1 is kept as ``teacher_top1_activations_quantized``; ``greedy`` and ``teacher_top1``
    are then taken with it switched off (``quantization_enabled = False``): the dequantized model, which is what
    our CPU path computes (weight-only; docs/quantization.md)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, device_map="cpu").eval()
    teacher = tokenizer(TEACHER_TEXT, add_special_tokens=False, return_tensors="pt").input_ids
    reference = {"loaded_by": _versions("transformers", "torch", "compressed-tensors", "gptqmodel", "optimum"),
                 "model_class": type(model).__name__, "teacher_token_ids": teacher[0].tolist()}
    with torch.no_grad():
        quantized_inputs = [m for m in model.modules() if getattr(getattr(m, "quantization_scheme", None),
                                                                   "input_activations", None)]
        if quantized_inputs:
            reference["teacher_top1_activations_quantized"] = model(teacher).logits[0].argmax(-1).tolist()
            for module in quantized_inputs:
                module.quantization_enabled = False
        int4_modules = [m for m in model.modules() if hasattr(m, "dequantize_weight") and hasattr(m, "qzeros")]
        if int4_modules:  # gptqmodel's CPU kernel runs in bfloat16: keep its greedy, then its own dequantization
            forwards = [_dequantized_forward(module) for module in int4_modules]  # before the kernel repacks
            reference["greedy_tool_kernel"] = _greedy(model, tokenizer)
            for module, forward in zip(int4_modules, forwards):
                module.forward = forward
        reference.update(greedy=_greedy(model, tokenizer), teacher_top1=model(teacher).logits[0].argmax(-1).tolist())
    (model_dir / "reference.json").write_text(json.dumps(reference) + "\n")


def _greedy(model, tokenizer) -> list[dict]:
    greedy = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=tokenizer.pad_token_id)
        greedy.append({"prompt_token_ids": ids[0].tolist(), "output_token_ids": out[0, ids.shape[1]:].tolist()})
    return greedy


def _dequantized_forward(module):
    """A forward for a gptqmodel quantized linear that computes with its own dequantized weight, in float32:
    its ``dequantize_weight`` with float32 scales (in float16 ``(q - z) * s`` would round)."""
    import torch

    scales = module.scales
    module.scales = scales.float()  # the integer codes and zeros times float32 scales: float32, exact
    weight = module.dequantize_weight().float()  # [K, N]
    module.scales = scales
    bias = None if getattr(module, "bias", None) is None else module.bias.float()
    return lambda x: torch.nn.functional.linear(x.float(), weight.t(), bias).to(x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("base").add_argument("out", type=Path)
    fp8 = sub.add_parser("fp8")
    fp8.add_argument("base", type=Path)
    fp8.add_argument("out", type=Path)
    fp8.add_argument("--weights", choices=("channel", "tensor"), default="channel")
    gptq = sub.add_parser("gptq")
    gptq.add_argument("base", type=Path)
    gptq.add_argument("out", type=Path)
    gptq.add_argument("--group", type=int, default=128)
    gptq.add_argument("--asym", action="store_true")
    awq = sub.add_parser("awq")
    awq.add_argument("base", type=Path)
    awq.add_argument("out", type=Path)
    awq.add_argument("--asym", action="store_true")
    autoawq = sub.add_parser("autoawq")
    autoawq.add_argument("base", type=Path)
    autoawq.add_argument("out", type=Path)
    sub.add_parser("reference").add_argument("model_dir", type=Path)
    args = parser.parse_args()
    if args.step == "base":
        make_base(args.out)
    elif args.step == "fp8":
        make_fp8(args.base, args.out, args.weights)
    elif args.step == "gptq":
        make_gptq(args.base, args.out, args.group, args.asym)
    elif args.step == "awq":
        make_awq(args.base, args.out, args.asym)
    elif args.step == "autoawq":
        make_autoawq(args.base, args.out)
    else:
        make_reference(args.model_dir)


if __name__ == "__main__":
    main()

"""`jobrunner bench`: our engine's throughput on a prompt file (with --baseline hf: vs transformers' generate on
the same prompts, in one process); --compare-quantization: quantization configs side by side (--quant-dispatch:
per forced CPU capability, each in a fresh process); --quant-kernels: one linear layer per path; --gemm-paths:
each GEMM path; --kv-attention: decode attention per route and KV-cache dtype; --calibrate-dtype: the dtype check
of a machine. The one entry point of every measurement in jobrunner/bench."""

from __future__ import annotations

import json

import click

from jobrunner.cli.echo import echo
from jobrunner.engine.config import EngineConfig
from jobrunner.engine.settings import setting_default, setting_of

DEFAULT_MODEL = "smollm2-135m-instruct"


def _engine_option(flag: str, name: str, **kwargs):
    """A ``--flag`` for EngineConfig's setting ``name``: its default and description are the setting's own (what a
    job gets), so the bench measures the engine a job runs unless told otherwise."""
    item = setting_of(EngineConfig, name)
    if item.annotation is int and "ge" in item.setting.bounds():
        kwargs.setdefault("type", click.IntRange(min=int(item.setting.ge)))
    return click.option(flag, default=setting_default(EngineConfig, name), show_default=True,
                        help=kwargs.pop("help", item.setting.description), **kwargs)


@click.command()
@click.option("--prompts", "prompts_path", default=None, type=click.Path(dir_okay=False),
              help="A .jsonl or .parquet file with a 'prompt' (text) or 'messages' (chat) column (required "
                   "unless --calibrate-dtype, --quant-kernels, --gemm-paths or --lora-steps).")
@click.option("--num-prompts", type=click.IntRange(min=1), default=128, show_default=True,
              help="Use the first N rows.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="Output tokens per prompt (the most, unless --ignore-eos).")
@click.option("--ignore-eos", is_flag=True, help="Always generate --max-tokens tokens (no stopping at EOS).")
@click.option("--no-prefix-caching", is_flag=True, help="Run our engine with prefix caching off.")
@click.option("--compare-prefix-caching", is_flag=True,
              help="Run our engine twice, prefix caching on and off, and report what caching saved.")
@click.option("--baseline", type=click.Choice(["hf", "none"]), default="none", show_default=True,
              help="hf: also run transformers' generate on the same token ids and report the ratio (minutes "
                   "on CPU); none: our engine only.")
@click.option("--engine", "engines", default="jobrunner", show_default=True,
              help="jobrunner, or jobrunner,vllm: also run vLLM's engine (its own process, the Python of "
                   "--vllm-python) on the same token ids and report the ratio.")
@click.option("--vllm-python", default=None,
              help="The Python that has vLLM (default $JOBRUNNER_VLLM_PYTHON, else ./.venv-vllm/bin/python).")
@click.option("--vllm-eager", is_flag=True,
              help="Run vLLM without its compile step (starts in ~20 s instead of 1-2 minutes; slower steps).")
@click.option("--baseline-batch-size", type=click.IntRange(min=1), default=None,
              help="Static batch size of the HF baseline (default: the best of 8/16/32 on a short pilot).")
@click.option("--raw-prompts", is_flag=True, help="Send 'prompt' text as is instead of as a single-turn chat.")
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="Model source: alias, local dir, Hub id or storage URL.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              show_default=True)
@click.option("--quantization", type=click.Choice(["none", "int8", "int8_weight_only", "int4", "fp8", "w8a8"]),
              default="none",
              show_default=True,
              help="Our engine only (the baseline stays unquantized).")
@_engine_option("--device", "device", help="auto, cpu, cuda, cuda:1, ...")
@_engine_option("--max-num-seqs", "max_num_seqs")
@_engine_option("--max-num-batched-tokens", "max_num_batched_tokens")
@_engine_option("--tensor-parallel-size", "tensor_parallel_size",
                help="Ranks the model is split across, for both engines (ours: local processes, one core group "
                     "each; vLLM: its own); the model's heads must divide.")
@_engine_option("--speculative", "speculative",
                help="Our engine's speculative decoding: off, ngram, auto (n-gram drafts only where it measures a "
                     "gain) or a draft model source (same tokenizer as --model).")
@_engine_option("--attention-backend", "attention_backend",
                type=click.Choice(["auto", "torch", "cpu_paged", "triton"]))
@click.option("--compare-quantization", "quant_schemes", default=None, metavar="CONFIGS",
              help="Instead of the baseline run: compare these configs with the first, unquantized one (e.g. "
                   "none,int8,int4 on --dtype; float32:none,bfloat16:none,bfloat16:int4 for float controls side "
                   "by side; 'bf16' = bfloat16:none; int4/lm_head=int8: per-layer overrides; int4@int4=8: its own "
                   "crossovers): weight bytes, perplexity on --quality-texts, greedy agreement of 32 tokens on the "
                   "prompts, output tokens/s at --batch-sizes (prefix caching and speculation off).")
@click.option("--quality-texts", type=click.Path(dir_okay=False), default=None,
              help="Held-out text for perplexity and teacher-forced top-1 (.jsonl/.parquet; assistant turns, else "
                   "the prompt text).")
@click.option("--num-texts", type=click.IntRange(min=1), default=None,
              help="Use the first N rows of --quality-texts (default: all).")
@click.option("--batch-sizes", default="1,8,64", show_default=True,
              help="Batch sizes for --compare-quantization throughput.")
@click.option("--quant-dispatch", "capabilities", default=None, metavar="CAPABILITIES",
              help="With --compare-quantization (default none,int8,int4): output tokens/s per config and "
                   "--batch-sizes, once per CPU capability (native, avx2: the kernels an AVX2-only CPU runs, "
                   "torch/oneDNN/MKL capped too; or another forced one, e.g. avx512_vnni), each in a fresh process; "
                   "with --quality-texts also perplexity and top-1 per capability.")
@click.option("--quant-kernels", is_flag=True,
              help="Only time one linear layer of each SmolLM2 shape on every quantized path at --batch-sizes "
                   "token counts (microseconds).")
@click.option("--gemm-paths", is_flag=True,
              help="Microseconds of each GEMM path (F.linear, our packed kernel, oneDNN) per SmolLM2 layer shape "
                   "at --batch-sizes rows, in --dtype (auto = float32; jobrunner.bench.gemm_paths).")
@click.option("--kv-attention", "kv_context", type=click.IntRange(min=1), default=None, metavar="CONTEXT",
              help="Only time one layer's decode attention over CONTEXT keys per row, at --batch-sizes rows, per CPU "
                   "route and KV-cache dtype (model dtype and fp8; --dtype auto = bfloat16; "
                   "jobrunner.bench.kv_attention).")
@click.option("--lora-steps", is_flag=True,
              help="Only time engine steps of 16 rows on --model with 4 random rank-16 LoRA adapters: rows "
                   "without an adapter, all on one adapter, and mixed over the 4 (jobrunner.bench.lora_steps).")
@click.option("--profile", is_flag=True,
              help="Also time each step's parts: attention, GEMMs (linear layers, lm_head), other model ops and "
                   "host work (scheduling, inputs, outputs), in total, per step and as a share of the step.")
@click.option("--worker-hour-usd", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Price of one worker-hour (as a job spec's cost.worker_hour_usd): also print $ / M input, output "
                   "and total tokens of the workload at steady state (start-up excluded).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object on the last line.")
@click.option("--calibrate-dtype", is_flag=True,
              help="Only time a GEMM in float32 and bfloat16 on this CPU and say what `dtype: auto` chooses "
                   "(from the CPU capability, never from this timing) and whether the timing agrees.")
def bench(prompts_path: str | None, num_prompts: int, max_tokens: int, ignore_eos: bool, no_prefix_caching: bool,
          compare_prefix_caching: bool, baseline: str, engines: str, vllm_python: str | None, vllm_eager: bool,
          baseline_batch_size: int | None, raw_prompts: bool,
          model: str, dtype: str, quantization: str, device: str, max_num_seqs: int,
          max_num_batched_tokens: int, tensor_parallel_size: int, speculative: str, attention_backend: str,
          quant_schemes: str | None,
          quality_texts: str | None, num_texts: int | None, batch_sizes: str, capabilities: str | None,
          quant_kernels: bool, gemm_paths: bool, kv_context: int | None, lora_steps: bool, profile: bool,
          worker_hour_usd: float | None, as_json: bool, calibrate_dtype: bool) -> None:
    """Throughput of our engine on a prompt file; with --baseline hf, against transformers' generate (static
    left-padded batches) on the same token ids.

    With --compare-quantization: quantization schemes side by side instead (see jobrunner.bench.quality).
    """
    from jobrunner.bench import BenchOptions, run_bench
    from jobrunner.bench.ours import EngineOptions
    from jobrunner.bench.price import machine_load, price_line
    from jobrunner.bench.report import render_text
    from jobrunner.io.prompt_file import PromptFileError, read_prompts

    if calibrate_dtype:
        _calibrate_dtype(as_json)
        return
    if quant_kernels:
        from jobrunner.bench.quant_kernels import kernel_table

        for line in kernel_table(_batch_sizes(batch_sizes)):
            echo(line)
        return
    if gemm_paths:
        _gemm_paths(batch_sizes, dtype, as_json)
        return
    if kv_context is not None:
        _kv_attention(kv_context, batch_sizes, dtype, as_json)
        return
    if lora_steps:
        _lora_steps(model, dtype, device, as_json)
        return
    if prompts_path is None:
        raise click.UsageError("--prompts is required (unless --calibrate-dtype, --quant-kernels, --gemm-paths, "
                               "--kv-attention or --lora-steps)")
    if no_prefix_caching and compare_prefix_caching:
        raise click.UsageError("--compare-prefix-caching runs both; drop --no-prefix-caching")
    try:
        rows = read_prompts(prompts_path, num_prompts)
    except PromptFileError as exc:
        raise click.ClickException(str(exc)) from None
    engine = EngineOptions(model=model, dtype=dtype, quantization=quantization, device=device,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           speculative=speculative, attention_backend=attention_backend,
                           tensor_parallel_size=tensor_parallel_size)
    texts = _quality_texts(quality_texts, num_texts)
    if capabilities is not None:
        _quant_dispatch(engine, rows, quant_schemes or "none,int8,int4", capabilities, batch_sizes, max_tokens,
                        raw_prompts, texts, as_json)
        return
    if quant_schemes is not None:
        _compare_quantization(engine, rows, quant_schemes, texts, batch_sizes, raw_prompts, as_json)
        return
    baseline = _engines_baseline(engines, baseline)
    options = BenchOptions(engine=engine, max_tokens=max_tokens, ignore_eos=ignore_eos,
                           prefix_caching=not no_prefix_caching, compare_prefix_caching=compare_prefix_caching,
                           baseline=baseline, baseline_batch_size=baseline_batch_size, raw_prompts=raw_prompts,
                           profile=profile, vllm_python=_vllm_python(vllm_python), vllm_eager=vllm_eager)
    load_before = machine_load()
    try:
        result = run_bench(options, rows, log=lambda msg: echo(msg, err=True))
    except ValueError as exc:  # bad model source, no chat template, nothing fits the context, ...
        raise click.ClickException(str(exc)) from None
    result["workload"]["prompts"] = prompts_path
    _price_and_load(result, worker_hour_usd, load_before)
    echo(render_text(result), nl=False)
    if result.get("price"):
        echo(price_line(result["price"]))
    if result["machine_load"]["warning"]:
        echo(result["machine_load"]["warning"], err=True)
    if as_json:
        echo(json.dumps(result, default=str))


def _price_and_load(result: dict, worker_hour_usd: float | None, load_before: dict) -> None:
    """result["price"] ($ / M at --worker-hour-usd) and result["machine_load"] (before and after the run, this
    process's own threads left out, and a warning when other processes kept the CPUs busy)."""
    import torch

    from jobrunner.bench.price import bench_price, load_warning, machine_load

    if worker_hour_usd is not None:
        result["price"] = bench_price(result["ours"], worker_hour_usd)
    after = machine_load(own_threads=torch.get_num_threads())
    result["machine_load"] = {"before": load_before, "after": after, "warning": load_warning(load_before, after)}


def _calibrate_dtype(as_json: bool) -> None:
    from jobrunner.quant.dispatch import CALIBRATION_SHAPE, calibrate_dtype

    result = calibrate_dtype()
    cal = result["calibration"]
    m, k, n = CALIBRATION_SHAPE
    echo(f"GEMM {m}x{k}x{n}, best of 20: float32 {cal['float32_gflops']} GFLOP/s, bfloat16 "
         f"{cal['bfloat16_gflops']} GFLOP/s -> the timing suggests {result['measured_choice']}")
    echo(f"dtype auto -> {result['auto']} ({result['reason']}{', forced' if result['forced'] else ''})"
         + ("" if result["agrees"] else "; the timing disagrees: check with `jobrunner bench --dtype "
            "float32` and `--dtype bfloat16` on real prompts, or force JOBRUNNER_CPU_CAPABILITY"))
    if as_json:
        echo(json.dumps(result))


def _gemm_paths(batch_sizes: str, dtype: str, as_json: bool) -> None:
    import torch

    from jobrunner.bench.gemm_paths import gemm_table, render_gemm_table

    chosen = torch.bfloat16 if dtype == "bfloat16" else torch.float16 if dtype == "float16" else torch.float32
    records = gemm_table(_batch_sizes(batch_sizes), dtype=chosen)
    for line in render_gemm_table(records):
        echo(line)
    if as_json:
        echo(json.dumps({"gemm_paths": records}))


def _kv_attention(context: int, batch_sizes: str, dtype: str, as_json: bool) -> None:
    import torch

    from jobrunner.bench.kv_attention import KVShape, kv_attention_table, render_kv_attention

    if dtype == "float16":
        raise click.UsageError("--kv-attention measures the CPU routes: --dtype bfloat16 or float32 (auto = bfloat16)")
    model_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    records = kv_attention_table(context, _batch_sizes(batch_sizes), model_dtype)
    for line in render_kv_attention(records, model_dtype, KVShape()):
        echo(line)
    if as_json:
        echo(json.dumps({"kv_attention": records}))


def _lora_steps(model: str, dtype: str, device: str, as_json: bool) -> None:
    from jobrunner.bench.lora_steps import lora_step_times, render_lora_steps

    result = lora_step_times(model, dtype=dtype, device=device)
    for line in render_lora_steps(result):
        echo(line)
    if as_json:
        echo(json.dumps(result))


def _batch_sizes(batch_sizes: str) -> list[int]:
    try:
        sizes = [int(b) for b in batch_sizes.split(",")]
        if any(b < 1 for b in sizes):
            raise ValueError
    except ValueError:
        raise click.BadParameter(f"{batch_sizes!r}: positive integers, comma-separated",
                                 param_hint="--batch-sizes") from None
    return sizes


def _scheme_names(schemes: str, dtype: str) -> list[str]:
    """``none,int8,int4`` or ``float32:none,bfloat16:int4``: checked config names (jobrunner.bench.quant_configs)."""
    from jobrunner.bench.quant_configs import parse_configs

    names = [s.strip().lower() for s in schemes.split(",") if s.strip()]
    try:
        parse_configs(names, dtype)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--compare-quantization") from None
    return names


def _quality_texts(path: str | None, num_texts: int | None) -> tuple[str, list[str]] | None:
    """``(path, held-out texts)`` of the first ``num_texts`` rows of ``path``; None without a path."""
    from jobrunner.bench.prompts import held_out_texts
    from jobrunner.io.prompt_file import PromptFileError, read_prompts

    if path is None:
        return None
    try:
        return path, held_out_texts(read_prompts(path, num_texts))
    except (PromptFileError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


def _quant_dispatch(engine, rows, schemes: str, capabilities: str, batch_sizes: str, max_tokens: int,
                    raw_prompts: bool, texts: tuple[str, list[str]] | None, as_json: bool) -> None:
    from jobrunner.bench.prompts import as_chat
    from jobrunner.bench.quant_dispatch import check_capabilities, render, run_dispatch

    names = _scheme_names(schemes, engine.dtype)
    try:
        caps = check_capabilities([c.strip() for c in capabilities.split(",") if c.strip()])
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--quant-dispatch") from None
    prompts = [as_chat(row, raw=raw_prompts) for row in rows]
    try:
        results = run_dispatch(engine.model, names, _batch_sizes(batch_sizes), max_tokens, prompts, rounds=2,
                               capabilities=caps, log=lambda msg: echo(msg, err=True), dtype=engine.dtype,
                               texts=texts[1] if texts else None)
    except (RuntimeError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    for capability, result in results.items():
        echo(render(capability, result))
    if as_json:
        echo(json.dumps({"quant_dispatch": results}, default=str))


def _compare_quantization(engine, rows, schemes: str, texts: tuple[str, list[str]] | None, batch_sizes: str,
                          raw_prompts: bool, as_json: bool) -> None:
    from jobrunner.bench.quality import run_quality
    from jobrunner.bench.quant_measure import to_markdown

    names = _scheme_names(schemes, engine.dtype)
    if texts is None:
        raise click.UsageError("--compare-quantization needs --quality-texts (held-out text for perplexity)")
    sizes = _batch_sizes(batch_sizes)
    try:
        result = run_quality(engine, rows, texts[1], names, sizes, raw_prompts)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    result["settings"]["quality_texts"] = texts[0]
    echo(to_markdown(result))
    if as_json:
        echo(json.dumps({"quantization": result}, default=str))


COMMANDS = [bench]


def _engines_baseline(engines: str, baseline: str) -> str:
    """--engine jobrunner[,vllm] as the run's baseline ("vllm" or the --baseline given)."""
    names = [n.strip() for n in engines.split(",") if n.strip()]
    unknown = sorted(set(names) - {"jobrunner", "vllm"})
    if unknown or "jobrunner" not in names:
        raise click.UsageError(f"--engine {engines!r}: jobrunner or jobrunner,vllm (our engine makes the token ids "
                               "both run)")
    if "vllm" not in names:
        return baseline
    if baseline != "none":
        raise click.UsageError("--engine jobrunner,vllm runs vLLM as the baseline: drop --baseline")
    return "vllm"


def _vllm_python(given: str | None) -> str:
    from pathlib import Path

    from jobrunner.kernels.switches import setting
    from jobrunner.vllm_backend.mapping import VLLM_PYTHON_ENV

    local = Path(".venv-vllm/bin/python")
    # absolute, not resolved: a venv's python is a symlink to the base interpreter, which has no vLLM
    return given or setting(VLLM_PYTHON_ENV) or (str(local.absolute()) if local.exists() else "python3")

"""The ``specdec`` command line: plugins, config check, generate, chat, bench, train, serve."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

import yaml

from .config import QUANTIZATIONS, SpecdecConfig
from .config_loading import config_from_dict, load_config, merge_overrides, unstructure
from .errors import ConfigError, SpecdecError
from .plugins import get_registry
from .process_exit import exit_now


def _add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine (override the config file)")
    g.add_argument("--config", "-c", help="YAML config file")
    g.add_argument("--model", "-m", help="model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", choices=["auto", "cpu", "cuda"])
    g.add_argument("--decoding-type", "-d", help="speculative method (see `specdec plugins`)")
    g.add_argument("--max-draft-len", "-k", type=int)
    g.add_argument("--max-batch-size", type=int)
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--threads", type=int, help="torch CPU threads (of each rank under tensor parallelism)")
    g.add_argument("--tensor-parallel-size", "--tp", type=int, metavar="N",
                   help="shard the target over N ranks: processes specdec starts on this machine, or the ranks of "
                        "a torchrun launch (--nnodes, --node-rank, --master-addr) across machines")
    g.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="quantized target on CPU: int8/int4 weights on torch's kernels, w8a8/w4a8 the same weights "
                        "with 8-bit activations on specdec's integer-dot kernels (a GGUF's own 4-bit blocks are "
                        "used as they are)")
    g.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="any config field, e.g. --set speculative_config.max_matching_ngram_size=4")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", "-n", type=int)
    s.add_argument("--temperature", "-t", type=float)
    s.add_argument("--top-k", type=int)
    s.add_argument("--top-p", type=float)
    s.add_argument("--seed", type=int)
    p.add_argument("--stats", action="store_true", help="print tokens/s and acceptance statistics")


def _resolve_config(args) -> SpecdecConfig:
    cfg = load_config(args.config) if args.config else config_from_dict({})
    overrides = {
        "model": args.model, "dtype": args.dtype, "device": args.device,
        "engine.max_batch_size": args.max_batch_size, "engine.max_model_len": args.max_model_len,
        "engine.num_threads": args.threads, "engine.quantization": args.quantization,
        "engine.tensor_parallel_size": args.tensor_parallel_size,
        "sampling.max_tokens": args.max_tokens, "sampling.temperature": args.temperature,
        "sampling.top_k": args.top_k, "sampling.top_p": args.top_p, "sampling.seed": args.seed,
    }
    if args.decoding_type:
        overrides["speculative_config.decoding_type"] = args.decoding_type
    if args.max_draft_len is not None:
        if args.decoding_type is None and cfg.speculative_config is None:
            raise SpecdecError("--max-draft-len needs a decoding type: add --decoding-type (see `specdec plugins`)")
        overrides["speculative_config.max_draft_len"] = args.max_draft_len
    for item in args.set:
        path, sep, value = item.partition("=")
        if not sep:
            raise SpecdecError(f"--set {item!r}: expected PATH=VALUE")
        overrides[path.strip()] = yaml.safe_load(value)
    return merge_overrides(cfg, overrides)


def _read_prompts(args) -> list[str]:
    if args.prompt:
        return args.prompt
    if sys.stdin.isatty():
        raise SpecdecError("give a prompt as an argument or on standard input")
    text = sys.stdin.read()
    return [text] if text.strip() else []


def _print_stats(outputs, elapsed: float, file=None) -> None:
    from .executor.metrics import RequestMetrics

    total = RequestMetrics()
    tokens = 0
    for out in outputs:
        total.merge(out.metrics)
        tokens += len(out.token_ids)
    per_pos = ", ".join(f"{x:.2f}" for x in total.per_position_acceptance) or "-"
    print(f"\n[specdec] {tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.1f} tok/s; "
          f"target steps {total.num_steps}, acceptance length {total.acceptance_length:.2f}, "
          f"draft tokens {total.num_draft_tokens}, accepted {total.num_accepted_tokens}, "
          f"per-position acceptance [{per_pos}], mean draft length {total.mean_draft_len:.2f}, "
          f"steps with speculation off {total.num_steps_speculation_off}, "
          f"drafter faults {total.num_drafter_faults}", file=file or sys.stderr)


def cmd_plugins(args) -> int:
    registry = get_registry()
    rows = registry.plugins_table()
    if args.json:
        print(json.dumps({"decoding_types": rows,
                          "failed": [{"plugin": f.plugin, "distribution": f.distribution, "error": f.error}
                                     for f in registry.failures]}, indent=2))
        return 0
    print(f"{'decoding_type':<14} {'aliases':<22} {'distribution':<30} {'version':<8} status")
    for r in rows:
        status = "ready" if r["implemented"] else "not implemented yet"
        if r["trainable"]:
            status += ", trains (specdec train)"
        if r["lossy_options"]:
            status += f"; lossy with {', '.join(r['lossy_options'])}"
        print(f"{r['name']:<14} {', '.join(r['aliases']):<22} {r['distribution']:<30} {r['version']:<8} {status}")
    for f in registry.failures:
        print(f"FAILED  {f.plugin} ({f.distribution}): {f.error}")
    return 0


def cmd_config_check(args) -> int:
    cfg = load_config(args.file)
    data = unstructure(cfg)
    if cfg.speculative_config is not None:
        entry = get_registry().resolve(cfg.speculative_config.decoding_type)
        print(f"# decoding_type {entry.name} from {entry.distribution} {entry.version}")
    print(yaml.safe_dump(data, sort_keys=False), end="")
    return 0


def _build_llm(cfg: SpecdecConfig):
    from .api import LLM

    return LLM(config=cfg)


def cmd_generate(args) -> int:
    cfg = _resolve_config(args)
    prompts = _read_prompts(args)
    llm = _build_llm(cfg)
    outputs = []
    started = time.perf_counter()
    for prompt in prompts:
        for piece in llm.stream(prompt, cfg.sampling):
            print(piece, end="", flush=True)
        print()
        outputs.append(llm.last_output)
    if args.stats:
        _print_stats(outputs, time.perf_counter() - started)
    return 0


def cmd_chat(args) -> int:
    cfg = _resolve_config(args)
    llm = _build_llm(cfg)
    interactive = not args.prompt and sys.stdin.isatty()
    messages: list[dict] = []
    outputs = []
    started = time.perf_counter()
    pending = _read_prompts(args) if not interactive else []
    while True:
        if interactive:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                continue
        elif pending:
            line = pending.pop(0)
        else:
            break
        messages.append({"role": "user", "content": line})
        reply = ""
        for piece in llm.stream(llm.apply_chat_template(messages), cfg.sampling):
            reply += piece
            print(piece, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": reply})
        outputs.append(llm.last_output)
    if args.stats:
        _print_stats(outputs, time.perf_counter() - started)
    return 0


def _json_schema(path: str | None) -> dict | None:
    """The JSON schema in file ``path`` (None: none)."""
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SpecdecError(f"--json-schema {path}: {exc}") from None


def cmd_bench(args) -> int:
    from .bench.runner import numerics_line, plot, print_table, run_bench, sampling_line, write_json

    try:
        report = run_bench(_resolve_config(args), args.methods, args.dataset, args.categories, args.batch_size,
                           args.temperature if args.temperature is not None else 0.0, args.max_tokens or 128,
                           args.repetitions, args.hf, args.assistant_layers, args.llama_cpp,
                           _json_schema(args.json_schema), args.llama_cpp_bin)
    except (ValueError, OSError) as exc:
        raise SpecdecError(str(exc)) from None
    quantized = f" ({report['quantization']} weights)" if report["quantization"] else ""
    print(f"# {report['model']}, {report['dtype']}{quantized} on {report['device']}, {report['threads']} threads, "
          f"batch {report['batch_size']}, {sampling_line(report)}, max {report['max_tokens']} tokens, "
          f"{numerics_line(report)}")
    print_table(report)
    if args.json:
        write_json(report, args.json)
    if args.plots:
        for path in plot(report, Path(args.plots)):
            print(f"# plot: {path}")
    return 0


def cmd_train(args) -> int:
    from .training import TrainOptions, train

    options = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SpecdecError(f"--set {item!r}: expected NAME=VALUE")
        options[key.strip()] = yaml.safe_load(value)
    opts = TrainOptions(method=args.method, data=args.data, out=args.out, model=args.model, device=args.device,
                        seed=args.seed, epochs=args.epochs, max_steps=args.max_steps, batch_size=args.batch_size,
                        max_seq_len=args.max_seq_len, lr=args.lr, save_every=args.save_every,
                        max_new_tokens=args.max_new_tokens, gen_dtype=args.gen_dtype,
                        quantization=args.quantization, gen_batch_size=args.gen_batch_size,
                        eval_prompts=args.eval_prompts, max_samples=args.max_samples, resume=args.resume,
                        init=args.init,
                        trainer_options=options)
    try:
        report = train(opts)
    except (ValueError, OSError) as exc:
        raise SpecdecError(str(exc)) from None
    ev = report.get("eval")
    print(f"# {report['method']} for {report['target']}: {report['steps']} steps on {report['samples']} samples "
          f"({report['answer_tokens']} answer tokens), final loss {report['final_loss']:.3f}; saved in {args.out}")
    if ev:
        print(f"# held-out prompts: {ev['prompts']}, acceptance length {ev['acceptance_length']:.2f}")
    return 0


def _trainable_methods() -> str:
    try:
        types = get_registry().types.values()
    except Exception:  # listing is best effort; `train` itself reports a broken plugin
        return ""
    names = ", ".join(sorted(t.name for t in types if t.trainer_class is not None)) or "none installed"
    return f"methods installed that train: {names}"


def cmd_serve(args) -> int:
    from .parallel import launched_by_torchrun
    from .serving.async_engine import AsyncEngine
    from .serving.server import ServerOptions, serve

    api_key = args.api_key or os.environ.get("SPECDEC_API_KEY") or None
    if args.protect_all and api_key is None:
        raise ConfigError("--protect-all needs an API key: --api-key KEY or SPECDEC_API_KEY")
    options = ServerOptions(api_key=api_key, protect_all=args.protect_all, max_body_bytes=args.max_body_bytes,
                            max_waiting=args.max_waiting, allowed_origins=tuple(args.allowed_origin),
                            request_timeout=args.request_timeout)
    config = _resolve_config(args)
    if launched_by_torchrun():  # this rank leads the group torchrun started: the engine stays in it
        engine = AsyncEngine.start_thread(_build_llm(config))
    else:
        engine = AsyncEngine.start_process(config)
    serve(engine, host=args.host, port=args.port, options=options)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding.")
    parser.add_argument("--verbose", "-v", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list installed decoding types")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_command", required=True)
    c = csub.add_parser("check", help="validate a YAML config and print it resolved")
    c.add_argument("file")
    c.set_defaults(func=cmd_config_check)

    p = sub.add_parser("generate", help="complete prompts (arguments, or standard input)")
    p.add_argument("prompt", nargs="*")
    _add_model_options(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat with the model (messages as arguments, stdin, or interactive)")
    p.add_argument("prompt", nargs="*")
    _add_model_options(p)
    p.set_defaults(func=cmd_chat)
    p = sub.add_parser("bench", help="compare methods side by side on a prompt set")
    p.add_argument("methods", nargs="*", default=["ngram"],
                   help="decoding types or YAML files (plain decoding always runs as the baseline)")
    p.add_argument("--dataset", help="JSONL prompts ({prompt} or {messages}, optional category)")
    p.add_argument("--categories", nargs="*", help="built-in categories to run (default: all)")
    p.add_argument("--batch-size", type=int, default=1, help="requests submitted together")
    p.add_argument("--repetitions", type=int, default=1)
    p.add_argument("--hf", action="store_true", help="also run HF generate(): plain, prompt lookup, assistant")
    p.add_argument("--assistant-layers", type=int, default=6)
    p.add_argument("--llama-cpp", nargs="?", const="bindings", choices=["bindings", "native"],
                   help="also run llama.cpp on the target's GGUF file: 'bindings' (the default; llama-cpp-python, "
                        "plain and prompt lookup, the llama-cpp extra) or 'native' (llama-server plain and with its "
                        "n-gram speculation, and llama-bench; built once into the user cache if not on PATH)")
    p.add_argument("--llama-cpp-bin", metavar="DIR", help="where llama-server and llama-bench are (--llama-cpp native)")
    p.add_argument("--json-schema", metavar="FILE",
                   help="every answer follows this JSON schema (structured output; the report has the grammar "
                        "masks' time per step)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--plots", help="write PNG plots into this directory")
    _add_model_options(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("train", help="train a drafter for a target (self-distillation)",
                       description="The target answers the prompts of --data; the method's drafter learns from "
                                   "its answers and is saved in --out, ready for speculative_model: OUT.",
                       epilog=_trainable_methods())
    p.add_argument("method", help="decoding type to train")
    p.add_argument("--data", required=True, help="JSONL (or a .json list) of {prompt}, {messages} or {text}; "
                   "Alpaca and ShareGPT records become prompts")
    p.add_argument("--out", required=True, help="run directory: samples, checkpoint, the trained drafter")
    p.add_argument("--model", "-m", help="target model (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps")
    p.add_argument("--max-new-tokens", type=int, default=160, help="length of the target's answers")
    p.add_argument("--gen-dtype", choices=["float32", "bfloat16"], default="bfloat16",
                   help="dtype the target answers in (the dtype you will serve in)")
    p.add_argument("--quantization", choices=[q for q in QUANTIZATIONS if q not in ("auto", "none")],
                   help="the target's weights as you will serve them (w4a8: the embedded model's CPU default): its "
                        "answers, features and evaluation come from the target quantized so (default: unquantized)")
    p.add_argument("--gen-batch-size", type=int, default=24, help="requests the target answers at once")
    p.add_argument("--eval-prompts", type=int, default=16,
                   help="prompts held out for the final evaluation (the file's last ones)")
    p.add_argument("--max-samples", type=int, help="train on the first N items only")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--init", metavar="DIR|default",
                   help="start from a drafter this method saved (fine-tuning); 'default': the one it loads when "
                        "no speculative_model is given (the shipped drafter on the embedded model)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a trainer option, e.g. --set draft_layers=2")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every /v1 route "
                                     "(default: the SPECDEC_API_KEY environment variable; none: open)")
    p.add_argument("--protect-all", action="store_true", help="require the API key on /health and /metrics too")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="larger request bodies get 413")
    p.add_argument("--max-waiting", type=int, default=512,
                   help="requests waiting for the engine beyond this get 429")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="a request still unfinished after this long is aborted: 504, or an error event when "
                        "streamed (default: none)")
    p.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                   help="an origin browsers may call from (CORS; repeat for more; none by default)")
    _add_model_options(p)
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return args.func(args)
    except SpecdecError as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def run() -> NoReturn:
    """The ``specdec`` command: :func:`main`, then :func:`~specdec.process_exit.exit_now`
    with its status (argparse's usage errors and ``--help`` included)."""
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code
    exit_now(code)


if __name__ == "__main__":
    run()

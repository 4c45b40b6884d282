"""``specdec train``: self-distillation data, the training loop, checkpoints, evaluation.

    target answers the prompts (engine, continuous batching)   -> samples.jsonl (cached)
      -> hidden states of the layers the method reads, once      -> features/ (cached)
      -> the method's module and loss, AdamW, warm-up + cosine   -> checkpoint.pt every N steps
      -> the method's save format in OUT                         -> speculative_model: OUT
      -> acceptance length on prompts held out of the data       -> train_report.json

An interrupted run continues with ``--resume`` from its last checkpoint: the batch order
of every epoch is fixed by the seed, and the checkpoint stores where in it the run was,
so no batch is seen twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from pathlib import Path

import attrs
import torch

from ..errors import SpecdecError
from .data import Sample, distill, encode_prompt, read_items, split_eval
from .features import FeatureStore
from .method import MethodTrainer, TrainBatch, TrainTarget

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
SAMPLES = "samples.jsonl"
REPORT = "train_report.json"
#: ``--init default``: start from the drafter the method loads when none is named (the shipped one).
INIT_DEFAULT = "default"


@attrs.frozen(kw_only=True)
class TrainOptions:
    """Options of one training run (the CLI's flags)."""

    method: str
    data: str
    out: str
    model: str | None = None
    device: str = "auto"
    seed: int = 0
    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 8
    max_seq_len: int = 512
    lr: float = 1e-3
    warmup_steps: int = 20
    save_every: int = 100
    max_new_tokens: int = 160
    gen_dtype: str = "bfloat16"
    quantization: str | None = None
    gen_batch_size: int = 24
    eval_prompts: int = 16
    max_samples: int | None = None
    resume: bool = False
    init: str | None = None
    trainer_options: dict = attrs.Factory(dict)


class TrainError(SpecdecError):
    """A training run cannot start or continue (no trainer, existing run, bad options)."""


def trainer_class_for(method: str):
    from ..plugins import get_registry

    registry = get_registry()
    dtype = registry.resolve(method)
    if dtype.trainer_class is None:
        trainable = ", ".join(n for n, t in registry.types.items() if t.trainer_class) or "none installed"
        raise TrainError(f"decoding type {dtype.name!r} ({dtype.distribution}) has no trainer; methods that "
                         f"train: {trainable}")
    return dtype


def make_batches(samples: list[Sample], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Sample indices of each batch of one epoch, in a fixed order for (seed, epoch)."""
    order = list(range(len(samples)))
    random.Random(f"{seed}-{epoch}").shuffle(order)
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def collate(samples: list[Sample], max_len: int, target: TrainTarget,
            features: dict[int, torch.Tensor] | None = None) -> TrainBatch:
    """Pad a batch; labels are the next tokens (the target's own answers), or the target's
    predictions for plain-text samples. ``features``: the batch's stored hidden states."""
    seqs = [s.token_ids[:max_len] for s in samples]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.zeros(len(seqs), width, dtype=torch.long)
    loss_mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        n = len(seq)
        ids[i, :n] = torch.tensor(seq)
        attn[i, :n] = 1
        labels[i, :n - 1] = ids[i, 1:n]
        loss_mask[i, s.loss_start:n - 1] = True
    device = target.device
    ids, attn, labels, loss_mask = ids.to(device), attn.to(device), labels.to(device), loss_mask.to(device)
    teach = [i for i, s in enumerate(samples) if s.labels_from_target]
    if teach:
        logits, _ = target.run(ids[teach], attn[teach])
        labels[teach] = logits.argmax(-1)
        loss_mask[teach, -1] = False
    return TrainBatch(input_ids=ids, attention_mask=attn, labels=labels, loss_mask=loss_mask, target=target,
                      features=features or {})


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_target(opts: TrainOptions, device: torch.device) -> TrainTarget:
    from ..model.loading import load_causal_lm, load_tokenizer, model_display_name, resolve_model_dir

    path = resolve_model_dir(opts.model)
    model = load_causal_lm(path, torch.float32, device)
    return TrainTarget(model, load_tokenizer(path), model_display_name(opts.model, path), path)


def served_engine(opts: TrainOptions) -> dict:
    """Engine options of the target as it answers, is evaluated and gives features: quantized
    by ``opts.quantization`` where given (the weights the drafter will be served beside)."""
    return {"quantization": opts.quantization} if opts.quantization else {}


def quantized_target(opts: TrainOptions, device: torch.device):
    """``(mode, load)``: what loads the target quantized as served, for its features; None
    where it is served unquantized."""
    from ..model.loading import load_weights, resolve_dtype

    if not opts.quantization:
        return None
    return opts.quantization, lambda: load_weights(opts.model, opts.quantization, resolve_dtype(opts.gen_dtype),
                                                   device)[0]


def evaluate(opts: TrainOptions, trainer: MethodTrainer, items: list[dict]) -> dict:
    """Acceptance length of the saved drafter on the held-out prompts (greedy, planner off:
    every step drafts the method's default shape, so the figure is the drafter's, not the
    adaptive planner's choice of when to draft)."""
    from ..api import LLM
    from ..executor.metrics import RequestMetrics
    from ..sampling_params import SamplingParams

    llm = LLM(model=opts.model, dtype=opts.gen_dtype, device=opts.device, engine=served_engine(opts),
              speculative_config={**trainer.speculative_config(Path(opts.out)), "adaptive": False})
    outs = llm.generate([encode_prompt(llm, it) for it in items],
                        SamplingParams(max_tokens=opts.max_new_tokens, temperature=0.0))
    total = RequestMetrics()
    for o in outs:
        total.merge(o.metrics)
    return {"prompts": len(items), "acceptance_length": total.acceptance_length,
            "per_position_acceptance": total.per_position_acceptance,
            "steps_speculation_off": total.num_steps_speculation_off}


def _check_start(opts: TrainOptions, method) -> None:
    """Refuse a run that would overwrite another or start from what cannot be loaded."""
    ckpt_path = Path(opts.out) / CHECKPOINT
    if ckpt_path.exists() and not opts.resume:
        raise TrainError(f"{opts.out} holds a run already ({CHECKPOINT}); add --resume to continue it, or choose "
                         "another --out")
    if opts.init is not None and method.trainer_class.start_from is MethodTrainer.start_from:
        raise TrainError(f"specdec train {method.name} cannot start from a saved drafter (--init); train it from "
                         "scratch")
    if opts.init not in (None, INIT_DEFAULT) and not Path(opts.init).is_dir():
        raise TrainError(f"--init {opts.init}: no such directory; give a drafter {method.name} saved (the --out of "
                         f"an earlier run) or '{INIT_DEFAULT}'")


def _target_answers(opts: TrainOptions, items: list[dict], progress: bool) -> list[Sample]:
    """The served target's answers to ``items``, cached in OUT/samples.jsonl (a resumed run
    answers only the prompts not cached yet)."""
    from tqdm import tqdm

    from ..api import LLM

    cache = Path(opts.out) / SAMPLES
    cached = sum(1 for line in cache.open() if line.strip()) if cache.exists() else 0
    gen = None
    if cached < len(items):
        gen = LLM(model=opts.model, dtype=opts.gen_dtype, device=opts.device,
                  engine={**served_engine(opts), "max_batch_size": opts.gen_batch_size, "max_num_tokens": 2048})
    bar = tqdm(total=len(items), initial=min(cached, len(items)), desc="target answers", unit="prompt",
               disable=not progress or gen is None)
    # chunks of several engine batches, so that few of the engine's rows idle at a chunk's end
    samples = distill(gen, items, cache, opts.max_new_tokens, chunk=4 * opts.gen_batch_size,
                      progress=lambda done, total: bar.update(done - bar.n))[:len(items)]
    bar.close()
    return samples


def _feature_store(opts: TrainOptions, trainer: MethodTrainer, target: TrainTarget, samples: list[Sample],
                   device: torch.device, progress: bool) -> FeatureStore | None:
    """The hidden states of the layers the method reads, computed once into OUT/features."""
    from tqdm import tqdm

    if not trainer.feature_layers():
        return None
    bar = tqdm(total=len(samples), desc="target features", unit="sample", disable=not progress)
    store = FeatureStore.build(Path(opts.out) / "features", target, samples, trainer.feature_layers(),
                               opts.max_seq_len, opts.gen_dtype, quantized=quantized_target(opts, device),
                               progress=lambda done, total: bar.update(done - bar.n))
    bar.close()
    return store


@attrs.define
class _Optimization:
    """The module's trainable parameters, their optimizer and where the run stands (step,
    epoch, batch of the epoch, loss history), saved together in OUT/checkpoint.pt."""

    method: str
    module: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    path: Path
    opts: TrainOptions
    state: dict = attrs.Factory(lambda: {"step": 0, "epoch": 0, "batch": 0, "history": []})

    @classmethod
    def start(cls, opts: TrainOptions, method: str, module: torch.nn.Module, device: torch.device):
        params = [p for p in module.parameters() if p.requires_grad]
        run = cls(method, module, params, torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0),
                  Path(opts.out) / CHECKPOINT, opts)
        if opts.resume and run.path.exists():
            saved = torch.load(run.path, map_location=device, weights_only=False)
            if saved["method"] != method:
                raise TrainError(f"{run.path} is a {saved['method']} run, not {method}")
            module.load_state_dict(saved["module"])
            run.optimizer.load_state_dict(saved["optimizer"])
            run.state = saved["state"]
            log.info("resumed at step %d (epoch %d, batch %d)", run.state["step"], run.state["epoch"],
                     run.state["batch"])
        return run

    def save(self) -> None:
        _save_checkpoint(self.path, {"method": self.method, "module": self.module.state_dict(),
                                     "optimizer": self.optimizer.state_dict(), "state": self.state,
                                     "options": attrs.asdict(self.opts)})

    def step(self, loss: torch.Tensor, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()


def _optimize(run: _Optimization, trainer: MethodTrainer, target: TrainTarget, samples: list[Sample],
              store: FeatureStore | None, device: torch.device, progress: bool) -> None:
    """Train until the run's steps (or epochs) are done, a checkpoint every ``save_every``
    steps and one on an interruption."""
    from tqdm import tqdm

    opts, state = run.opts, run.state
    steps_per_epoch = math.ceil(len(samples) / opts.batch_size)
    # --max-steps, when given, decides the length of the run (epochs repeat as needed).
    total_steps = opts.max_steps or steps_per_epoch * opts.epochs
    max_epochs = math.ceil(total_steps / steps_per_epoch)
    run.module.train()
    bar = tqdm(total=total_steps, initial=state["step"], desc=f"train {run.method}", disable=not progress)
    started, tokens = time.perf_counter(), 0
    try:
        while state["step"] < total_steps and state["epoch"] < max_epochs:
            batches = make_batches(samples, opts.batch_size, opts.seed, state["epoch"])
            while state["batch"] < len(batches) and state["step"] < total_steps:
                chosen = batches[state["batch"]]
                width = max(min(len(samples[i].token_ids), opts.max_seq_len) for i in chosen)
                batch = collate([samples[i] for i in chosen], opts.max_seq_len, target,
                                store.batch(chosen, width, device) if store else None)
                loss, metrics = trainer.loss(batch)
                run.step(loss, opts.lr * lr_factor(state["step"], opts.warmup_steps, total_steps))
                loss = float(loss.detach())
                state["step"] += 1
                state["batch"] += 1
                tokens += batch.num_tokens
                state["history"].append({"step": state["step"], "loss": loss, **metrics})
                bar.set_postfix(loss=f"{loss:.3f}", **{k: f"{v:.3f}" for k, v in metrics.items()},
                                tok_s=f"{tokens / (time.perf_counter() - started):.0f}")
                bar.update(1)
                if state["step"] % opts.save_every == 0:
                    run.save()
            if state["batch"] >= len(batches):
                state["epoch"] += 1
                state["batch"] = 0
    finally:  # an interruption keeps what was learnt
        bar.close()
        run.save()
    run.module.eval()


def train(opts: TrainOptions, progress: bool = True) -> dict:
    """Run (or resume) one training run; returns the report also written to OUT/train_report.json."""
    from ..model.loading import resolve_device

    method = trainer_class_for(opts.method)
    method.trainer_class.check_options(opts.trainer_options)
    _check_start(opts, method)
    train_items, held_out = split_eval(read_items(opts.data), opts.eval_prompts)
    train_items = train_items[:opts.max_samples]
    if not train_items:
        raise TrainError(f"{opts.data}: every item is held out for evaluation; lower --eval-prompts")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(opts.seed)
    device = resolve_device(opts.device)
    started = time.perf_counter()
    samples = _target_answers(opts, train_items, progress)
    samples_time = time.perf_counter() - started
    target = load_target(opts, device)
    trainer: MethodTrainer = method.trainer_class(target, samples, dict(opts.trainer_options))
    store = _feature_store(opts, trainer, target, samples, device, progress)
    if opts.init is not None and not (opts.resume and (out / CHECKPOINT).exists()):
        trainer.start_from(None if opts.init == INIT_DEFAULT else opts.init)
    run = _Optimization.start(opts, method.name, trainer.module(), device)
    train_started = time.perf_counter()
    _optimize(run, trainer, target, samples, store, device, progress)
    trainer.save(out)
    state = run.state
    report = {"method": method.name, "target": target.name, "data": str(opts.data), "samples": len(samples),
              "init": opts.init, "quantization": opts.quantization,
              "answer_tokens": sum(len(s.token_ids) - 1 - s.loss_start for s in samples),
              "steps": state["step"], "epochs_done": state["epoch"], "batch_size": opts.batch_size, "lr": opts.lr,
              "device": str(device), "threads": torch.get_num_threads(),
              "data_seconds": round(samples_time, 1),
              "train_seconds_this_run": round(time.perf_counter() - train_started, 1),
              "final_loss": state["history"][-1]["loss"] if state["history"] else None,
              "trainer_options": trainer.opts}
    if held_out:
        report["eval"] = evaluate(opts, trainer, held_out)
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report

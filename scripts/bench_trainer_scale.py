#!/usr/bin/env python3
"""The FSDP2 trainer at a real model's shape: how much work the micro-batch plans waste, and what
one training step costs in memory and time. It prints figures and asserts nothing.

    python scripts/bench_trainer_scale.py [--layers 2] [--device cpu|cuda] [--dtype float32|bfloat16]
        [--completion-tokens 824] [--sequences 4] [--baseline dbca41c|none] [--skip-before]
        [--no-activation-checkpointing] [--no-measure] [--keep DIR]

The model is a random-weight HF directory of Qwen2.5-0.5B's shape (vocabulary 151,936, hidden
896, MLP 4,864, 14 query and 2 key-value heads, tied embeddings) with ``--layers`` decoder
layers (24 is the full model), weights normal with std 0.02, biases 0 and norms 1. It is written
under ``--keep DIR`` (and reused there) or into a temporary directory.

Work ratio (analytic, no model runs). The GSM8K recipe's batch: 512 rollouts (64 prompts x 8
samples) over 4 ranks, one minibatch. Prompt lengths are uniform on 100..300 tokens (one per
prompt, shared by its 8 samples); completion lengths are lognormal with median 400 tokens
(mu = ln 400 = 5.99) and sigma 1.0, rounded, at least 1 token, capped at 512 (rollout.max_new_tokens
512: about 40% of completions hit the cap) or at 4096 (about 1%); seed 0, the same draws for
both caps. For each cap:

* before: ``plan_by_count(512, 4, 8)``: micro-batches of 8 sequences, each padded to its
  longest (positions = sequences x longest);
* after: ``plan_by_tokens(lengths, 4, BUDGET)``: sequences packed into rows of at most
  ``--budget`` tokens (default 16,384, above the longest sequence at either cap; positions =
  the row's tokens, a filler 2).

Figures: padding share = padding positions / all positions; work ratio = ranks x (sum over the
micro-batch index of the largest positions any rank runs at that index) / real tokens, i.e. the
positions the step takes as long as, in lockstep, per real token (1.0: no padding and perfectly
balanced ranks; it counts positions, the linear layers' and the output layer's work, not
attention's quadratic part); largest = the positions of the largest micro-batch.

Measured step. Each variant runs in a fresh process (``--_measure``): one rank (a process group of
one), ``trainer.minibatches=1``, ``trainer.lr=1e-6``, no entropy or KL term, ``model.dtype`` from
``--dtype``, activation checkpointing on in both (as the real-model recipe has it;
``--no-activation-checkpointing`` keeps every layer's activations in both); batch step 1 holds ``--sequences`` sequences (default 4) of 200 prompt tokens and
``--completion-tokens`` (default 824: 1024 tokens each) random token ids (with ``--shared-prompt``
the same 200 prompt tokens in every sequence, as a GRPO group's samples have them).

* before: the code at ``--baseline`` (default ``dbca41c``, checked out into a temporary git
  worktree and imported from there), ``trainer.fsdp.micro_batch_size=SEQUENCES``: one padded
  micro-batch, whose output layer makes ``[rows, len, vocab]`` float32 logits. With
  ``--baseline none``, the working tree in that count mode.
* after: the working tree, ``trainer.fsdp.max_tokens_per_micro_batch=`` all the batch's tokens:
  one packed row, the output layer a chunk of ``trainer.fsdp.logit_chunk_rows`` at a time.

The optimizer state is allocated before the step without changing the weights (a zero gradient
through AdamW with weight decay 0 moves nothing; its step count is reset after), so the peak is
the step's own: peak = the highest memory during the step minus the memory before it (weights
and optimizer state), i.e. activations, logits and gradients. On the CPU: process RSS (VmHWM,
reset through /proc/self/clear_refs), with ``MALLOC_MMAP_THRESHOLD_`` at 128 KiB so that freed
tensors leave the RSS (glibc's heap would keep hundreds of MiB of freed activations in it); on
CUDA: torch's allocated bytes. On the CPU the step is
timed once (first-call overheads are small next to it); on CUDA one warm-up step (batch step 1)
comes first and batch step 2 is timed, the peak covering both. tokens/s = real tokens (prompt
and completion, no padding) / the timed step's seconds.

The last line printed is one JSON object of the figures (``error`` set, exit status 1, when a
variant failed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "BENCH_RESULT "

VOCAB = 151936
PAD_ID, BOS_ID, EOS_ID = 151643, 151643, 151645

ROLLOUTS, PROMPTS, RANKS = 512, 64, 4
GROUP = ROLLOUTS // PROMPTS
PROMPT_RANGE = (100, 300)
COMPLETION_MEDIAN, COMPLETION_SIGMA = 400, 1.0
CAPS = (512, 4096)
COUNT_SIZE = 8
DEFAULT_BUDGET = 16384
SEED = 0

PROMPT_TOKENS = 200
BEHAVIOUR_LOGPROB = -12.0
"""About ln(1 / 151,936): what a random-weight model gives any token."""


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# --- the model directory ---------------------------------------------------------------------


def model_config(layers: int) -> dict:
    """Qwen2.5-0.5B's config.json with ``layers`` decoder layers, float32 weights."""
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": VOCAB,
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": layers,
        "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 32768,
        "max_window_layers": layers, "attention_dropout": 0.0, "initializer_range": 0.02,
        "use_cache": True, "pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }


def ensure_model(root: Path, layers: int) -> Path:
    """The random-weight model directory under ``root``, created once (atomically: built beside,
    then renamed). No tokenizer files: the trainer copies them only when present."""
    target = root / f"qwen2.5-0.5b-shape-{layers}-layers"
    if (target / "model.safetensors").is_file():
        return target
    import torch

    from rlorch.qwen2 import Qwen2ForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".creating-", dir=root))
    try:
        generator = torch.Generator().manual_seed(SEED)
        model = Qwen2ForCausalLM(model_config(layers))  # parameters left uninitialised
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    param.normal_(0.0, 0.02, generator=generator)
        model.save_pretrained(staging)
        del model
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# --- the analytic work ratio -----------------------------------------------------------------


def recipe_draws() -> tuple[list[int], list[int]]:
    """Per rollout of the recipe's 512: its prompt's length and its uncapped completion length."""
    rng = random.Random(SEED)
    prompts = [rng.randint(*PROMPT_RANGE) for _ in range(PROMPTS)]
    completions = [max(1, round(rng.lognormvariate(math.log(COMPLETION_MEDIAN), COMPLETION_SIGMA)))
                   for _ in range(ROLLOUTS)]
    return [prompts[index // GROUP] for index in range(ROLLOUTS)], completions


def plan_figures(plan: list[list[list[int]]], lengths: list[int], packed: bool) -> dict:
    """Padding share, work ratio and largest micro-batch of a per-rank plan of index lists."""
    def positions(members: list[int]) -> int:
        if not members:
            return 2  # a filler: one row of two pad tokens
        sizes = [lengths[index] for index in members]
        return sum(sizes) if packed else len(sizes) * max(sizes)

    grid = [[positions(members) for members in micros] for micros in plan]
    real = sum(lengths)
    total = sum(map(sum, grid))
    lockstep = sum(max(rank[index] for rank in grid) for index in range(len(grid[0])))
    return {"padding_share": (total - real) / total, "work_ratio": len(plan) * lockstep / real,
            "largest": max(map(max, grid)), "micro_per_rank": len(grid[0]), "positions": total}


def analytic(budget: int) -> dict:
    from rlorch.trainer.batch import plan_by_count, plan_by_tokens

    prompts, completions = recipe_draws()
    figures = {}
    for cap in CAPS:
        lengths = [prompt + min(cap, completion) for prompt, completion in zip(prompts, completions)]
        if budget < max(lengths):
            raise SystemExit(f"--budget {budget} is below the longest sequence ({max(lengths)} at cap {cap})")
        figures[cap] = {
            "real": sum(lengths), "longest": max(lengths),
            "capped_share": sum(completion >= cap for completion in completions) / ROLLOUTS,
            "before": plan_figures(plan_by_count(len(lengths), RANKS, COUNT_SIZE), lengths, packed=False),
            "after": plan_figures(plan_by_tokens(lengths, RANKS, budget), lengths, packed=True)}
    return figures


def print_analytic(figures: dict, budget: int) -> None:
    print(f"Work ratio: {ROLLOUTS} rollouts ({PROMPTS} prompts x {GROUP}), {RANKS} ranks; prompts uniform "
          f"{PROMPT_RANGE[0]}..{PROMPT_RANGE[1]} tokens, completions lognormal (median {COMPLETION_MEDIAN}, "
          f"mu={math.log(COMPLETION_MEDIAN):.2f}, sigma={COMPLETION_SIGMA}), seed {SEED}")
    print(f"{'cap':>5}  {'plan':<30} {'micro/rank':>10} {'largest':>8} {'padding':>8} {'work ratio':>10}")
    for cap, entry in figures.items():
        for key, name in (("before", f"before: count, {COUNT_SIZE} padded"), ("after", f"after: tokens <= {budget}")):
            row = entry[key]
            print(f"{cap:>5}  {name:<30} {row['micro_per_rank']:>10} {row['largest']:>8} "
                  f"{row['padding_share']:>8.1%} {row['work_ratio']:>10.3f}")
        print(f"{'':>5}  ({entry['real']} real tokens, longest sequence {entry['longest']}, "
              f"{entry['capped_share']:.0%} of completions at the cap)")


# --- one measured step, in its own process ---------------------------------------------------


def completion_lengths(sequences: int, cap: int, uneven: bool) -> list[int]:
    """Each measured sequence's completion tokens: ``cap`` each, or (``uneven``) drawn from the
    recipe's lognormal (median 400, sigma 1.0) and capped at ``cap``, seed 1."""
    if not uneven:
        return [cap] * sequences
    rng = random.Random(SEED + 1)
    return [min(cap, max(1, round(rng.lognormvariate(math.log(COMPLETION_MEDIAN), COMPLETION_SIGMA))))
            for _ in range(sequences)]


def batch_lines(completions: list[int], seed: int, shared_prompt: bool = False) -> list[dict]:
    """The batch file's lines: random token ids, the completion trained (loss mask 1); with
    ``shared_prompt`` every line starts with the same prompt, as a GRPO group's samples do."""
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)] if shared_prompt else None
    lines = []
    for index, completion in enumerate(completions):
        mask = [0] * PROMPT_TOKENS + [1] * completion
        tokens = (prompt + [rng.randrange(VOCAB) for _ in range(completion)] if prompt is not None
                  else [rng.randrange(VOCAB) for _ in mask])
        lines.append({
            "group_id": 0, "episode_id": f"bench-{index}", "env": "bench", "origin": "live",
            "finish_reason": "length", "is_eval": False, "prompt_len": PROMPT_TOKENS, "completion": "",
            "tokens": tokens, "loss_mask": mask,
            "logprobs": [BEHAVIOUR_LOGPROB * m for m in mask], "versions": [[0, completion]],
            "advantage": 1.0 if index % 2 else -1.0, "reward": float(index % 2)})
    return lines


class Memory:
    """The step's peak beyond what was allocated before it: process RSS on the CPU, torch's
    allocated bytes on CUDA."""

    def __init__(self, device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.before = 0

    @staticmethod
    def _status_kib(key: str) -> int:
        text = Path("/proc/self/status").read_text()
        return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1))

    def reset(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = torch.cuda.memory_allocated(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS
            self.before = self._status_kib("VmRSS") * 1024

    def peak(self) -> int:
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.before
        return self._status_kib("VmHWM") * 1024 - self.before


def prefill_optimizer(worker) -> None:
    """Allocate AdamW's state without moving a weight: a zero gradient with weight decay 0 is a
    zero update; the step count goes back to 0, so the measured step is the first."""
    import torch

    assert worker.config.trainer.weight_decay == 0
    for param in worker.model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    worker.optimizer.step()
    worker.optimizer.zero_grad(set_to_none=True)
    for state in worker.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()


def measure(spec: dict) -> int:
    """One variant, in this process: set up, one (CUDA: two) training steps, the figures printed
    on one line after RESULT_PREFIX. Works against the baseline's code and the working tree's."""
    import torch

    torch.set_num_threads(cores())
    import rlorch
    from rlorch.config.compose import compose
    from rlorch.rundir.layout import RunDir, save_config, write_atomic
    from rlorch.trainer.fsdp import _setup_distributed, build_worker, train_step

    print(f"[measure {spec['label']}] rlorch from {Path(rlorch.__file__).parent}", flush=True)
    steps = 2 if spec["device"] == "cuda" else 1
    config = compose([f"model.path={spec['model']}", f"model.dtype={spec['dtype']}",
                      f"trainer.fsdp.device={spec['device']}", "trainer.fsdp.nproc=1", f"train.steps={steps}",
                      "trainer.minibatches=1", "trainer.lr=1e-6", "trainer.entropy_coef=0", "trainer.kl_coef=0",
                      "trainer.weight_decay=0", "rollout.temperature=1.0", *spec["overrides"]])
    run = RunDir(Path(spec["run"])).make()
    save_config(config, run.config)
    completions = completion_lengths(spec["sequences"], spec["completion_tokens"], spec.get("uneven", False))
    lines = batch_lines(completions, SEED, spec.get("shared_prompt", False))
    for step in range(1, steps + 1):
        try:
            from rlorch.rundir import batchfile
        except ImportError:    # a --baseline revision from before safetensors batch files
            write_atomic(run.batch(step), "".join(json.dumps(line) + "\n" for line in lines).encode())
        else:
            write_atomic(run.batch(step, config.run.batch_format),
                         batchfile.encode(list(batchfile.iter_rows(lines)), config.run.batch_format))
    device = _setup_distributed(spec["device"])
    worker = build_worker(config, run, device, None)
    prefill_optimizer(worker)
    memory = Memory(device)
    memory.reset()
    for step in range(1, steps + 1):
        started = time.perf_counter()
        record = train_step(worker, step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - started
    peak = memory.peak()
    tokens = sum(PROMPT_TOKENS + completion for completion in completions)
    # The old code reports no positions: its one padded micro-batch runs every row to the longest.
    padded_positions = len(completions) * (PROMPT_TOKENS + max(completions))
    result = {"rlorch": str(Path(rlorch.__file__).parent), "peak_mib": peak / 2**20,
              "before_mib": memory.before / 2**20, "before_kind": "allocated" if device.type == "cuda" else "rss",
              "step_s": elapsed, "timed_step": steps, "tokens": tokens, "trained_tokens": record["tokens"],
              "positions": record.get("positions", padded_positions), "tokens_per_s": tokens / elapsed,
              "loss": record["loss"], "grad_norm": record["grad_norm"],
              "gradient_mib": sum(p.numel() * 4 for p in worker.model.parameters() if p.requires_grad) / 2**20}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
        result["reserved_peak_mib"] = torch.cuda.max_memory_reserved(device) / 2**20
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def run_variant(label: str, args, model: Path, runs: Path, code: Path, overrides: list[str]) -> dict:
    """``measure`` in a fresh Python process importing rlorch from ``code`` (its cwd too)."""
    spec = {"label": label, "model": str(model), "run": str(runs / label), "device": args.device,
            "dtype": args.dtype, "sequences": args.sequences, "completion_tokens": args.completion_tokens,
            "uneven": args.uneven, "shared_prompt": args.shared_prompt,
            "overrides": overrides}
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RLORCH_CONF_DIR")}
    # ``code`` first: its rlorch wins over an installed one; the rest (wheels installed with --target) stays.
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(code), env.get("PYTHONPATH")])),
               OMP_NUM_THREADS=str(cores()), PYTHONUNBUFFERED="1",
               # Every allocation over 128 KiB its own mapping, returned when freed: the process's
               # peak RSS then follows the live tensors, not what glibc's heap kept after a free.
               MALLOC_MMAP_THRESHOLD_="131072")
    print(f"--- {label}: {' '.join(overrides)} (code: {code})", flush=True)
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_measure", json.dumps(spec)],
                              cwd=code, env=env, stdout=subprocess.PIPE, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"{label}: no result within {args.timeout} s"}
    result = None
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
        else:
            print(f"    {line}", flush=True)
    if done.returncode != 0 or result is None:
        return {"error": f"{label}: the measuring process exited {done.returncode} without a result"}
    return result


@contextlib.contextmanager
def worktree(rev: str):
    """The repository at ``rev``, checked out (detached) into a temporary worktree, removed after."""
    path = Path(tempfile.mkdtemp(prefix="rlorch-baseline-"))
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(path), rev], cwd=REPO, check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, check=False)
        shutil.rmtree(path, ignore_errors=True)


def measure_both(args, model: Path, runs: Path) -> dict:
    total = sum(PROMPT_TOKENS + completion
                for completion in completion_lengths(args.sequences, args.completion_tokens, args.uneven))
    both = [f"trainer.activation_checkpointing={str(not args.no_activation_checkpointing).lower()}", *args.set]
    measured = {}
    if not args.skip_before:
        count_mode = [f"trainer.fsdp.micro_batch_size={args.sequences}", *both]
        if args.baseline == "none":
            measured["before"] = run_variant("before", args, model, runs, REPO, count_mode)
        elif Path(args.baseline).is_dir():  # a checkout of the earlier code (a machine without git history)
            measured["before"] = run_variant("before", args, model, runs, Path(args.baseline).resolve(), count_mode)
        else:
            with worktree(args.baseline) as old:
                measured["before"] = run_variant("before", args, model, runs, old, count_mode)
    measured["after"] = run_variant("after", args, model, runs, REPO,
                                    [f"trainer.fsdp.max_tokens_per_micro_batch={total}", *both])
    return measured


# --- output ----------------------------------------------------------------------------------


def print_measured(measured: dict, args) -> None:
    print(f"\nMeasured step: {args.layers} layers, vocabulary {VOCAB}, {args.device}, {args.dtype}; "
          f"{args.sequences} x ({PROMPT_TOKENS} + {'lognormal completions up to ' if args.uneven else ''}"
          f"{args.completion_tokens}) tokens{', one prompt shared by all' if args.shared_prompt else ''}")
    print(f"{'variant':<8} {'positions':>9} {'trained':>8} {'before MiB':>10} {'peak MiB':>9} {'step s':>8} "
          f"{'tokens/s':>9}  code")
    for label, row in measured.items():
        if "error" in row:
            print(f"{label:<8} ERROR: {row['error']}")
            continue
        print(f"{label:<8} {row['positions']:>9} {row['trained_tokens']:>8} {row['before_mib']:>10.0f} "
              f"{row['peak_mib']:>9.0f} {row['step_s']:>8.2f} {row['tokens_per_s']:>9.1f}  {row['rlorch']}")
    print("(peak MiB: beyond the weights and optimizer state present before the step, the step's float32 "
          f"gradients ({max(row.get('gradient_mib', 0) for row in measured.values()):.0f} MiB) included; "
          f"before MiB: {'allocated' if args.device == 'cuda' else 'process RSS'} before the step; activation "
          f"checkpointing {'off' if args.no_activation_checkpointing else 'on'} in both)")


def summary(args, figures: dict, measured: dict, budget: int) -> dict:
    out = {"layers": args.layers, "vocab": VOCAB, "device": args.device, "dtype": args.dtype,
           "baseline": None if args.skip_before or args.no_measure else args.baseline, "sequences": args.sequences,
           "completion_tokens": args.completion_tokens, "uneven": args.uneven, "shared_prompt": args.shared_prompt, "budget": budget, "count_micro_batch_size": COUNT_SIZE,
           "completion_median": COMPLETION_MEDIAN, "completion_sigma": COMPLETION_SIGMA}
    for cap, entry in figures.items():
        for key, suffix in (("after", ""), ("before", "_before")):
            out[f"work_ratio_{cap}{suffix}"] = round(entry[key]["work_ratio"], 4)
            out[f"padding_share_{cap}{suffix}"] = round(entry[key]["padding_share"], 4)
            out[f"largest_micro_positions_{cap}{suffix}"] = entry[key]["largest"]
    for label, row in measured.items():
        for key in ("peak_mib", "before_mib", "gradient_mib", "step_s", "tokens_per_s", "positions", "trained_tokens",
                    "rlorch"):
            if key in row:
                out[f"{key}_{label}"] = round(row[key], 3) if isinstance(row[key], float) else row[key]
        if "gpu" in row:
            out["gpu"] = row["gpu"]
    if "peak_mib_before" in out and out.get("peak_mib_after"):
        out["peak_reduction"] = round(out["peak_mib_before"] / out["peak_mib_after"], 3)
    out["activation_checkpointing"] = not args.no_activation_checkpointing
    errors = [row["error"] for row in measured.values() if "error" in row]
    if errors:
        out["error"] = "; ".join(errors)
    return out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (24: the full model)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--completion-tokens", type=int, default=1024 - PROMPT_TOKENS)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--uneven", action="store_true",
                        help="completion lengths from the recipe's lognormal, capped at --completion-tokens")
    parser.add_argument("--shared-prompt", action="store_true",
                        help="the measured sequences share one prompt, as a GRPO group's samples do")
    parser.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                        help="the analytic token plan's max_tokens_per_micro_batch")
    parser.add_argument("--baseline", default="dbca41c",
                        help="git revision of the before code, a directory holding a checkout of it, or none")
    parser.add_argument("--skip-before", action="store_true", help="measure the working tree only")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for both variants (e.g. model.implementation=native)")
    parser.add_argument("--no-activation-checkpointing", action="store_true",
                        help="both variants keep every layer's activations (default: recomputed, as the recipe)")
    parser.add_argument("--no-measure", action="store_true", help="create the model, print the analytic part")
    parser.add_argument("--keep", type=Path, help="keep the model and run directories here (the model is reused)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per measured variant")
    parser.add_argument("--_measure", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._measure:
        return measure(json.loads(args._measure))
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("OMP_NUM_THREADS", str(cores()))
    root = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="bench-trainer-scale-"))
    measured: dict = {}
    figures: dict = {}
    try:
        started = time.perf_counter()
        model = ensure_model(root, args.layers)
        print(f"model: {model} ({args.layers} layers, {time.perf_counter() - started:.1f} s)", flush=True)
        figures = analytic(args.budget)
        print_analytic(figures, args.budget)
        if not args.no_measure:
            runs = Path(tempfile.mkdtemp(prefix="runs-", dir=root))
            measured = measure_both(args, model, runs)
            print_measured(measured, args)
    except Exception as err:  # still end with the JSON line
        measured["setup"] = {"error": f"{type(err).__name__}: {err}"}
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    out = summary(args, figures, measured, args.budget)
    print(json.dumps(out), flush=True)
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main())

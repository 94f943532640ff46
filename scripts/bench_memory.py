"""Peak memory of one training step with and without ``trainer.activation_checkpointing``.

A ~90M-parameter Qwen2 (created locally with random weights, nothing downloaded) runs the
trainer's forward, policy loss and backward on a batch of random tokens, once plain and once
with each decoder layer checkpointed (``rlorch.trainer.fsdp.checkpoint_activations``, what the
key applies). Each mode runs in its own process, so one's peak cannot hide the other's: on CUDA
the figure is ``torch.cuda.max_memory_allocated``, on CPU the growth of the process's peak
resident set over the step (``ru_maxrss`` after the step minus before it).

Usage: python scripts/bench_memory.py [--batch 4] [--seq 256] [--hidden 768] [--layers 11] [--vocab 16384]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time


def build(hidden: int, layers: int, vocab: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=hidden // 64, tie_word_embeddings=True,
                         max_position_embeddings=4096)
    return Qwen2ForCausalLM(config)


def step(args) -> dict:
    """One forward/backward in this process; the peak memory it added, in MiB."""
    import torch

    from rlorch.config.schema import Correction
    from rlorch.trainer.fsdp import checkpoint_activations
    from rlorch.trainer.loss import policy_loss, token_logprobs

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build(args.hidden, args.layers, args.vocab).to(device)
    if args.checkpointed:
        checkpoint_activations(model)
    model.train()
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    mask = torch.ones(args.batch, args.seq, device=device)
    advantages = torch.linspace(-1, 1, args.batch, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    logp = token_logprobs(model(input_ids=tokens).logits, tokens)
    loss, _ = policy_loss(logp, logp.detach(), mask, advantages, correction=Correction.tis,
                          clip_eps=0.2, is_cap=2.0)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"params_m": sum(p.numel() for p in model.parameters()) / 1e6, "device": device.type,
            "peak_mib": (peak - base) / 2**20, "step_s": time.perf_counter() - started, "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=11)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--checkpointed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(step(args)))
        return
    shape = [f"--batch={args.batch}", f"--seq={args.seq}", f"--hidden={args.hidden}", f"--layers={args.layers}",
             f"--vocab={args.vocab}"]
    # glibc serves freed blocks under its (adaptive, up to 32 MiB) mmap threshold from the heap
    # and keeps them: the resident set would hold the high-water mark of the heap, not of live
    # tensors. A fixed 64 KiB threshold maps every tensor of any size on its own and unmaps it
    # when freed, so the peak resident set follows the live tensors.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    results = {}
    for name, extra in (("plain", []), ("checkpointed", ["--checkpointed"])):
        out = subprocess.run([sys.executable, __file__, "--one", *shape, *extra], check=True,
                             capture_output=True, text=True, env=env).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
    plain, checkpointed = results["plain"], results["checkpointed"]
    print(f"model {plain['params_m']:.1f}M parameters, batch {args.batch} x {args.seq} tokens, "
          f"{plain['device']} ({platform.processor() or platform.machine()})")
    print(f"{'mode':<14}{'peak MiB':>10}{'step s':>9}{'loss':>12}")
    for name, result in results.items():
        print(f"{name:<14}{result['peak_mib']:>10.0f}{result['step_s']:>9.2f}{result['loss']:>12.6f}")
    print(f"activation checkpointing: peak x{checkpointed['peak_mib'] / max(plain['peak_mib'], 1e-9):.2f}, "
          f"step time x{checkpointed['step_s'] / plain['step_s']:.2f}")


if __name__ == "__main__":
    main()

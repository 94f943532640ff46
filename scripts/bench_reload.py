"""Benchmark weight transfer into ``rlorch serve``: disk vs a gloo process group, and print the figures.

A ~70M-parameter Qwen2 (created locally, random weights, nothing downloaded) is served by one
`rlorch serve` subprocess started by the launcher, exactly as in a run. Each round hands it a new
version both ways and times, through the same EnginePool calls the weight watcher makes:

- disk: the trainer's publish (safetensors write + fsync, as ``trainer/publish.py`` does) and
  the engine's pause -> /update_weights_from_disk -> resume;
- distributed: pause -> /update_weights_from_distributed while the trainer's broadcaster sends
  the state dict -> resume (nothing is written).

Prints the median of ``--rounds`` for each, the pause-to-resume ratio (disk / distributed) and
the machine it ran on.

Usage: python scripts/bench_reload.py [--rounds 3] [--hidden 640] [--layers 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from rlorch.config.schema import Config, InferenceBackend
from rlorch.inference.servers import start_engines
from rlorch.rundir.layout import RunDir, write_json_atomic
from rlorch.trainer.broadcast import Broadcaster, _free_port
from rlorch.trainer.publish import HFWriter, publish
from rlorch.launch.weight_group import GroupSpec


def make_model(target: Path, hidden: int, layers: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlorch.model import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 14 // 5,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=hidden // 64, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return model, tokenizer


def perturb(model, seed: int) -> dict:
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 1e-3)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


async def bench(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-reload-") as root:
        root = Path(root)
        model, tokenizer = make_model(root / "model", args.hidden, args.layers)
        writer = HFWriter(model, tokenizer)
        params = sum(p.numel() for p in model.parameters())
        config = Config()
        config.inference.backend = InferenceBackend.cpu
        config.inference.num_servers = 1
        config.inference.cpu.threads = args.threads
        config.model.path = str(root / "model")
        run = RunDir(root / "run").make()
        pool = await start_engines(config, log_dir=run.logs, servers_file=run.servers, model_path=root / "model")
        spec = GroupSpec(master_address="127.0.0.1", master_port=_free_port("127.0.0.1"), rank_offset=1,
                         world_size=2, backend="gloo")
        run.offers.mkdir(parents=True, exist_ok=True)
        write_json_atomic(run.weight_group_members, {"world_size": spec.world_size})
        broadcaster = Broadcaster(run, spec, timeout=120.0, device="cpu", log=lambda message: None)
        figures = {"write": [], "disk": [], "distributed": []}
        try:
            await asyncio.gather(asyncio.to_thread(broadcaster.join), pool.init_weights_update_group(spec.to_json()))
            version = 0
            for round_ in range(args.rounds):
                version += 1
                state = perturb(model, version)
                started = time.perf_counter()
                path = publish(run, version, lambda target: writer.write(target, state))
                figures["write"].append(time.perf_counter() - started)
                started = time.perf_counter()
                await pool.reload(str(path), version)
                figures["disk"].append(time.perf_counter() - started)

                version += 1
                state = perturb(model, version)
                started = time.perf_counter()
                sending = asyncio.create_task(asyncio.to_thread(broadcaster.send, version, state))
                await pool.update_weights_from_distributed(
                    {"names": list(state), "dtypes": [str(t.dtype).removeprefix("torch.") for t in state.values()],
                     "shapes": [list(t.shape) for t in state.values()], "group_name": spec.group_name}, version,
                    receiving=lambda: run.offer_mark(version, "receiving").touch())
                figures["distributed"].append(time.perf_counter() - started)
                if not await sending:
                    raise RuntimeError("the broadcast failed")
        finally:
            await pool.close()
    return {"parameters": params, **{k: statistics.median(v) for k, v in figures.items()}, "runs": figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    result = asyncio.run(bench(args))
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}, python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"model: Qwen2 {result['parameters'] / 1e6:.1f}M parameters (float32, {result['parameters'] * 4 / 2**20:.0f} MiB)")
    print(f"disk        trainer write+fsync {result['write']:.3f}s  engine pause-to-resume {result['disk']:.3f}s "
          f"(median of {args.rounds})")
    print(f"distributed engine pause-to-resume (broadcast included) {result['distributed']:.3f}s (median of {args.rounds})")
    print(f"pause-to-resume ratio disk/distributed: {result['disk'] / result['distributed']:.2f}x; "
          f"with the trainer's write: {(result['disk'] + result['write']) / result['distributed']:.2f}x")


if __name__ == "__main__":
    main()

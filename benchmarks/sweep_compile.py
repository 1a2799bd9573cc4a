"""One-call GPU sweep of torch.compile configurations (``fastdiff.bench.systems.COMPILE_CONFIGS``) on a model's
U-Net forward: for each, the compile time (the first three calls, max-autotune's timing included), the median ms
per forward (CUDA events over a run of back-to-back calls), and the output's largest difference from the eager fp32
forward. It finds the fastest torch.compile configuration, the baseline ``fastdiff bench`` should hold the engine
to. Each configuration compiles in a fresh Dynamo state; the JSON is rewritten after each, so a run cut short keeps
what it measured.

    PYTHONPATH=src python benchmarks/sweep_compile.py --model ddpm-cifar10 --batch 1 --out sweep.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch
import torch._dynamo

from fastdiff.atomic import write_text_atomic
from fastdiff.bench.env import environment
from fastdiff.bench.systems import COMPILE_CONFIGS, compile_model
from fastdiff.devices import time_ms
from fastdiff.models import load_unet

log = logging.getLogger("benchmarks.sweep_compile")


def fresh_model(model: str, dtype: torch.dtype) -> torch.nn.Module:
    """The preset's same random weights each call (seed 0), on the GPU in eval mode."""
    torch.manual_seed(0)
    return load_unet(model, device="cpu", dtype=torch.float32).to(device="cuda", dtype=dtype).eval()


@torch.no_grad()
def sweep_config(name: str, model: str, batch: int, reference: torch.Tensor, calls: int, repeats: int) -> dict:
    """Compile ``model`` in configuration ``name`` and time its forward at ``batch``."""
    torch._dynamo.reset()
    config = COMPILE_CONFIGS[name]
    net = fresh_model(model, torch.float16)
    size = net.config.sample_size
    channels = net.config.in_channels
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, channels, size, size, generator=gen).to("cuda", torch.float16)
    t = torch.full((batch,), 500, dtype=torch.long, device="cuda")
    compiled = compile_model(net, config)
    start = time.perf_counter()
    for _ in range(3):  # compile, autotune and CUDA-graph recording happen in these calls
        out = compiled(x, t)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    diff = (out.float() - reference).abs().max().item()

    def run() -> None:
        for _ in range(calls):
            compiled(x, t)

    run()  # warm-up at full clocks
    times = [time_ms(run, torch.device("cuda")) / calls for _ in range(repeats)]
    return {
        "config": name,
        "notes": config.notes,
        "options": {k: v for k, v in config.options.items()},
        "channels_last": config.channels_last,
        "compile_s": compile_s,
        "ms_per_forward": statistics.median(times),
        "ms_per_forward_all": times,
        "max_abs_diff_vs_fp32": diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ddpm-cifar10", help="a model preset (random weights when it has none)")
    parser.add_argument("--batch", type=int, default=1, help="batch size")
    parser.add_argument("--configs", default=",".join(COMPILE_CONFIGS), help="comma-separated configuration names")
    parser.add_argument("--calls", type=int, default=0, help="forwards per timed run (0: 200 at batch 1, fewer above)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per configuration (the median is kept)")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = args.configs.split(",")
    unknown = [n for n in names if n not in COMPILE_CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}: choose from {', '.join(COMPILE_CONFIGS)}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the configurations are CUDA-graph modes)")
    calls = args.calls or max(10, 200 // args.batch)
    net = fresh_model(args.model, torch.float32)
    size, channels = net.config.sample_size, net.config.in_channels
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, channels, size, size, generator=gen).to("cuda")
    with torch.no_grad():
        reference = net(x, torch.full((args.batch,), 500, dtype=torch.long, device="cuda")).float()
    del net
    result = {"env": environment(), "model": args.model, "batch": args.batch, "calls": calls, "rows": []}
    for name in names:
        try:
            row = sweep_config(name, args.model, args.batch, reference, calls, args.repeats)
        except Exception as exc:  # one configuration failing to compile must not lose the others' rows
            log.exception("%s failed", name)
            row = {"config": name, "error": f"{type(exc).__name__}: {exc}"[:500]}
        log.info("%s", {k: v for k, v in row.items() if k not in ("options", "ms_per_forward_all")})
        result["rows"].append(row)
        write_text_atomic(args.out, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

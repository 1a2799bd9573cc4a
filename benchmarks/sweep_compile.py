"""One-call GPU sweep of torch.compile configurations (``fastdiff.bench.systems.COMPILE_CONFIGS``) on a model's
U-Net forward: for each, the compile time (the first three calls, max-autotune's timing included), the median ms
per forward (CUDA events over runs of back-to-back calls), the output's largest difference from the eager fp32
forward (TF32 off), and Inductor's CUDA-graph counters (inputs copied into the graph on each replay, skipped graphs).
It finds the fastest torch.compile configuration, the baseline ``fastdiff bench`` should hold the engine to. Each
configuration compiles after ``torch._dynamo.reset()``, but Inductor's on-disk caches persist: a compile time reads
what earlier configurations of the run (and earlier runs on the machine) left there. The JSON is rewritten after
each configuration, so a run cut short keeps what it measured.

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
from torch._dynamo.utils import counters

from fastdiff.atomic import check_output_location, write_text_atomic
from fastdiff.bench.env import environment
from fastdiff.bench.runner import seeded_model_factory
from fastdiff.bench.systems import COMPILE_CONFIGS, compile_model
from fastdiff.devices import time_ms

log = logging.getLogger("benchmarks.sweep_compile")

SCHEMA = "fastdiff.sweep-compile/1"
CUDAGRAPH_COUNTERS = ("cudagraph_recorded_non_static_inputs", "cudagraph_skips")


@torch.no_grad()
def sweep_config(name: str, net: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, reference: torch.Tensor,
                 calls: int, repeats: int) -> dict:  # fmt: skip
    """Compile ``net`` (a fresh fp16 copy on the GPU) in configuration ``name`` and time its forward on (x, t)."""
    torch._dynamo.reset()
    counters.clear()
    config = COMPILE_CONFIGS[name]
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
        "options": config.options,
        "channels_last": config.channels_last,
        "compile_s": compile_s,
        "ms_per_forward": statistics.median(times),
        "ms_per_forward_all": times,
        "max_abs_diff_vs_fp32": diff,
        "inductor_counters": {k: counters["inductor"][k] for k in CUDAGRAPH_COUNTERS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ddpm-cifar10", help="a model preset (random weights when it has none)")
    parser.add_argument("--batch", type=int, default=1, help="batch size")
    parser.add_argument("--configs", default=",".join(COMPILE_CONFIGS),
                        help=f"comma-separated configurations, from: {', '.join(COMPILE_CONFIGS)}")  # fmt: skip
    parser.add_argument("--calls", type=int, default=0, help="forwards per timed run (0: 200 at batch 1, fewer above)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per configuration (the median is kept)")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = args.configs.split(",")
    unknown = [n for n in names if n not in COMPILE_CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}: choose from {', '.join(COMPILE_CONFIGS)}")
    for flag, value, least in (("--batch", args.batch, 1), ("--calls", args.calls, 0), ("--repeats", args.repeats, 1)):
        if value < least:
            parser.error(f"{flag} must be at least {least}, got {value}")
    check_output_location(args.out, "--out")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the configurations are CUDA-graph modes)")
    calls = args.calls or max(10, 200 // args.batch)
    make_model = seeded_model_factory(args.model, seed=0)  # the same random weights for every configuration
    net = make_model().to("cuda").eval()
    size, channels = net.config.sample_size, net.config.in_channels
    x = torch.randn(args.batch, channels, size, size, generator=torch.Generator().manual_seed(1)).to("cuda")
    t = torch.full((args.batch,), 500, dtype=torch.long, device="cuda")
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        reference = net(x, t).float()
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    del net
    result = {"schema": SCHEMA, "env": environment(), "model": args.model, "batch": args.batch, "calls": calls,
              "repeats": args.repeats, "rows": []}  # fmt: skip
    for name in names:
        net = None
        try:
            net = make_model().to(device="cuda", dtype=torch.float16).eval()
            row = sweep_config(name, net, x.half(), t, reference, calls, args.repeats)
        except Exception as exc:  # one configuration failing to compile must not lose the others' rows
            log.exception("%s failed", name)
            row = {"config": name, "notes": COMPILE_CONFIGS[name].notes, "error": f"{type(exc).__name__}: {exc}"[:500]}
        log.info("%s", {k: v for k, v in row.items() if k not in ("options", "ms_per_forward_all")})
        result["rows"].append(row)
        write_text_atomic(args.out, json.dumps(result, indent=1))
        del net


if __name__ == "__main__":
    main()

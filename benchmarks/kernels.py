"""Time every REGISTRY kernel against its torch ref (eager and torch.compile) at the models' real shapes.

    python benchmarks/kernels.py --out benchmarks/results/kernels-h100.json [--ops a,b] \
        [--cases cifar10-b1,cifar10-b256,sd15-b2] [--dtype fp16] [--no-compile]
    python benchmarks/kernels.py --markdown benchmarks/results/kernels-h100.json   # JSON -> Markdown table

Per op and case: the median time (``triton.testing.do_bench``, return_mode="median", which warms up and
clears L2 before every timed call; inputs that fit in L2 are also rotated over several sets) of the Triton
kernel, the torch ref in eager mode, ``torch.compile(ref)`` and, where torch has a fused kernel for the
op, that kernel (``F.scaled_dot_product_attention`` for attention). Achieved TFLOP/s and GB/s come from
the op's ``cost()`` (useful FLOPs, minimal bytes); the ceilings they are divided by are MEASURED in the same
run (a bf16 8192^3 matmul; a 1 GiB device-to-device copy counting bytes read + written). Every row records
the relative error of its output against the ref run on fp32 copies of the inputs, and the GPU, driver,
library versions, git sha and date.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger("benchmarks.kernels")

DEFAULT_CASES = ("cifar10-b1", "cifar10-b256", "sd15-b2", "sd15-b2-mid", "sd15-b2-ff", "sd15-b2-proj", "sd15-b2-kv")
"""Example sizes timed by default; each op runs those of them its ``example_inputs`` knows (the token-matrix ops
name their SD1.5 shapes ``sd15-b2-*``)."""
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ENV_KEYS = ("gpu", "driver", "torch", "triton", "cuda", "git_sha", "date")
MAX_INPUT_SETS = 4


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def _layer_norm_native(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _linear_native(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    geglu: bool = False,
    out_scale: float | None = None,
    packed: bool = False,
) -> torch.Tensor:
    """cuBLAS (``F.linear``, bias fused) in the input dtype, then the epilogue as separate torch ops."""
    from fastdiff.kernels.common import activation_ref

    y = F.linear(x, weight.t() if packed else weight, bias)
    if geglu:
        value, gate = y.chunk(2, dim=-1)
        y = value * F.gelu(gate)
    y = activation_ref(y, activation)
    if residual is not None:
        y = y + residual
    return y if out_scale is None else y * out_scale


TORCH_FUSED: dict[str, tuple[str, Callable[..., Any]]] = {
    "attention": ("torch_sdpa", _sdpa),
    "layer_norm": ("torch_layer_norm", _layer_norm_native),
    "linear": ("torch_cublas", _linear_native),
}
"""Op name -> (impl name, torch's own fused kernel with the op's signature), timed as an extra baseline."""


def _outputs(result: Any) -> tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value


def rel_err(result: Any, reference: tuple[torch.Tensor, ...]) -> float:
    """Largest ‖out − ref‖ / ‖ref‖ over the outputs, in float64; NaN anywhere gives NaN."""
    errs = []
    for out, ref in zip(_outputs(result), reference, strict=True):
        diff = (out.double() - ref.double()).norm() / ref.double().norm()
        errs.append(float("nan") if out.isnan().any() else diff.item())
    return max(errs)


def _bench_matmul(bench: Callable[[Callable[[], Any]], float], size: int) -> float:
    a = torch.randn((size, size), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((size, size), device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    return bench(lambda: torch.matmul(a, b, out=c))


def _bench_copy(bench: Callable[[Callable[[], Any]], float], nbytes: int) -> float:
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    return bench(lambda: dst.copy_(src))


def measure_ceilings(bench: Callable[[Callable[[], Any]], float]) -> dict[str, float]:
    """Measured peaks: bf16 matmul TFLOP/s (8192^3, random data) and copy GB/s (1 GiB, read + write)."""
    size = 8192
    matmul_ms = _bench_matmul(bench, size)
    copy_bytes = 2**30
    copy_ms = _bench_copy(bench, copy_bytes)
    moved = 2 * copy_bytes
    torch.cuda.empty_cache()
    return {
        "matmul_bf16_tflops": 2 * size**3 / (matmul_ms * 1e-3) / 1e12,
        "matmul_ms": matmul_ms,
        "copy_gbps": moved / (copy_ms * 1e-3) / 1e9,
        "copy_ms": copy_ms,
    }


def _input_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    values = list(args) + list(kwargs.values())
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def _rotating(fn: Callable[..., Any], sets: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> Callable[[], Any]:
    state = {"i": 0}

    def call() -> Any:
        args, kwargs = sets[state["i"] % len(sets)]
        state["i"] += 1
        return fn(*args, **kwargs)

    return call


def bench_case(
    name: str,
    op: Any,
    case: str,
    dtype: torch.dtype,
    ceilings: dict[str, float],
    bench: Callable[[Callable[[], Any]], float],
    compile_ref: bool,
    env_row: dict[str, Any],
    device: str = "cuda",
    l2_bytes: int = 0,
) -> list[dict[str, Any]]:
    """Rows (one per implementation) for one op at one case; inputs under ``l2_bytes`` rotate over sets. No rows
    for a case the op has no example inputs of."""
    from fastdiff.errors import FastdiffError

    try:
        args, kwargs = op.example_inputs(case, dtype, device, 0)
    except FastdiffError:
        log.info("%-18s %-13s (no example inputs of this size)", name, case)
        return []
    flops, moved = op.cost(args, kwargs)
    reference = _outputs(op.ref(*[_to_fp32(a) for a in args], **{k: _to_fp32(v) for k, v in kwargs.items()}))
    one_set = _input_bytes(args, kwargs)
    n_sets = 1 if one_set >= l2_bytes else min(MAX_INPUT_SETS, math.ceil(2 * l2_bytes / max(one_set, 1)))
    sets = [(args, kwargs)] + [op.example_inputs(case, dtype, device, seed) for seed in range(1, n_sets)]

    impls: list[tuple[str, Callable[..., Any]]] = [("triton", op.triton), ("torch_eager", op.ref)]
    if compile_ref:
        impls.append(("torch_compile", torch.compile(op.ref, dynamic=False)))
    if name in TORCH_FUSED:
        impls.append(TORCH_FUSED[name])

    rows = []
    for impl, fn in impls:
        row: dict[str, Any] = {
            "op": name,
            "case": case,
            "dtype": str(dtype).removeprefix("torch."),
            "impl": impl,
        }
        row.update({"flops": flops, "bytes": moved, "input_sets": n_sets, **env_row})
        try:
            row["rel_err"] = rel_err(fn(*args, **kwargs), reference)
            ms = bench(_rotating(fn, sets))
        except Exception as exc:  # a baseline that fails to compile or run is recorded, not fatal
            log.warning("%s %s %s failed: %s", name, case, impl, exc)
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            rows.append(row)
            continue
        tflops = flops / (ms * 1e-3) / 1e12
        gbps = moved / (ms * 1e-3) / 1e9
        row.update({
            "median_ms": ms,
            "tflops": tflops,
            "gbps": gbps,
            "pct_peak_flops": 100 * tflops / ceilings["matmul_bf16_tflops"],
            "pct_peak_bw": 100 * gbps / ceilings["copy_gbps"],
        })  # fmt: skip
        log.info("%-18s %-13s %-14s %9.4f ms  %7.1f GB/s  err %.1e", name, case, impl, ms, gbps, row["rel_err"])
        rows.append(row)
    del args, kwargs, sets, reference
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def markdown_table(results: dict[str, Any]) -> str:
    """One line per (op, case): Triton's time, the baselines' times, speedups, achieved rates, error."""
    by_key: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for row in results["rows"]:
        by_key.setdefault((row["op"], row["case"]), {})[row["impl"]] = row

    def ms(row: dict[str, Any] | None) -> str:
        if row is None:
            return "–"
        return f"{row['median_ms']:.4f}" if "median_ms" in row else "failed"

    def speedup(triton: dict[str, Any], other: dict[str, Any] | None) -> str:
        if other is None or "median_ms" not in other or "median_ms" not in triton:
            return "–"
        return f"{other['median_ms'] / triton['median_ms']:.2f}×"

    c = results["ceilings"]
    env = results["env"]
    lines = [
        f"{env['gpu']}, driver {env['driver']}, torch {env['torch']}, triton {env['triton']}, "
        f"git {env['git_sha']}, {env['date']}, dtype {results['dtype']}. Measured ceilings: "
        f"{c['matmul_bf16_tflops']:.0f} TFLOP/s (bf16 matmul), {c['copy_gbps']:.0f} GB/s (copy).",
        "",
        "| op | case | Triton ms | eager ms | compile ms | torch fused ms | vs eager | vs compile | vs fused "
        "| TFLOP/s | GB/s | % copy BW | rel err |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (op, case), impls in by_key.items():
        triton = impls.get("triton", {})
        fused = next((impls[k] for k in impls if k not in ("triton", "torch_eager", "torch_compile")), None)
        rates = (
            f"{triton['tflops']:.2f} | {triton['gbps']:.0f} | {triton['pct_peak_bw']:.0f}%"
            if "median_ms" in triton
            else "– | – | –"
        )
        err = f"{triton['rel_err']:.1e}" if "rel_err" in triton else "–"
        lines.append(
            f"| {op} | {case} | {ms(triton or None)} | {ms(impls.get('torch_eager'))} | "
            f"{ms(impls.get('torch_compile'))} | {ms(fused)} | {speedup(triton, impls.get('torch_eager'))} | "
            f"{speedup(triton, impls.get('torch_compile'))} | {speedup(triton, fused)} | {rates} | {err} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="results JSON (default benchmarks/results/kernels-<gpu>.json)")
    parser.add_argument("--ops", help="comma-separated REGISTRY names (default: all)")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help="comma-separated example sizes")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile(ref) baseline")
    parser.add_argument("--markdown", type=Path, metavar="JSON", help="print a results JSON as Markdown and exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.markdown is not None:
        print(markdown_table(json.loads(args.markdown.read_text())))
        return 0
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU (none found); use --markdown to render existing results")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import triton.testing

    from fastdiff.bench.env import environment, gpu_slug
    from fastdiff.kernels import REGISTRY

    names = args.ops.split(",") if args.ops else list(REGISTRY)
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        print(f"unknown op {unknown[0]!r}; expected one of {', '.join(REGISTRY)}")
        return 2
    cases = [c for c in args.cases.split(",") if c]
    dtype = DTYPES[args.dtype]
    env = environment()
    env_row = {k: env.get(k) for k in ENV_KEYS}
    out_path = args.out or Path("benchmarks/results") / f"kernels-{gpu_slug(env['gpu'])}.json"

    def bench(fn: Callable[[], Any]) -> float:
        return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")

    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    ceilings = measure_ceilings(bench)
    log.info(
        "ceilings: %.0f TFLOP/s bf16 matmul, %.0f GB/s copy",
        ceilings["matmul_bf16_tflops"],
        ceilings["copy_gbps"],
    )
    rows = []
    for name in names:
        for case in cases:
            rows += bench_case(
                name,
                REGISTRY[name],
                case,
                dtype,
                ceilings,
                bench,
                not args.no_compile,
                env_row,
                "cuda",
                l2_bytes,
            )
    results = {"env": env, "dtype": args.dtype, "ceilings": ceilings, "rows": rows}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=1))
    print(markdown_table(results))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``fastdiff serve`` and ``fastdiff loadtest``: the CLI fronts of serve.app and serve.loadtest."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from fastdiff.atomic import check_output_location, write_text_atomic
from fastdiff.cli_args import (
    DEFAULT_GUIDANCE,
    DEFAULT_MODEL,
    DTYPE_CHOICES,
    DTYPE_HELP,
    PAD_WAIT,
    SAMPLERS,
    add_command,
    add_plan_argument,
    finite_nonnegative_float,
    port_int,
    positive_float,
    positive_int,
    seed_int,
)
from fastdiff.errors import FastdiffError

log = logging.getLogger(__name__)

SERVE_EXTRA = "pip install 'fastdiff[serve]'"


def int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def read_prompts(path: Path) -> list[str]:
    """The prompts of a prompts file (``fastdiff.prompts_file``: one a line, or JSONL lines with ``prompt``), in
    order, each line's prompt ``n`` times; a one-line error when it is unreadable or holds none."""
    from fastdiff.prompts_file import read_prompts as read_lines

    lines, _ = read_lines(path, DEFAULT_GUIDANCE, "")
    return [line.prompt for line in lines for _ in range(line.n)]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``serve`` and ``loadtest``."""
    add_command(subparsers, "serve", add_serve_arguments)
    add_command(subparsers, "loadtest", add_loadtest_arguments)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``fastdiff serve`` (sets ``func=run_serve``)."""
    p.description = (
        "Serve a model over HTTP: POST /v1/images (JSON), GET /v1/model, /health, /metrics and a "
        "page at /. Unconditional models and text-to-image models (Stable Diffusion directories, the bundled "
        "fashion-mnist-t2i: requests give a prompt). Concurrent requests with the same sampler and steps (text "
        "models: also size, guidance on or off, img2img strength) are sampled together in batches of up "
        "to --max-batch images; a request's images are the same whether it ran alone or in a batch."
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset name or model directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=port_int, default=8000, help="TCP port")
    p.add_argument("--max-batch", type=positive_int, default=16, help="images per batch (and per request)")
    p.add_argument(
        "--max-wait-ms", type=finite_nonnegative_float, default=10.0, help="longest wait of a request for company"
    )
    p.add_argument(
        "--pad-wait",
        type=finite_nonnegative_float,
        default=PAD_WAIT,
        help="a batch that would run padded (fewer images than its batch size) waits for more requests up to this "
        "fraction of that size's sampling time beyond --max-wait-ms (0: off)",
    )
    p.add_argument(
        "--no-idle-start",
        dest="idle_start",
        action="store_false",
        help="wait --max-wait-ms for company even when the service is idle (by default a request starts at once "
        "when the last batch answered one request and none arrived while it ran)",
    )
    p.add_argument("--queue-size", type=positive_int, default=64, help="waiting requests before 429")
    p.add_argument(
        "--batch-buckets",
        type=int_list,
        default=None,
        help="comma-separated batch sizes a batch is padded up to (default: --max-batch only, which keeps "
        "images byte-identical however requests were batched; smaller sizes cut latency at low load)",
    )
    p.add_argument("--sampler", default="ddim", choices=SAMPLERS, help="sampler of requests that name none")
    p.add_argument("--steps", type=positive_int, default=50, help="steps of requests that name none")
    p.add_argument(
        "--guidance",
        type=finite_nonnegative_float,
        default=DEFAULT_GUIDANCE,
        help="guidance of text-to-image requests that name none (7.5 suits Stable Diffusion; pass 3 for the "
        "bundled fashion-mnist-t2i; <= 1 turns guidance off); unconditional models take none",
    )
    p.add_argument("--device", default="auto", help="auto (GPU if present, else CPU), cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help=DTYPE_HELP,
    )
    p.add_argument("--warmup", action="store_true", help="sample every batch size once before serving")
    add_plan_argument(p)
    p.set_defaults(func=run_serve)


def add_loadtest_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``fastdiff loadtest`` (sets ``func=run_loadtest_cli``)."""
    p.description = (
        "K client threads send R requests in all to a running `fastdiff serve`, each sending its "
        "next request when the last one is answered. Reports images/s, requests/s, latency p50/p95/p99 and the "
        "number of 429s and errors; --out also writes them as JSON. Exits with 1 when a request failed (other than "
        "429) or the server is not healthy afterwards."
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server address")
    p.add_argument("--concurrency", type=positive_int, default=8, help="client threads (K)")
    p.add_argument("--requests", type=positive_int, default=64, help="requests in all (R)")
    p.add_argument("--n", type=positive_int, default=1, help="images per request")
    p.add_argument("--steps", type=positive_int, default=None, help="steps (default: the server's)")
    p.add_argument("--sampler", default=None, choices=SAMPLERS, help="sampler (default: the server's)")
    p.add_argument("--seed", type=seed_int, default=0, help="request i asks for seeds SEED + i*n ...")
    p.add_argument(
        "--server-pid",
        type=positive_int,
        default=None,
        help="the server's process id (on this machine): its memory (RSS; GPU memory from its /metrics) is sampled "
        "before and after the load and goes into the summary",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="text file, one prompt per line (blank lines skipped): request i takes line i mod the count, for "
        "text-to-image servers",
    )
    p.add_argument("--timeout", type=positive_float, default=300.0, help="seconds before a request counts as an error")
    p.add_argument("--out", type=Path, default=None, help="write the summary JSON here")
    p.set_defaults(func=run_loadtest_cli)


def run_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from fastdiff.serve.app import create_app
    except ImportError as exc:
        raise FastdiffError(f"fastdiff serve needs {exc.name}: {SERVE_EXTRA}") from None
    app = create_app(
        args.model,
        device=args.device,
        dtype=args.dtype,
        sampler=args.sampler,
        steps=args.steps,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        queue_size=args.queue_size,
        batch_buckets=args.batch_buckets,
        warmup=args.warmup,
        plan=args.plan,
        guidance=args.guidance,
        pad_wait=args.pad_wait,
        idle_start=args.idle_start,
    )
    log.info("open http://%s:%d/ in a browser", args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=args.verbose)
    return 0


def run_loadtest_cli(args: argparse.Namespace) -> int:
    if args.out is not None and args.out.suffix != ".json":
        raise FastdiffError(f"--out must be a .json file, got {args.out}")
    if args.out is not None:
        check_output_location(args.out, "--out")
    try:
        from fastdiff.serve.loadtest import run_loadtest
        from fastdiff.serve.schema import MAX_SEED
    except ImportError as exc:
        raise FastdiffError(f"fastdiff loadtest needs {exc.name}: {SERVE_EXTRA}") from None
    last = args.seed + args.requests * args.n - 1
    if last > MAX_SEED:
        raise FastdiffError(
            f"--seed {args.seed}: the requests would ask for seeds up to {last}, past the server's "
            f"largest seed {MAX_SEED}"
        )
    prompts = None if args.prompts is None else read_prompts(args.prompts)
    if args.server_pid is not None and not Path(f"/proc/{args.server_pid}").exists():
        raise FastdiffError(f"--server-pid {args.server_pid}: no such process on this machine")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one log line per request
    summary = run_loadtest(
        args.url,
        concurrency=args.concurrency,
        requests=args.requests,
        n=args.n,
        steps=args.steps,
        sampler=args.sampler,
        seed=args.seed,
        timeout_s=args.timeout,
        prompts=prompts,
        server_pid=args.server_pid,
    )
    latency = summary["latency_ms"]
    log.info(
        "%d ok, %d shed (429), %d errors in %.2f s: %.2f images/s, %.2f requests/s, latency p50 %s p95 %s p99 %s ms",
        summary["ok"],
        summary["rejected_429"],
        summary["errors"],
        summary["wall_s"],
        summary["images_per_s"],
        summary["requests_per_s"],
        latency["p50"],
        latency["p95"],
        latency["p99"],
    )
    for example in summary["error_examples"]:
        log.warning("error: %s", example)
    if args.out is not None:
        write_text_atomic(args.out, json.dumps(summary, indent=1) + "\n")
        log.info("wrote %s", args.out)
    return 1 if summary["errors"] or not summary["healthy_after"] else 0

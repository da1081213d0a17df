"""The ``batchsim`` command (also ``python -m batchsim``).

Each subcommand is a pair of functions: ``_args_NAME(parser)`` declares its arguments
and ``_run_NAME(args)`` does the work and returns an exit code; ``COMMANDS`` lists them.
Bad arguments print one line, ``batchsim: error: ...``, and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (and exit code 2)."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"batchsim: error: {message}\n")


def _service_spec(text: str):
    """``affine:BASE_MS,PER_ITEM_MS`` -> AffineService."""
    from .service import AffineService

    kind, _, params = text.partition(":")
    if kind != "affine":
        raise ValueError(f"--service must look like affine:BASE_MS,PER_ITEM_MS, got {text!r}")
    try:
        base_ms, per_item_ms = (float(v) for v in params.split(","))
    except ValueError:
        raise ValueError(
            f"--service must look like affine:BASE_MS,PER_ITEM_MS, got {text!r}") from None
    return AffineService(base_ms, per_item_ms)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments shared by commands that simulate: arrivals, service, workers, n, seed."""
    p.add_argument("--rate", type=float, required=True, help="mean arrival rate, requests/s")
    p.add_argument("--arrivals", choices=["poisson", "constant", "gamma"], default="poisson")
    p.add_argument("--cv", type=float, default=1.0, help="gap CV for --arrivals gamma")
    svc = p.add_mutually_exclusive_group()
    svc.add_argument("--service", default="affine:1.9,0.14",
                     help="affine:BASE_MS,PER_ITEM_MS (default %(default)s)")
    svc.add_argument("--profile", help="service profile JSON file or shipped profile name")
    p.add_argument("--jitter-cv", type=float, default=0.0, help="service-time CV")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("-n", "--n-requests", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", default="auto")


def model_from_args(args):
    """``(workload, service)`` from the shared model arguments."""
    from dataclasses import replace

    from . import workload as wl
    from .service import load_service

    arrivals = {"poisson": lambda: wl.Poisson(args.rate),
                "constant": lambda: wl.Constant(args.rate),
                "gamma": lambda: wl.Gamma(args.rate, args.cv)}[args.arrivals]()
    service = load_service(args.profile) if args.profile else _service_spec(args.service)
    if args.jitter_cv:
        service = replace(service, jitter_cv=args.jitter_cv)
    return arrivals, service


def _args_simulate(p):
    add_model_arguments(p)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--max-queue-size", type=int, default=None)
    p.add_argument("--timeout-ms", type=float, default=None)
    p.add_argument("--slo-ms", type=float, default=None, help="report goodput within this SLO")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _run_simulate(args) -> int:
    from .policy import BatchPolicy
    from .sim import simulate

    workload, service = model_from_args(args)
    policy = BatchPolicy(args.max_batch_size, args.max_wait_ms, args.max_queue_size,
                         args.timeout_ms)
    res = simulate(workload, policy, service, n_requests=args.n_requests,
                   workers=args.workers, seed=args.seed, engine=args.engine)
    summary = res.summary(slo_ms=args.slo_ms)
    if args.json:
        print(json.dumps(summary, default=float))
    else:
        print(format_summary(summary))
    return 0


def format_summary(summary: dict) -> str:
    """A two-column text table of a summary dict."""
    width = max(map(len, summary))
    lines = []
    for key, value in summary.items():
        if isinstance(value, float):
            value = f"{value:.4g}" if math.isfinite(value) else str(value)
        elif isinstance(value, list):
            value = ", ".join(f"{v:.3g}" for v in value)
        lines.append(f"{key:<{width}}  {value}")
    return "\n".join(lines)


COMMANDS = {
    "simulate": ("simulate one policy and print its summary", _args_simulate, _run_simulate),
}


def main(argv=None) -> int:
    parser = _Parser(prog="batchsim", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (help_text, add_args, _run) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command][2](args)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"batchsim: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

"""Benchmarks that measure each variant in a fresh process of their own script.

A variant that changes the process for good (a thread pool left behind, the CPUs it may
run on) is measured in a process of its own: the script runs itself with ``--child
VARIANT``, and the child prints its figures as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def arguments(doc: str, repeats_help: str) -> argparse.Namespace:
    """``--repeats`` (default 5) and the hidden ``--child`` of such a benchmark."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help=repeats_help)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def run_child(script: str, variant: str, repeats: int, env: dict) -> dict:
    """Run ``script --child variant`` in a fresh process; the JSON it printed last."""
    out = subprocess.run([sys.executable, script, "--child", variant, "--repeats",
                          str(repeats)], env=env, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])

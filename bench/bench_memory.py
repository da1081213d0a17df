"""Peak memory of one 10-million-request run of the fast engine.

Target (issue 3): under 1.5 GB. Each case runs in a fresh child process, and the peak
resident set size is read from the operating system (``getrusage``, the number
``/usr/bin/time -v`` prints as "Maximum resident set size"). A child that only imports
batchsim and draws nothing is shown as the baseline. Exit code 1 if a case misses.

    .venv/bin/python bench/bench_memory.py
"""

import argparse
import subprocess
import sys

N = 10_000_000
TARGET_MB = 1500
RUN = """
import batchsim as bs
service = bs.AffineService(1.9, 0.14, jitter_cv={jitter})
res = bs.simulate(bs.Poisson({rate}), {policy}, service, n_requests={n}, workers={workers},
                  engine="fast")
res.summary()
"""
CASES = [  # (label, policy, rate, workers, jitter)
    ("b=32 wait=5ms", "bs.BatchPolicy(32, 5.0)", 2000.0, 1, 0.0),
    ("b=1 (one batch per request)", "bs.BatchPolicy(1, 0.0)", 400.0, 1, 0.0),
    ("b=32, queue<=64, timeout, jitter, 2 workers",
     "bs.BatchPolicy(32, 2.0, max_queue_size=64, timeout_ms=20.0)", 9000.0, 2, 0.3),
]


def peak_mb(code: str) -> float:
    """Peak RSS of a fresh Python running ``code``, in MB.

    A middle process starts it and reads its children's peak, so that every case gets
    its own number (a process's children's peak is the largest of all so far).
    """
    probe = ("import resource, subprocess, sys\n"
             f"subprocess.run([sys.executable, '-c', {code!r}], check=True)\n"
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                         text=True).stdout
    return int(out.split()[-1]) / 1024      # Linux reports kB


def main() -> int:
    print(f"{N:,} requests per run; peak resident memory of a fresh process")
    print(f"{'baseline: import batchsim':<46} {peak_mb('import batchsim'):7.0f} MB")
    missed = 0
    for label, policy, rate, workers, jitter in CASES:
        mb = peak_mb(RUN.format(policy=policy, rate=rate, n=N, workers=workers, jitter=jitter))
        verdict = "ok" if mb < TARGET_MB else "MISSED"
        missed += verdict == "MISSED"
        print(f"{label:<46} {mb:7.0f} MB   target < {TARGET_MB} MB: {verdict}")
    return 1 if missed else 0


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,  # --help; no options
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    sys.exit(main())

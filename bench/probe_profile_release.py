"""Why a profile through the batcher can come out slower than the batches it predicts.

``profile_batcher`` times full batches through a one-worker ``DynamicBatcher`` handed
every request at once. On an H100 its encoder ``s(32)`` came out 2.37 ms, while the
same batches took 1.26-1.33 ms in the fidelity runs after it. Two suspects, side by side,
on the encoder (bfloat16) at max_batch_size 8 and 32:

* ``kept``: every output kept to the end of the profile (``run_saturated`` with a window
  of every request, as the profile did): on CUDA each batch then pins a new output
  buffer, since none is ever given back;
* ``let go``: each output freed when its batch ends (what ``profile_batcher`` does now);
* ``cold`` / ``warm``: the GPU idles at low clocks; ``cold`` runs first in a fresh
  process, ``warm`` after a second of the model at full batches.

Order: let go (cold), then the warm-up, let go (warm), kept (warm). Medians in ms of 20
batches each. Run on a GPU machine: ``python bench/probe_profile_release.py``
(``--dry-run``: the CPU and the tiny encoder, where nothing is pinned).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from batchsim.policy import BatchPolicy  # noqa: E402
from batchsim.real import DynamicBatcher, make_model, profile_batcher  # noqa: E402
from batchsim.real.loadgen import run_saturated  # noqa: E402

SIZES = (8, 32)
REPEATS = 20


def kept_ms(model, dev, b: int) -> float:
    """The old profile: every request at once, every output kept to the end."""
    n = (REPEATS + 2) * b
    batcher = DynamicBatcher(model, BatchPolicy(b, float("inf")), device=dev)
    res = run_saturated(batcher, n, inputs=model.input_spec.random(min(b, 64)), window=n)
    return float(np.median(1e3 * (res.end_s - res.start_s)[2:]))


def warm_up(model, dev, b: int, seconds: float = 1.0) -> None:
    """Run the model on full batches for ``seconds`` (clocks up)."""
    x = model.input_spec.random(b).to(dev)
    t0 = time.perf_counter()
    with torch.no_grad():
        while time.perf_counter() - t0 < seconds:
            model(x)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny encoder, seconds")
    args = p.parse_args()
    dev = torch.device("cpu" if args.dry_run else "cuda")
    torch.set_num_threads(1)
    model = make_model("encoder", dev, "float32" if args.dry_run else "bfloat16",
                       "tiny" if args.dry_run else "default")
    rows = {"let go, cold": profile_batcher(model, SIZES, repeats=REPEATS).times_ms}
    warm_up(model, dev, max(SIZES))
    rows["let go, warm"] = profile_batcher(model, SIZES, repeats=REPEATS).times_ms
    rows["kept, warm"] = [kept_ms(model, dev, b) for b in SIZES]
    print(f"{model.zoo_name} on {dev}: s(b) through the batcher, median ms")
    for label, times in rows.items():
        print(f"  {label:13s} " + "  ".join(f"s({b}) {t:.3f}" for b, t in zip(SIZES, times,
                                                                            strict=True)))
    base = rows["let go, warm"]
    print("  kept / let go (warm): " + "  ".join(
        f"{k / g:.2f}x" for k, g in zip(rows["kept, warm"], base, strict=True))
          + "; cold / warm (let go): " + "  ".join(
        f"{c / g:.2f}x" for c, g in zip(rows["let go, cold"], base, strict=True)))


if __name__ == "__main__":
    main()

"""Where the process and the real batcher's threads run, and keeping those CPUs awake.

A batcher's timings depend on where the OS runs its event loop and its threads, and on
whether their CPUs idled in between (``bench/results/README.md``). Calibrating on one
machine state and predicting runs in another is the largest error left on a CPU, so
``batchsim validate`` and the fidelity benches settle the machine first:

* ``cpu_list`` reads CPUs as Linux writes them (``"0"``, ``"2-5"``, ``"2,3,8-9"``);
* ``run_on_cpus`` puts the calling thread (the event loop) and every thread it starts
  afterwards on them;
* ``kept_awake`` keeps them out of their idle states while a block runs;
* ``settle_on_cpus`` does both for ``--cpu`` and ``--keep-awake``;
* ``split_for_threads`` keeps the first of them for the event loop and the others for a
  batcher's threads (``--pin-threads``);
* ``checked_thread_cpus`` and ``on_cpu`` pin a ``DynamicBatcher``'s own threads one per
  CPU (its ``thread_cpus=``);
* ``SchedStat`` reads what the scheduler counted for one thread: the CPU time it ran and
  the time it waited to run.

Two checks of "a CPU this process may run on": ``run_on_cpus`` and ``kept_awake`` take
the calling thread's CPUs, because they set the process's; ``checked_thread_cpus`` tries
each CPU on the calling thread, because a caller may have narrowed its own thread to the
event loop's CPU and put the batcher's threads on the others. Linux only; standard
library only, so the real batcher and ``calibrate`` can both use it.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import warnings
from collections.abc import Iterable
from numbers import Integral


def process_cpus() -> list[int] | None:
    """The CPUs the calling thread may run on: its process's, unless the thread was
    narrowed since (None where the OS does not say)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


#: The largest CPU number Linux can have (its NR_CPUS at most): a bound that keeps
#: ``cpu_list`` from building a huge range out of a typo.
MAX_CPU = 8191


def cpu_list(text: str, name: str = "cpu") -> tuple[int, ...]:
    """CPU numbers written as Linux writes them (``"0"``, ``"2-5"``, ``"2,3,8-9"``), as a
    sorted tuple; anything else (or a number above ``MAX_CPU``) is refused with a
    ``ValueError`` naming ``name``."""
    cpus = set()
    try:
        for part in str(text).split(","):
            lo, dash, hi = part.partition("-")
            first, last = int(lo), int(hi if dash else lo)
            if first < 0 or last < first or last > MAX_CPU:
                raise ValueError
            cpus.update(range(first, last + 1))
    except ValueError:
        raise ValueError(f"{name} must be CPU numbers like 0, 2-5 or 2,3,8-9, got "
                         f"{text!r}") from None
    return tuple(sorted(cpus))


def _checked_cpus(cpus, name: str) -> tuple[int, ...]:
    """``cpus`` (one CPU number or several) as a tuple, each one this process may run on;
    else a ``ValueError`` naming ``name``."""
    chosen = (cpus,) if isinstance(cpus, int) else tuple(cpus)
    ours = process_cpus() or []
    if not chosen or any(cpu not in ours for cpu in chosen):
        raise ValueError(f"{name} must be one of this process's CPUs {ours}, got "
                         f"{cpus if isinstance(cpus, int) else list(chosen)!r}")
    return chosen


#: The threads of a batcher on CUDA: the event loop, and the pipeline's stager, launcher
#: and completer (one worker).
CUDA_THREADS = 4


def run_on_cpus(cpus, name: str = "cpu", device=None) -> None:
    """Run the calling thread, and every thread it starts afterwards, on ``cpus`` (one CPU
    number or several) only.

    Called before a batcher starts. On one CPU its event loop and its worker share that
    CPU, in a calibration and in every run after it (``bench/bench_thread_placement.py``:
    where the OS puts the two changes what a hand-over between them costs). A GPU
    batcher's pipeline has three threads besides the loop: on one CPU they queue for it
    (on an H200 the calibrations fell 15-64% apart), so with ``device`` CUDA fewer than
    ``CUDA_THREADS`` CPUs draw a warning. A CPU this process may not run on is refused
    with a ``ValueError`` naming ``name``.
    """
    chosen = _checked_cpus(cpus, name)
    if str(device).startswith("cuda") and len(chosen) < CUDA_THREADS:
        warnings.warn(f"{name} gives a GPU batcher {len(chosen)} CPU(s) {list(chosen)} for "
                      f"its {CUDA_THREADS} threads, which then queue for them: give "
                      f"{CUDA_THREADS} or more (e.g. 2-7)", stacklevel=2)
    os.sched_setaffinity(0, set(chosen))


#: Linux's PM QoS request of how long (us, a native int) a CPU may take to come back
#: from an idle state: 0 keeps every CPU polling when it has nothing to run. The request
#: holds while the file stays open, and ends when it is closed, by the process's exit too.
CPU_WAKE_LATENCY = "/dev/cpu_dma_latency"


def can_keep_awake() -> bool:
    """Whether this process may keep CPUs awake (write ``CPU_WAKE_LATENCY``: root)."""
    return os.access(CPU_WAKE_LATENCY, os.W_OK)


@contextlib.contextmanager
def kept_awake(cpus, name: str = "cpu"):
    """Keep ``cpus`` (one CPU number or several) out of their idle states while the block
    runs; the block gets them, as a tuple.

    A real batcher leaves its CPUs idle between batches. A virtual machine's CPU
    that idles is given back to the host, and the batch that wakes it runs slower by
    an amount that changes from second to second with what the host ran meanwhile. The
    tiny CNN timed with pauses between batches (``bench/bench_keep_awake.py``), kept
    awake: 0.91x the median batch time, 0.83x the mean, half the spread of its speed
    over 1.5 s windows. Servers tuned for latency keep their CPUs out of idle states
    (``idle=poll``, tuned's latency-performance profile); so does this, as tuned does:
    a PM QoS request of no wake-up latency (``CPU_WAKE_LATENCY``), under which an idle
    CPU polls instead of halting. Linux takes it for every CPU; ``cpus`` are the ones
    the caller runs on, checked as ``run_on_cpus`` checks them.

    Not a process spinning at idle priority on each CPU, as here before. On one CPU that
    spinner let the event loop's timer in before a running batch's end in 36-39% of the
    batches, against 96-100% left to idle or under the request, and the release after a
    batch took a median 265 us against 236 (the tiny encoder's full batches of 64, a
    timer during each: ``bench/probe_busy_timer.py``). The simulator's loop wakes at its
    timer; with the spinner the real one mostly waited for the batch's end. Refused with
    a ``ValueError`` naming ``name`` where a CPU is not this process's or the request
    cannot be made (not root, not Linux).
    """
    chosen = _checked_cpus(cpus, name)
    try:
        fd = os.open(CPU_WAKE_LATENCY, os.O_WRONLY)
    except OSError as e:
        raise ValueError(f"{name}: keeping CPUs {list(chosen)} awake needs write access to "
                         f"{CPU_WAKE_LATENCY} (root, Linux), got: {e.strerror}") from None
    try:
        os.write(fd, struct.pack("i", 0))
        yield chosen
    finally:
        os.close(fd)


def awake_when_pinned(cpus, keep_awake: bool | None = None, name: str = "cpu",
                      flag: str = "keep_awake"):
    """The context a fidelity check runs in: on ``cpus``, when given (one CPU number or
    several), ``kept_awake`` unless ``keep_awake`` is False; nothing to do without.

    ``keep_awake=None`` (the default of ``batchsim validate`` and ``bench_fidelity.py``)
    keeps the given CPUs awake where this process may (``can_keep_awake``), else leaves
    them to idle with a ``RuntimeWarning`` that says why. In five pairs of one-CPU grids
    per tiny model, the grid kept awake was the closer of its pair in 53 of 75
    comparisons (median |error| at p50 and p99 on two Poisson sets, p50 on bursts), and
    met the p50 target on 16 of 30 Poisson sets against 7 (``bench/results/README.md``).
    ``keep_awake=True`` without a CPU is refused with a ``ValueError`` naming ``flag``
    and ``name``, and where the CPUs cannot be kept awake, naming ``name``.
    """
    if keep_awake and cpus is None:
        raise ValueError(f"{flag} needs {name}, the CPU to keep awake, got none")
    if cpus is None or keep_awake is False:
        return contextlib.nullcontext()
    if keep_awake is None and not can_keep_awake():
        warnings.warn(f"{name} {list(_checked_cpus(cpus, name))} left to idle: keeping them "
                      f"awake needs write access to {CPU_WAKE_LATENCY} (root); {flag} False "
                      f"says so and silences this", RuntimeWarning, stacklevel=2)
        return contextlib.nullcontext()
    return kept_awake(cpus, name)


def settle_on_cpus(cpus: str | None, keep_awake: bool | None = None, device=None,
                   name: str = "cpu", flag: str = "keep_awake"):
    """What ``--cpu`` and ``--keep-awake`` do in ``batchsim validate`` and the fidelity
    benches: ``cpus`` written as Linux writes them (``cpu_list``; None leaves the
    threads to the OS) become this process's CPUs (``run_on_cpus``), before any thread
    starts; returns them (a tuple, or None) and the context to run in
    (``awake_when_pinned``). Bad values are refused with a ``ValueError`` naming
    ``name`` or ``flag``, before anything is pinned."""
    chosen = None if cpus is None else cpu_list(cpus, name)
    awake = awake_when_pinned(chosen, keep_awake, name, flag)
    if chosen is not None:
        run_on_cpus(chosen, name, device)
    return chosen, awake


def split_for_threads(cpus, name: str = "--cpu",
                      flag: str = "--pin-threads") -> tuple[int, tuple[int, ...]]:
    """``cpus`` (as ``settle_on_cpus`` returns them) split for pinned threads: the event
    loop's CPU, the first, and the CPUs of a batcher's threads, the others. Fewer than
    two are refused with a ``ValueError`` naming ``flag`` and ``name``."""
    if cpus is None or len(cpus) < 2:
        raise ValueError(f"{flag} needs two or more CPUs in {name} (the event loop on the "
                         f"first, a batcher's threads on the others), got "
                         f"{None if cpus is None else list(cpus)}")
    return cpus[0], tuple(cpus[1:])


def checked_thread_cpus(cpus) -> tuple[int, ...] | None:
    """``DynamicBatcher``'s ``thread_cpus`` checked: None (the OS places the threads), or
    CPUs this process may run on (a non-empty sequence, repeats allowed: one per thread,
    in turn); else a ``ValueError`` naming the parameter and the value."""
    if cpus is None:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"thread_cpus needs Linux (sched_setaffinity), got {cpus!r}")
    chosen = () if isinstance(cpus, str) or not isinstance(cpus, Iterable) else tuple(cpus)
    if not chosen or any(isinstance(c, bool) or not isinstance(c, Integral)
                         or not _may_run_on(int(c)) for c in chosen):
        raise ValueError(f"thread_cpus must be CPUs this process may run on, got {cpus!r}")
    return tuple(int(c) for c in chosen)


def _may_run_on(cpu: int) -> bool:
    """Whether a thread of this process may be pinned to ``cpu``: tried on the calling
    thread and undone (its own mask may be narrower than the process's: a caller that
    keeps the event loop on one CPU and the batcher's threads on others)."""
    here = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu})
        return True
    except (OSError, ValueError, OverflowError):
        return False
    finally:
        os.sched_setaffinity(0, here)


def on_cpu(run, cpu: int | None):
    """``run``, first pinning the thread that runs it to ``cpu`` (None: as it is)."""
    if cpu is None:
        return run

    def pinned():
        try:
            os.sched_setaffinity(0, {cpu})  # on Linux, 0 is the calling thread
        except OSError:
            pass  # the CPU went away since it was checked: run where the thread is
        run()
    return pinned


class SchedStat:
    """One thread's scheduler counters, from Linux's ``/proc/self/task/<tid>/schedstat``:
    ``read()`` gives the CPU time it has run and the time it has spent waiting to run
    (runnable, another thread on its CPU), in seconds; NaN where there is no such file,
    once ``close()`` has run, or once the thread has ended.

    Another thread may read it without changing what the scheduler does: the figures are
    the scheduler's last counts (a thread's own CPU clock, ``time.thread_time()``, brings
    its count up to date first, which on one CPU changed how the batcher's two threads
    shared it: ``bench/results/README.md``). The CPU time is counted at the latest when
    the thread last left its CPU, and a wait when it ends; a running thread's own read
    is exact for its wait. The file is opened once, here, and each read is one ``pread``
    (about half a microsecond).
    """

    def __init__(self, tid: int | None):
        """``tid``: the thread's native id (``threading.get_native_id()``); None, none
        yet (NaN)."""
        self._file = None
        if tid is not None:
            with contextlib.suppress(OSError):
                self._file = open(f"/proc/self/task/{tid}/schedstat", "rb", buffering=0)

    def read(self) -> tuple[float, float]:
        """(CPU time run, time waited to run), in seconds. Never raises."""
        try:
            ran_ns, waited_ns = os.pread(self._file.fileno(), 64, 0).split()[:2]
            return int(ran_ns) / 1e9, int(waited_ns) / 1e9
        except (AttributeError, OSError, ValueError):  # no file, closed, or thread gone
            return math.nan, math.nan

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


"""batchsim.cpus: CPU lists, pinning the process, keeping its CPUs awake.

(Pinning a batcher's own threads is tested with the batcher, in test_real_batcher.py.)"""

import os
import struct
import subprocess
import sys
import textwrap
import warnings

import pytest


def _wake_latency_us() -> int:
    """The CPUs' wake-up latency Linux allows now (the tightest PM QoS request)."""
    from batchsim.cpus import CPU_WAKE_LATENCY

    with open(CPU_WAKE_LATENCY, "rb") as f:
        return struct.unpack("i", f.read(4))[0]


def _requests_allowed() -> bool:
    """Whether this process may make PM QoS requests and read them back, with no other
    process holding one of no latency (a fidelity bench running beside the tests)."""
    from batchsim.cpus import CPU_WAKE_LATENCY, can_keep_awake

    return (can_keep_awake() and os.access(CPU_WAKE_LATENCY, os.R_OK)
            and _wake_latency_us() > 0)


needs_requests = pytest.mark.skipif(not _requests_allowed(),
                                    reason="PM QoS requests need root on Linux, and none "
                                           "of no latency held by another process")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_pinning_a_gpu_batcher_to_fewer_cpus_than_its_threads_warns():
    from batchsim.cpus import CUDA_THREADS, run_on_cpus

    ours = os.sched_getaffinity(0)
    cpu = max(ours)
    try:
        with pytest.warns(UserWarning, match=rf"--cpu gives a GPU batcher 1 CPU\(s\) \[{cpu}\] "
                          rf"for its {CUDA_THREADS} threads"):
            run_on_cpus(cpu, "--cpu", "cuda:0")
        assert os.sched_getaffinity(0) == {cpu}
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            run_on_cpus(cpu, "--cpu", "cpu")      # on the CPU one is the advice
    finally:
        os.sched_setaffinity(0, ours)


@pytest.mark.parametrize("text, cpus", [("0", (0,)), ("2-5", (2, 3, 4, 5)),
                                         ("8,2-3,3", (2, 3, 8)), ("8191", (8191,))])
def test_cpu_list_reads_cpus_as_linux_writes_them(text, cpus):
    from batchsim.cpus import cpu_list

    assert cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "1,,2", "0-", "0-100000000", "8192"])
def test_cpu_list_refuses_anything_else_naming_the_flag(text):
    from batchsim.cpus import cpu_list

    with pytest.raises(ValueError, match=rf"--cpu must be CPU numbers like .* got {text!r}"):
        cpu_list(text, "--cpu")


@needs_requests
@pytest.mark.parametrize("which", ["last", "all"])
def test_kept_awake_asks_for_no_wake_up_latency_until_the_block_ends(which):
    from batchsim.cpus import kept_awake

    ours = os.sched_getaffinity(0)
    before = _wake_latency_us()
    cpus = sorted(ours)[-1:] if which == "last" else sorted(ours)
    with kept_awake(cpus[0] if which == "last" else cpus) as kept:
        assert kept == tuple(cpus)
        assert _wake_latency_us() == 0
    assert _wake_latency_us() == before
    assert os.sched_getaffinity(0) == ours        # this process stays where it was


@needs_requests
def test_kept_awake_ends_when_its_process_dies_without_closing_it():
    """A bench killed mid-grid must not leave the CPUs polling: Linux drops the request
    with the process's open files."""
    before = _wake_latency_us()
    script = textwrap.dedent(f"""
        import os, struct
        from batchsim.cpus import CPU_WAKE_LATENCY, kept_awake
        kept = kept_awake({max(os.sched_getaffinity(0))})   # held: no clean-up runs
        kept.__enter__()
        with open(CPU_WAKE_LATENCY, "rb") as f:
            print(struct.unpack("i", f.read(4))[0], flush=True)
        os._exit(0)                     # no clean-up, as if killed
        """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout.split()[0]) == 0
    assert _wake_latency_us() == before


def test_where_no_request_can_be_made_keeping_awake_is_refused_or_skipped(monkeypatch):
    """No access to the request (not root, not Linux): ``kept_awake`` and ``keep_awake``
    True are refused naming the flag's CPUs, the default leaves the CPUs to idle with a
    warning that says why, and False stays silent."""
    import batchsim.cpus as cpus_mod

    monkeypatch.setattr(cpus_mod, "CPU_WAKE_LATENCY", "/nonexistent/cpu_dma_latency")
    cpu = max(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=rf"--cpu: keeping CPUs \[{cpu}\] awake needs write "
                                         r"access to /nonexistent/cpu_dma_latency"):
        with cpus_mod.kept_awake(cpu, "--cpu"):
            pass
    with pytest.raises(ValueError, match="keeping CPUs .* awake needs write access"):
        with cpus_mod.awake_when_pinned(cpu, True, "--cpu", "--keep-awake"):
            pass
    with pytest.warns(RuntimeWarning, match=rf"--cpu \[{cpu}\] left to idle: keeping them "
                                            r"awake needs write access .* --keep-awake False"):
        with cpus_mod.awake_when_pinned(cpu, None, "--cpu", "--keep-awake") as kept:
            assert kept is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with cpus_mod.awake_when_pinned(cpu, False, "--cpu", "--keep-awake") as kept:
            assert kept is None


@pytest.mark.parametrize("cpus, shown", [(4096, "4096"), (-1, "-1"), ([0, 4096], r"\[0, 4096\]"),
                                         ([], r"\[\]")])
def test_kept_awake_and_pinning_refuse_a_cpu_this_process_may_not_use(cpus, shown):
    from batchsim.cpus import kept_awake, run_on_cpus

    ours = os.sched_getaffinity(0)
    match = rf"--cpu must be one of this process's CPUs .* got {shown}$"
    with pytest.raises(ValueError, match=match):
        with kept_awake(cpus, "--cpu"):
            pass
    with pytest.raises(ValueError, match=match):
        run_on_cpus(cpus, "--cpu")
    assert os.sched_getaffinity(0) == ours


@needs_requests
def test_a_pinned_check_keeps_its_cpu_awake_unless_told_not_to():
    """``awake_when_pinned``: a given CPU is kept awake by default and with True; False,
    or no CPU, leaves the machine as it is; True without a CPU is refused."""
    from batchsim.cpus import awake_when_pinned

    cpu = max(os.sched_getaffinity(0))
    before = _wake_latency_us()
    for keep_awake in (None, True):
        with awake_when_pinned(cpu, keep_awake) as kept:
            assert kept == (cpu,) and _wake_latency_us() == 0
        assert _wake_latency_us() == before
    for cpu_given, keep_awake in ((cpu, False), (None, None), (None, False)):
        with awake_when_pinned(cpu_given, keep_awake) as kept:
            assert kept is None and _wake_latency_us() == before
    with pytest.raises(ValueError, match="--keep-awake needs --cpu, the CPU to keep awake"):
        awake_when_pinned(None, True, "--cpu", "--keep-awake")


def test_pinned_threads_split_the_cpus_the_loop_first_and_need_two():
    from batchsim.cpus import split_for_threads

    assert split_for_threads((2, 3, 4, 5)) == (2, (3, 4, 5))
    assert split_for_threads((0, 1)) == (0, (1,))
    for cpus, shown in (((3,), r"\[3\]"), (None, "None")):
        with pytest.raises(ValueError, match=rf"--pin-threads needs two or more CPUs in --cpu "
                                             rf"\(the event loop on the first.* got {shown}$"):
            split_for_threads(cpus)


"""batchsim.cpus: CPU lists, pinning the process, keeping its CPUs awake.

(Pinning a batcher's own threads is tested with the batcher, in test_real_batcher.py.)"""

import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest


def _within(seconds: float, condition) -> bool:
    """Whether ``condition()`` comes true within ``seconds`` (polled every 50 ms)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _scheduling(pid: int) -> tuple[bool, list[int]]:
    """Whether a process runs at ``SCHED_IDLE`` priority, and the CPUs it may run on."""
    return os.sched_getscheduler(pid) == os.SCHED_IDLE, sorted(os.sched_getaffinity(pid))


def _ended(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


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


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize("which", ["last", "all"])
def test_kept_awake_spins_at_idle_priority_on_each_cpu_until_the_block_ends(which):
    from batchsim.cpus import kept_awake

    ours = os.sched_getaffinity(0)
    cpus = sorted(ours)[-1:] if which == "last" else sorted(ours)
    with kept_awake(cpus[0] if which == "last" else cpus) as spinners:
        # each spinner pins itself to its CPU and lowers its class as it starts
        assert len(spinners) == len(cpus)
        for spinner, cpu in zip(spinners, cpus, strict=True):
            assert _within(10.0, lambda s=spinner, c=cpu: _scheduling(s.pid) == (True, [c]))
            assert spinner.poll() is None
    assert all(spinner.poll() is not None for spinner in spinners)
    assert os.sched_getaffinity(0) == ours        # this process stays where it was


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_kept_awake_spinner_ends_when_its_process_dies_without_closing_it():
    """A bench killed mid-grid must not leave a CPU spinning: the spinner notices that
    the process that started it is gone."""
    cpu = max(os.sched_getaffinity(0))
    script = textwrap.dedent(f"""
        import os
        from batchsim.cpus import kept_awake
        spinner, = kept_awake({cpu}).__enter__()
        print(spinner.pid, flush=True)
        os._exit(0)                     # no clean-up, as if killed
        """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    pid = int(run.stdout.split()[0])
    assert _within(10.0, lambda: _ended(pid))


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


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_a_pinned_check_keeps_its_cpu_awake_unless_told_not_to():
    """``awake_when_pinned``: a given CPU is kept awake by default and with True; False,
    or no CPU, leaves the machine as it is; True without a CPU is refused."""
    from batchsim.cpus import awake_when_pinned

    cpu = max(os.sched_getaffinity(0))
    for keep_awake in (None, True):
        with awake_when_pinned(cpu, keep_awake) as (spinner,):
            assert _within(10.0, lambda: _scheduling(spinner.pid) == (True, [cpu]))
        assert spinner.poll() is not None
    for cpu_given, keep_awake in ((cpu, False), (None, None), (None, False)):
        with awake_when_pinned(cpu_given, keep_awake) as spinners:
            assert spinners is None
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


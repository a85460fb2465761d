"""``commands.heap``: ``join`` has glibc keep the memory a step frees, so the next step's fresh
tensors do not fault their pages in again; a setting of the user's own environment wins."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                 reason="glibc's malloc only (Linux)")]

# A training step's shape: a 40 MB layer's gradient and AdamW's temporaries made and dropped
# each step; the pages faulted in over 10 steps after 5 to warm up.
PROBE = textwrap.dedent("""
    import resource, sys, torch
    from p2ptrain.commands.heap import keep_freed_memory
    kept = keep_freed_memory() if sys.argv[1] == "keep" else None
    torch.set_num_threads(1)
    layer = torch.nn.Linear(3200, 3200)
    adam = torch.optim.AdamW(layer.parameters())
    x = torch.randn(4, 3200)
    def step():
        adam.zero_grad(set_to_none=True)
        layer(x).square().mean().backward()
        adam.step()
    for _ in range(5):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def probe(mode: str, **env) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, **env}, capture_output=True, text=True,
                         timeout=50, check=True).stdout.split()
    return out[0], int(out[1])


def test_freed_memory_is_reused_instead_of_faulted_in_again():
    _, faults_default = probe("default")
    kept, faults_kept = probe("keep")
    assert faults_default > 10 * 9000  # (each step faulted at least a 40 MB tensor's ~10,000 pages again)
    assert kept == "True" and faults_kept < faults_default / 10


def test_the_users_own_malloc_settings_are_left_as_they_are():
    kept, faults = probe("keep", GLIBC_TUNABLES="")
    assert kept == "False" and faults > 10 * 9000


def test_join_keeps_freed_memory(tmp_path):
    out = subprocess.run([sys.executable, "-m", "p2ptrain", "join", "--log-level", "debug", "--no-discovery",
                          "--task", "synthetic", "--model-size", "20k", "--max-rounds", "2",
                          "--checkpoint-dir", str(tmp_path)],
                         env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")},
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "malloc: freed memory is kept for reuse" in out.stderr
    assert "MB of heap touched for the first steps" in out.stderr  # (the training thread's, on a CPU)


# A round's buffers made on a fresh loop thread: the pages a 16 MB array faults in there.
LOOP_PROBE = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from p2ptrain.commands.heap import keep_freed_memory
    from p2ptrain.trainer.loopthread import LoopThread
    keep_freed_memory()
    LoopThread.warm_bytes = int(sys.argv[1])
    async def first_round():
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        buffers = [np.ones(1 << 20, np.float32) for _ in range(4)]
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    thread = LoopThread("probe")
    print(thread.call(first_round()))
    thread.stop()
""")


def probe_faults(probe: str, arg: str) -> int:
    """The page faults ``probe`` prints, run on malloc's defaults (the probe keeps freed memory itself)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    return int(subprocess.run([sys.executable, "-c", probe, arg], env=clean, capture_output=True,
                              text=True, timeout=50, check=True).stdout)


def loop_faults(warm: int) -> int:
    return probe_faults(LOOP_PROBE, str(warm))


def test_a_warmed_loop_thread_makes_its_first_buffers_from_pages_it_touched_already():
    cold, warm = loop_faults(0), loop_faults(32 << 20)
    assert cold > 1000  # (16 MB: 4,096 pages, faulted in on first touch; the kernel maps some at a time)
    assert warm < cold / 10


def test_join_warms_the_loop_thread_by_the_models_size_where_the_heap_keeps_freed_memory(monkeypatch):
    from p2ptrain.commands import heap
    from p2ptrain.trainer.loopthread import LoopThread

    elems = 100_100
    monkeypatch.setattr(LoopThread, "warm_bytes", 0)
    monkeypatch.setattr(heap, "_kept", False)
    heap.warm_loop_thread(elems)
    assert LoopThread.warm_bytes == (0 if not heap.keeps_freed_memory() else heap.WARM_VECTORS * 4 * elems)
    monkeypatch.setattr(heap, "_kept", True)
    heap.warm_loop_thread(elems)
    assert LoopThread.warm_bytes == heap.WARM_VECTORS * 4 * elems
    monkeypatch.setattr(heap, "WARM_MAX_BYTES", 1 << 20)
    heap.warm_loop_thread(elems)
    assert LoopThread.warm_bytes == 1 << 20
    assert heap.keeps_freed_memory(heap.KEEP_FREED_ENV)  # (a benchmark's environment: the same heap)


# The training thread's first step (a backward and an Adam step of 1 M parameters): the pages it faults in.
STEP_PROBE = textwrap.dedent("""
    import resource, sys
    import torch
    from p2ptrain.commands.heap import keep_freed_memory, warm_training_thread
    torch.set_num_threads(1)
    keep_freed_memory()
    model = torch.nn.Linear(1000, 1000)
    optimizer = torch.optim.Adam(model.parameters(), fused=sys.argv[1] == "fused" or None)
    x = torch.randn(4, 1000)
    if sys.argv[1] != "cold":
        warm_training_thread(sum(p.numel() for p in model.parameters()), fused=sys.argv[1] == "fused")
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    model(x).sum().backward()
    optimizer.step()
    print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
""")


def step_faults(mode: str) -> int:
    return probe_faults(STEP_PROBE, mode)


def test_a_warmed_training_thread_takes_its_first_gradients_and_optimizer_state_from_pages_it_touched():
    """join warms the thread that trains while the peer waits for its cluster: round 0 of every
    run paid these faults (56-185 ms a first step with four peers starting on 2 cores)."""
    cold, warm, fused = step_faults("cold"), step_faults("warm"), step_faults("fused")
    assert cold > 2000  # (gradients, Adam's moments and its temporaries: 5,200 pages on first touch here)
    assert warm < cold / 5
    assert fused < cold / 5  # (fused Adam makes no temporaries: half the warm-up covers it)

"""keep_cpu_heap: large CPU tensors stop faulting in fresh pages once freed blocks are kept (Note [Fresh pages on CPU])."""

import os
import subprocess
import sys
import textwrap

import pytest

from blockdiag_cp.parallel import keep_cpu_heap

#: a child process that allocates and frees 40 MiB tensors and prints the minor faults of the last rounds
_PROBE = textwrap.dedent("""
    import ctypes, resource, sys, torch
    from blockdiag_cp.parallel import keep_cpu_heap
    applied = keep_cpu_heap() if sys.argv[1] == "keep" else None
    # glibc's own account (mallinfo2, glibc >= 2.33) of a 40 MiB block malloc'd and freed at once (nothing
    # above it on the heap): mmapped or from the heap; the heap trimmed or kept when it is freed
    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is not None:
        mallinfo2.restype, libc.malloc.restype = Info, ctypes.c_void_p
        libc.malloc.argtypes, libc.free.argtypes = (ctypes.c_size_t,), (ctypes.c_void_p,)
        before = mallinfo2()
        block = libc.malloc(40 << 20)
        allocated = mallinfo2()
        libc.free(block)
        freed = mallinfo2()
        account = f"{allocated.hblkhd - before.hblkhd},{allocated.arena - freed.arena}"
    else:
        account = "None"
    x = torch.randn(20480, 512)
    index = torch.arange(20480)
    for _ in range(3):  # warm-up: the first allocations are new pages in any case
        y = x.index_select(0, index) * 2
    del y
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(12):
        y = x.index_select(0, index) * 2
        del y
    print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, account)
""")

linux_glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                                 reason="glibc's mallopt")


def _probe(mode: str, **env: str) -> tuple[str, int, str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")}
    clean["OMP_NUM_THREADS"] = "1"  # one thread: every tensor from the main arena
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True,
                         env={**clean, **env}).stdout.split()
    return out[0], int(out[1]), out[2]


@pytest.mark.slow  # child processes allocating hundreds of MB: seconds (the fast loop has the environment checks)
@linux_glibc
def test_kept_heap_reuses_freed_large_blocks():
    _, faults_default, account_default = _probe("default")
    applied, faults_kept, account_kept = _probe("keep")
    assert applied == "True"
    if account_kept != "None":  # (mmapped bytes of the fresh block, bytes trimmed when it was freed)
        assert int(account_default.split(",")[0]) >= 40 << 20, account_default  # by default: mmapped
        assert account_kept == "0,0", account_kept  # kept: from the heap, and the heap stays when it is freed
    # 12 rounds x 2 fresh tensors of 40 MiB: 20k faults a round by default; kept, most rounds fault none
    # (the heap still grows now and then while freed blocks fragment it: 0-4 rounds' worth measured)
    assert faults_default > 200_000, faults_default
    assert faults_kept < faults_default / 2, (faults_kept, faults_default)


@pytest.mark.parametrize("name, value", [("MALLOC_MMAP_THRESHOLD_", "262144"),
                                         ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=262144"),
                                         ("LD_PRELOAD", "/usr/lib/libjemalloc.so.2"),
                                         ("LD_PRELOAD", "/lib/libfoo.so:/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"),
                                         ("LD_PRELOAD", "libmimalloc.so")])
def test_environment_choice_is_left_alone(monkeypatch, name, value):
    monkeypatch.setenv(name, value)  # read at the call: no child process needed
    assert keep_cpu_heap() is False


@pytest.mark.parametrize("size", [0, -1, (1 << 30) + 1])
def test_bad_block_size_is_a_value_error(size):
    with pytest.raises(ValueError, match="max_block_bytes"):
        keep_cpu_heap(size)

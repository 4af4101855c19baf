"""SharedTensorArena.release() keeps its promise: while any tensor viewing
the arena is alive (one from tensor() or view(), or a slice, .view() or
reshape of one) it raises BufferError naming the arena and keeps the
memory mapped and usable; once they are all gone it unmaps and unlinks.
Before the fix release() unmapped under live tensors, and touching one
afterwards crashed the process: this test stops at the first release()
that succeeds too early, before touching anything.

Usage: arena_test.py
"""

import gc
import os

import torch

import ferry


def refused(arena, what):
    try:
        arena.release()
    except BufferError as e:
        assert arena.name in str(e), str(e)
        assert not arena.released
        assert os.path.exists("/dev/shm" + arena.name), "unlinked while refused"
        return
    raise AssertionError("release() succeeded while %s views the arena" % what)


def main():
    arena = ferry.SharedTensorArena("arena-test", 1 << 16)
    t = arena.tensor((8, 8))
    t.copy_(torch.arange(64, dtype=torch.float32).view(8, 8))
    refused(arena, "a tensor from tensor()")
    # Still mapped: read and written after the refusal.
    assert t.sum().item() == sum(range(64)), t
    t.add_(1)
    assert t[7, 7].item() == 64.0

    # A view of a slice keeps the arena alive after the tensor is gone.
    v = t[2:4].reshape(-1).view(torch.int32)
    off = arena.offset_of(t)
    del t
    gc.collect()
    refused(arena, "a view of a slice")
    assert v.numel() == 16

    # view() tensors count too; another view at the same bytes agrees.
    w = arena.view(off, (8, 8), torch.float32)
    assert w[2, 0].item() == 17.0, w
    del v
    gc.collect()
    refused(arena, "a tensor from view()")

    # A tensor in a reference cycle counts until the collector frees it.
    cycle = [w.t()]
    cycle.append(cycle)
    del w, cycle
    gc.collect()
    arena.release()
    assert arena.released
    assert not os.path.exists("/dev/shm" + arena.name)
    arena.release()  # twice is fine

    # Released: no new tensors until reallocated, then zeros at the same
    # offsets.
    try:
        arena.view(off, (8, 8), torch.float32)
        raise AssertionError("view() of a released arena")
    except ValueError:
        pass
    arena.reallocate()
    z = arena.view(off, (8, 8), torch.float32)
    assert not z.any()
    z.fill_(2.0)
    refused(arena, "a tensor of the reallocated arena")
    assert z.sum().item() == 128.0
    del z
    arena.release()
    print("arena_test: OK")


if __name__ == "__main__":
    main()

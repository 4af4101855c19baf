"""Offload and onload with the Python client against the real ferryd
(docs/api.md, "Offload and onload"). The engine is a process of its own
(this file with --engine), so that its resident memory can be read from
/proc: one TP-1 instance of 4 tensors (192 MiB) in a SharedTensorArena,
three taken directly and one through its loader (a fallback tensor it
copies into its live tensor). After each COMMIT it prints a SHA-256 of its
live tensors, compared with one of the trainer's tensors of that version.

    1. offload with a host copy: the engine's RSS drops by >= 90% of the
       model's bytes; onload restores version 1 from ferryd's copy;
    2. offload without one; version 2 is published meanwhile and reported
       OFFLOADED; onload leaves the instance dirty (no copy, no peer);
       version 3 fills it;
    3. kill -9 of the engine while it answers ONLOAD: the onload ends
       ABORTED and dirty; a new engine process registers and version 4
       lands in it;
    4. an engine that keeps its tensors through on_offload: the client
       refuses to release the arena under them (the offload ends ABORTED,
       the reason naming the arena) and version 5 lands in them.

Usage: offload_test.py FERRYD_BINARY
"""

import hashlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import torch

import ferry
import ferryd_process

SHAPES = [(3072, 4096)] * 4  # float32: 4 x 48 MiB
NAMES = ["w%d" % i for i in range(len(SHAPES))]
MODEL_BYTES = sum(a * b * 4 for a, b in SHAPES)


def values(i, v):
    """Tensor i of version v, as the trainer holds it."""
    t = torch.arange(SHAPES[i][0] * SHAPES[i][1], dtype=torch.float32)
    return (t.remainder_(1021.0).add_(7 * i + 1000 * v)).view(SHAPES[i])


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------
# The engine process


def engine(sock, slow_file):
    keep_file = os.path.join(os.path.dirname(slow_file), "keep-tensors")
    conn = ferry.connect(sock)
    arena = ferry.SharedTensorArena("offload.engine", MODEL_BYTES + (1 << 20))
    offsets = [arena.allocate(a * b * 4) for a, b in SHAPES]
    state = {}

    def bind():
        state["live"] = [arena.view(o, s, torch.float32)
                         for o, s in zip(offsets, SHAPES)]

    bind()
    for t in state["live"]:
        t.zero_()
    del t  # a tensor left in a local would keep the arena from being released

    class Engine(ferry.EngineCallbacks):
        def on_apply(self, v, fallback):
            for name, tensor in fallback:  # the engine's own loader
                state["live"][NAMES.index(name)].copy_(tensor)

        def on_commit(self, v):
            print("COMMIT %d %s" % (v, digest(state["live"])), flush=True)

        def on_offload(self, region_ids, kept):
            if os.path.exists(keep_file):
                return  # an engine that keeps its tensors: refused
            state["live"] = None  # nothing views the arena any more

        def on_onload(self, region_ids):
            print("ONLOADING", flush=True)
            if os.path.exists(slow_file):
                time.sleep(30)  # killed here by the test
            bind()

    params = [ferry.EngineParam(n, t, ferry.REPLICATED, consumes=[n],
                                flags=[ferry.TRANSFORMED] if n == "w3" else [])
              for n, t in zip(NAMES, state["live"])]
    client = ferry.DestinationClient.register(conn, "e", "policy", 0, 1, arena,
                                              params, Engine())
    del params  # the client keeps no tensor; the engine's are in `state`
    print("READY %d" % os.getpid(), flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    client.close()


# ---------------------------------------------------------------------------
# The test


class Engine:
    def __init__(self, sock, slow_file):
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--engine", sock, slow_file],
            stdout=subprocess.PIPE, text=True)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        line = self.expect("READY", 60)
        self.pid = int(line.split()[1])

    def _read(self):
        for line in self.process.stdout:
            self.lines.put(line.strip())

    def expect(self, prefix, timeout_s=30):
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            assert left > 0, "the engine did not print %r" % prefix
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line.startswith(prefix):
                return line

    def rss(self):
        with open("/proc/%d/status" % self.pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS for pid %d" % self.pid)

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(20)


def main():
    ferryd = sys.argv[1]
    with ferryd_process.Ferryd(ferryd, "offload", "--lease_ms=3000",
                               "--ack_timeout_ms=20000",
                               "--version_timeout_ms=60000") as d:
        conn = ferry.connect(d.sock)
        src_arena = ferry.SharedTensorArena("offload.trainer", MODEL_BYTES + (1 << 20))
        trainer = [src_arena.tensor(s) for s in SHAPES]
        src = ferry.SourceClient.register(conn, "policy", 0, 1, src_arena,
                                          [(t, ferry.Shard(n, t.shape))
                                           for n, t in zip(NAMES, trainer)])
        d.clients.append(src)
        slow_file = os.path.join(d.dir, "slow-onload")
        eng = Engine(d.sock, slow_file)
        try:
            def publish(v):
                for i, t in enumerate(trainer):
                    t.copy_(values(i, v))
                return src.publish(v), digest(trainer)

            out, want = publish(1)
            assert out.all_committed(), out.summary()
            assert eng.expect("COMMIT 1") == "COMMIT 1 " + want

            # 1. With a host copy: the engine lets go of its memory.
            rss_before = eng.rss()
            st = conn.offload("e", keep_host_copy=True)
            assert st.state == ferry.types_pb2.INSTANCE_STATE_OFFLOADED, st
            rss_after = eng.rss()
            print("engine RSS %.0f MiB -> %.0f MiB (model %.0f MiB)" % (
                rss_before / 2**20, rss_after / 2**20, MODEL_BYTES / 2**20))
            assert rss_before - rss_after >= 0.9 * MODEL_BYTES, (rss_before, rss_after)
            info, = [i for i in conn.list_streams()[0].instances if i.instance_id == "e"]
            assert info.host_copy_bytes == src_arena.capacity, info
            assert info.host_copy_version == 1, info
            st = conn.onload("e")
            assert st.state == ferry.COMMITTED and st.committed_version == 1, st
            assert eng.expect("COMMIT 1") == "COMMIT 1 " + want  # from the copy

            # 2. Without one: a version published meanwhile, then dirty.
            st = conn.offload("e", keep_host_copy=False)
            assert st.state == ferry.types_pb2.INSTANCE_STATE_OFFLOADED, st
            assert eng.rss() <= rss_before - 0.9 * MODEL_BYTES
            out, _ = publish(2)
            o, = out.instances
            assert o.state == ferry.types_pb2.INSTANCE_STATE_OFFLOADED, o
            assert o.committed_version == 1, o
            st = conn.onload("e")
            assert st.state == ferry.ABORTED and st.dirty, st
            assert "no host copy was kept" in st.abort_reason, st
            out, want = publish(3)
            assert out.all_committed(), out.summary()
            assert eng.expect("COMMIT 3") == "COMMIT 3 " + want

            # 3. The engine dies while it answers ONLOAD.
            st = conn.offload("e", keep_host_copy=True)
            assert st.state == ferry.types_pb2.INSTANCE_STATE_OFFLOADED, st
            open(slow_file, "w").close()
            result = {}
            onload = threading.Thread(target=lambda: result.update(st=conn.onload("e")))
            onload.start()
            eng.expect("ONLOADING")
            os.kill(eng.pid, signal.SIGKILL)
            onload.join(60)
            st = result["st"]
            assert st.state == ferry.ABORTED and st.dirty, st
            assert "lost" in st.abort_reason, st
            os.unlink(slow_file)
            eng.process.wait(10)
            eng = Engine(d.sock, slow_file)  # a new process, base weights
            out, want = publish(4)
            assert out.all_committed(), out.summary()
            assert eng.expect("COMMIT 4") == "COMMIT 4 " + want

            # 4. An engine that keeps its tensors through on_offload: the
            # arena is not released under them (acked FAILED, naming it),
            # and they still hold version 4; version 5 lands in them.
            keep_file = os.path.join(d.dir, "keep-tensors")
            open(keep_file, "w").close()
            st = conn.offload("e", keep_host_copy=False)
            assert st.state == ferry.ABORTED, st
            assert "BufferError" in st.abort_reason, st
            shm, = re.findall(r"/ferry\.offload\.engine\.[^:]*", st.abort_reason)
            assert os.path.exists("/dev/shm" + shm), shm  # not unlinked
            os.unlink(keep_file)
            out, want = publish(5)
            assert out.all_committed(), out.summary()
            assert eng.expect("COMMIT 5") == "COMMIT 5 " + want
        finally:
            eng.stop()
    print("offload_test: OK")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        engine(sys.argv[2], sys.argv[3])
    else:
        main()

"""The Python clients register again by themselves when the daemon no
longer knows them, as the C++ clients do: ferryd is killed (SIGKILL) and a
new one started on the same socket; the engine's event stream breaks, it
subscribes again, learns that its handle is unknown, and registers again
holding the version it committed; the trainer's source does the same as
soon as its heartbeat finds the lease lost, before any begin(). The next
version then lands, every byte compared with the trainer's tensors.

Usage: reregister_test.py FERRYD_BINARY
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

import ferry


def start(ferryd, sock, log):
    return subprocess.Popen([ferryd, "--socket=" + sock, "--listen=", "--node=rereg",
                             "--lease_ms=3000", "--logtostderr"],
                            stdout=log, stderr=log)


def main():
    ferryd = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix="ferry-rereg-", dir="/tmp")
    sock = os.path.join(tmp, "ferryd.sock")
    log = open(os.path.join(tmp, "ferryd.log"), "w")
    daemon = start(ferryd, sock, log)
    clients = []
    ok = False
    try:
        conn = ferry.connect(sock)
        src_arena = ferry.SharedTensorArena("rereg.src", 1 << 20)
        w = src_arena.tensor((64, 64))
        src = ferry.SourceClient.register(conn, "policy", 0, 1, src_arena,
                                          [(w, ferry.Shard("w", (64, 64)))])
        clients.append(src)
        dst_arena = ferry.SharedTensorArena("rereg.dst", 1 << 20)
        live = dst_arena.tensor((64, 64))
        dst = ferry.DestinationClient.register(
            conn, "e", "policy", 0, 1, dst_arena,
            [ferry.EngineParam("w", live, ferry.REPLICATED)])
        clients.append(dst)
        w.copy_(torch.arange(64 * 64, dtype=torch.float32).view(64, 64))
        out = src.publish(1)
        assert out.all_committed(), out.summary()
        dst.wait_committed(1, 20)
        assert torch.equal(live, w)

        # The daemon dies and another takes its place: it knows no one.
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(10)
        daemon = start(ferryd, sock, log)
        conn.wait_for_ready(20)
        deadline = time.monotonic() + 30
        while dst.reregistrations == 0 or src.reregistrations == 0:
            assert time.monotonic() < deadline, (
                "not registered again: engine %d, source %d times"
                % (dst.reregistrations, src.reregistrations))
            time.sleep(0.05)
        assert dst.committed_version == 1
        w.mul_(-1)
        out = src.publish(2)  # on the registration made by the lease's loss
        assert src.reregistrations == 1
        assert out.all_committed() and len(out.instances) == 1, out.summary()
        dst.wait_committed(2, 20)
        assert torch.equal(live, w)
        ok = True
    finally:
        for c in reversed(clients):
            c.close()
        daemon.terminate()
        daemon.wait(10)
        log.close()
        if not ok:
            with open(os.path.join(tmp, "ferryd.log")) as f:
                sys.stderr.write("----- ferryd -----\n" + "".join(f.readlines()[-40:]))
        shutil.rmtree(tmp, ignore_errors=True)
    print("reregister_test: OK")


if __name__ == "__main__":
    main()

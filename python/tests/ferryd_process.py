"""A real ferryd for the Python tests: started on a unix socket in a fresh
directory with its log there; on leaving the `with` block the registered
clients are closed, ferryd gets SIGTERM and is waited for, the directory is
removed, and, if the block failed, the log's end is printed first.

    with ferryd_process.Ferryd(binary, "metrics", "--metrics_address=...") as d:
        conn = ferry.connect(d.sock)
        d.clients.append(ferry.SourceClient(conn, ...))

`prefix` runs ferryd under a command (["ip", "netns", "exec", ns]: in a
network namespace); flags given later win over the defaults here
(--listen=10.0.0.1:0).
"""

import os
import shutil
import subprocess
import sys
import tempfile


class Ferryd:
    def __init__(self, binary, node, *flags, prefix=()):
        self.dir = tempfile.mkdtemp(prefix="ferry-%s-" % node, dir="/tmp")
        self.sock = os.path.join(self.dir, "ferryd.sock")
        self.log_path = os.path.join(self.dir, "ferryd.log")
        self.clients = []
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                list(prefix) + [binary, "--socket=" + self.sock, "--listen=", "--node=" + node,
                 "--port_file=" + self.port_file(), "--logtostderr"] + list(flags), stdout=log, stderr=log)

    def port(self, timeout=20):
        """The TCP port ferryd bound (with --listen=HOST:0), from its
        --port_file."""
        import time
        end = time.time() + timeout
        while time.time() < end:
            try:
                with open(self.port_file()) as f:
                    text = f.read().strip()
                if text and int(text) > 0:
                    return int(text)
            except (OSError, ValueError):
                pass
            if self.process.poll() is not None:
                raise RuntimeError("ferryd exited: " + self.log()[-2000:])
            time.sleep(0.05)
        raise RuntimeError("ferryd wrote no port in %ss" % timeout)

    def port_file(self):
        return os.path.join(self.dir, "port")

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            for c in reversed(self.clients):
                c.close()
        finally:
            self.process.terminate()
            self.process.wait(10)
            if exc_type is not None:
                sys.stderr.write("----- ferryd (last 40 lines) -----\n" +
                                 "\n".join(self.log().splitlines()[-40:]) + "\n")
            shutil.rmtree(self.dir, ignore_errors=True)
        return False

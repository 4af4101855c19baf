"""A real ferryd for the Python tests: started on a unix socket in a fresh
directory with its log there; on leaving the `with` block the registered
clients are closed, ferryd gets SIGTERM and is waited for, the directory is
removed, and, if the block failed, the log's end is printed first.

    with ferryd_process.Ferryd(binary, "metrics", "--metrics_address=...") as d:
        conn = ferry.connect(d.sock)
        d.clients.append(ferry.SourceClient(conn, ...))
"""

import os
import shutil
import subprocess
import sys
import tempfile


class Ferryd:
    def __init__(self, binary, node, *flags):
        self.dir = tempfile.mkdtemp(prefix="ferry-%s-" % node, dir="/tmp")
        self.sock = os.path.join(self.dir, "ferryd.sock")
        self.log_path = os.path.join(self.dir, "ferryd.log")
        self.clients = []
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [binary, "--socket=" + self.sock, "--listen=", "--node=" + node,
                 "--logtostderr"] + list(flags), stdout=log, stderr=log)

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

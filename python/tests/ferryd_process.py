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

Daemons that talk to each other need mutual TLS: `Certs` makes a CA and a
certificate per node (deploy/make_certs.sh) and gives each node's flags.

    with ferryd_process.Certs({"a": "127.0.0.1", "b": "127.0.0.1"}) as certs:
        with ferryd_process.Ferryd(binary, "a", "--listen=127.0.0.1:0",
                                   *certs.flags("a")) as a:
"""

import os
import shutil
import subprocess
import sys
import tempfile


class Certs:
    """A CA and one certificate per node, for the address given (`nodes`:
    node name -> IP), in a temporary directory removed on leaving the
    `with` block (or by close())."""

    def __init__(self, nodes):
        self.dir = tempfile.mkdtemp(prefix="ferry-certs-")
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "..", "..", "deploy", "make_certs.sh")
        try:
            for node, ip in nodes.items():
                subprocess.run([script, self.dir, node, "IP:" + ip],
                               check=True, capture_output=True)
        except BaseException:
            self.close()
            raise

    def flags(self, node):
        """ferryd's mutual-TLS flags for `node`."""
        return ["--tls_cert=%s/%s.pem" % (self.dir, node),
                "--tls_key=%s/%s.key" % (self.dir, node),
                "--tls_ca=%s/ca.pem" % self.dir]

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


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

    def wait_joined(self, timeout=20):
        """A member: returns once it has joined its coordinator (GetHealth
        lists the coordinator as a reachable peer); clients registering
        before that are told UNAVAILABLE, retry."""
        import time
        import grpc
        from ferry.v1 import inspection_pb2, inspection_pb2_grpc
        end = time.time() + timeout
        with grpc.insecure_channel("unix:" + self.sock) as channel:
            stub = inspection_pb2_grpc.InspectionStub(channel)
            while time.time() < end:
                try:
                    h = stub.GetHealth(inspection_pb2.GetHealthRequest(), timeout=2)
                    if h.coordinator_node and any(p.reachable for p in h.peers):
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        raise RuntimeError("ferryd %s did not join its coordinator in %ss: %s"
                           % (self.sock, timeout, self.log()[-2000:]))

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

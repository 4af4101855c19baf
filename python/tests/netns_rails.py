"""Rails made real on one machine: two network namespaces, A and B, joined
by a control link (unshaped, for gRPC between the daemons) and `rails`
veth pairs, each shaped with tc's token bucket filter to `mbit` Mbit/s in
both directions and addressed in its own subnet:

    control  A 10.77.0.1/24  <->  B 10.77.0.2/24   (cA <-> cB)
    rail i   A 10.77.i+1.1   <->  B 10.77.i+1.2    (rA<i> <-> rB<i>)

so rail i of A reaches only rail i of B. Needs root, `ip` and `tc`.

    with RailNet(rails=4, mbit=200) as net:
        subprocess.run(net.run("a") + ["ferryd", ...])
        net.tx_bytes("a", 2); net.set_rail("b", 2, up=False)

The namespaces (and with them every link) are removed on leaving the
block. `unavailable()` says why they cannot be made here ("" when they can).
"""

import json
import os
import subprocess
import uuid

# ip and tc live in /usr/sbin, which a test's PATH may lack.
os.environ["PATH"] = os.environ.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"


def _ip(*args, check=True):
    return subprocess.run(["ip"] + list(args), check=check,
                          capture_output=True, text=True)


def unavailable():
    """Why namespaces with shaped links cannot be made here, or ""."""
    if os.geteuid() != 0:
        return "not root (network namespaces and tc need CAP_NET_ADMIN)"
    name = "ferry-probe-" + uuid.uuid4().hex[:8]
    try:
        r = _ip("netns", "add", name, check=False)
        if r.returncode != 0:
            return "ip netns add failed: " + r.stderr.strip()
        r = _ip("-n", name, "link", "add", "p0", "type", "veth", "peer",
                "name", "p1", check=False)
        if r.returncode != 0:
            return "no veth pairs: " + r.stderr.strip()
        r = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add",
                            "dev", "p0", "root", "tbf", "rate", "100mbit",
                            "burst", "256kb", "latency", "50ms"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return "no tc tbf: " + r.stderr.strip()
        return ""
    except FileNotFoundError as e:
        return "missing tool: %s" % e
    finally:
        _ip("netns", "del", name, check=False)


class RailNet:
    def __init__(self, rails, mbit):
        self.rails = rails
        self.mbit = mbit
        tag = uuid.uuid4().hex[:6]
        self.ns = {"a": "ferry-a-" + tag, "b": "ferry-b-" + tag}
        self.certs = None

    def __enter__(self):
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        for ns in self.ns.values():
            _ip("netns", "del", ns, check=False)
        if self.certs is not None:
            self.certs.close()

    def _build(self):
        a, b = self.ns["a"], self.ns["b"]
        for ns in (a, b):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        links = [("cA", "cB", "10.77.0", False)]
        links += [("rA%d" % i, "rB%d" % i, "10.77.%d" % (i + 1), True)
                  for i in range(self.rails)]
        for ea, eb, net, shaped in links:
            _ip("-n", a, "link", "add", ea, "type", "veth", "peer", "name", eb,
                "netns", b)
            for ns, dev, host in ((a, ea, 1), (b, eb, 2)):
                _ip("-n", ns, "addr", "add", "%s.%d/24" % (net, host), "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                if shaped:
                    subprocess.run(self.run_in(ns) + [
                        "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                        "%dmbit" % self.mbit, "burst", "256kb", "latency", "100ms"],
                        check=True, capture_output=True)

    @staticmethod
    def run_in(ns):
        return ["ip", "netns", "exec", ns]

    def run(self, side):
        """The command prefix that runs a program in side "a" or "b"."""
        return self.run_in(self.ns[side])

    def control(self, side):
        return "10.77.0.%d" % (1 if side == "a" else 2)

    def rail_device(self, side, i):
        return ("rA%d" if side == "a" else "rB%d") % i

    def rail_devices(self, side, count=None):
        return ",".join(self.rail_device(side, i)
                        for i in range(self.rails if count is None else count))

    def tx_bytes(self, side, i):
        """Bytes rail i's device on `side` has sent (the kernel's count)."""
        out = _ip("-n", self.ns[side], "-j", "-s", "link", "show", "dev",
                  self.rail_device(side, i)).stdout
        return json.loads(out)[0]["stats64"]["tx"]["bytes"]

    def ferryd(self, binary, side, flags, coordinator=None, rails=None):
        """A ferryd_process.Ferryd named `side` in that namespace, listening
        on its control address with mutual TLS (certificates made once per
        net with deploy/make_certs.sh), its rails the first `rails` (all:
        None); a member of `coordinator` (side "a"'s Ferryd) if given."""
        import ferryd_process
        if self.certs is None:
            self.certs = ferryd_process.Certs(
                {s: self.control(s) for s in ("a", "b")})
        flags = ["--listen=%s:0" % self.control(side),
                 "--rails=" + self.rail_devices(side, rails)] + \
            self.certs.flags(side) + list(flags)
        if coordinator is not None:
            flags.append("--coordinator=%s:%d" % (self.control("a"),
                                                  coordinator.port()))
        return ferryd_process.Ferryd(binary, side, *flags, prefix=self.run(side))

    def set_rate(self, side, i, mbit):
        """Reshapes rail i's device on `side` to `mbit` Mbit/s."""
        subprocess.run(self.run(side) + [
            "tc", "qdisc", "change", "dev", self.rail_device(side, i), "root",
            "tbf", "rate", "%dmbit" % mbit, "burst", "256kb", "latency",
            "100ms"], check=True, capture_output=True)

    def set_rail(self, side, i, up):
        _ip("-n", self.ns[side], "link", "set", self.rail_device(side, i),
            "up" if up else "down")

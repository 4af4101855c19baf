"""End to end, no fakes: the real ferryd, a TP-2 PyTorch trainer (2
processes, gloo) and two engine instances, "tp2" (2 processes, gloo, fused
qkv_proj/gate_up_proj) and "tp1" (1 process). Checks, per version, that both
instances' logits on a fixed prompt batch equal the trainer's (fp32, max abs
difference <= 1e-5) and that both report that version.

Run 1: --versions versions, every one committed by both instances.
Run 2: tp2's rank 1 is SIGKILLed in APPLY of version --kill_version: tp2
must end ABORTED (dirty) and its surviving rank must refuse to serve, tp1
commits; the rank restarts, re-registers (replace_existing) and tp2 catches
up on the next version.
Run 3: a TP-1 engine "late" joins after version 1 committed, while the
trainer goes on; ferry bootstraps it from the running tp2 instance (never
from the trainer), and its logits match the trainer's at every version it
serves, the first of which it did not get from the trainer.

Run 4: the trainer saves its model after version 1 as a safetensors file
and goes on to version 2; with the trainer gone, ferry_load publishes the
file as version 3 into the running tp2 engines (an RL team resetting
engines to a saved step): their logits equal the trainer's at version 1,
not at version 2.

Run 5 (LoRA, docs/api.md "LoRA adapters"): the TP-2 trainer freezes the
base model, publishes it once, and trains a LoRA adapter on q_proj and
v_proj, published after every step as a version of its own stream
"policy-lora". The controller (this script) loads it on tp2 and tp1 under
the name "sql" before its first version; after every step both instances'
logits with the adapter equal the trainer's (max abs difference <= 1e-5)
and their logits without it still equal the base model's. Meanwhile a
second adapter "b" (a stream this script publishes, world 1) is loaded on
tp2, its shares checked against vLLM's slicing of the tensors published
(lora_A whole, lora_B the rank's rows), updated in place to another
configuration and unloaded; "sql" goes on undisturbed.

With --device=cuda every trainer and engine rank keeps its weights in CUDA
tensors on one GPU (the processes share it), registered as they are; the
TP groups stay on gloo (collectives through host memory).

Usage: run_e2e.py --ferryd PATH [--ferry_load PATH] [--versions 4]
                  [--kill_versions 3] [--kill_version 2] [--lora_versions 4]
                  [--only normal|kill|late|checkpoint|lora] [--device cpu|cuda]
Exit status 0 when every check passed.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-5


class Run:
    def __init__(self, name, ferryd):
        self.name = name
        self.dir = tempfile.mkdtemp(prefix="ferry-tp-%s-" % name, dir="/tmp")
        self.sock = os.path.join(self.dir, "ferryd.sock")
        self.procs = {}
        self.pids = set()
        self.logs = []
        self.daemon = self.spawn("ferryd", [
            ferryd, "--socket=" + self.sock, "--listen=", "--node=tp-sync",
            "--lease_ms=3000", "--ack_timeout_ms=20000", "--version_timeout_ms=60000",
            "--logtostderr"], python=False)

    def spawn(self, name, argv, python=True):
        log = open(os.path.join(self.dir, name + ".log"), "w")
        self.logs.append((name, log.name))
        cmd = ([sys.executable] + argv) if python else argv
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = p
        self.pids.add(str(p.pid))
        return p

    def engine(self, name, instance, tp, rank, last, extra=()):
        return self.spawn(name, [os.path.join(HERE, "engine.py"), "--instance", instance,
                                 "--tp", str(tp), "--rank", str(rank), "--daemon", self.sock,
                                 "--dir", self.dir, "--last_version", str(last)] + list(extra))

    def trainers(self, versions):
        for r in range(2):
            self.spawn("trainer.%d" % r, [os.path.join(HERE, "trainer.py"), "--rank", str(r),
                                          "--world", "2", "--daemon", self.sock, "--dir",
                                          self.dir, "--versions", str(versions)])

    def wait_file(self, path, timeout_s):
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path):
            self.check_alive()
            if time.monotonic() > deadline:
                raise AssertionError("%s: %s did not appear within %d s" % (
                    self.name, os.path.basename(path), timeout_s))
            time.sleep(0.02)

    def check_alive(self):
        for n, p in self.procs.items():
            if n != "ferryd" and p.poll() not in (None, 0):
                raise AssertionError("%s: %s exited with %s" % (self.name, n, p.returncode))

    def wait_all(self, timeout_s):
        deadline = time.monotonic() + timeout_s
        for n, p in self.procs.items():
            if n == "ferryd":
                continue
            try:
                rc = p.wait(max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                raise AssertionError("%s: %s still running after %d s" % (self.name, n, timeout_s))
            if rc != 0:
                raise AssertionError("%s: %s exited with %d" % (self.name, n, rc))

    def explain(self, instances):
        import ferry
        conn = ferry.connect(self.sock)
        conn.wait_instances("policy", instances, timeout_s=60, sources=True)
        for inst in instances:
            plan = conn.explain_plan(inst)
            bad = [(p.name, p.tp_rank, p.reason) for p in plan.parameters
                   if p.resolution not in (ferry.inspection_pb2.RESOLUTION_DIRECT,
                                           ferry.inspection_pb2.RESOLUTION_FUSED)]
            assert not bad, "%s: not direct: %s" % (inst, bad)
            assert not plan.gaps, "%s: coverage gaps %s" % (inst, plan.gaps)
            fused = sum(p.resolution == ferry.inspection_pb2.RESOLUTION_FUSED
                        for p in plan.parameters)
            print("  %s: %d engine parameters direct/fused (%d fused), %d bytes per "
                  "version, plan %s" % (inst, len(plan.parameters), fused,
                                        plan.totals.total_bytes, plan.plan_digest[:12]))
        conn.close()

    def compare(self, instance, v):
        import torch
        want = torch.load(os.path.join(self.dir, "trainer.v%d.pt" % v))
        rep = torch.load(os.path.join(self.dir, "report.%s.v%d.pt" % (instance, v)))
        diff = (rep["logits"] - want).abs().max().item()
        assert rep["version"] == v and rep["committed_version"] == v, (instance, v, rep["version"], rep["committed_version"])
        assert diff <= TOL, "%s: version %d logits differ from the trainer's by %.3g" % (
            instance, v, diff)
        return diff

    def check_training(self, versions):
        """Every version really changed the weights (else matching is moot)."""
        import torch
        prev = torch.load(os.path.join(self.dir, "trainer.v0.pt"))
        for v in range(1, versions + 1):
            cur = torch.load(os.path.join(self.dir, "trainer.v%d.pt" % v))
            assert (cur - prev).abs().max().item() > 1e-3, "version %d changed nothing" % v
            prev = cur

    def outcome(self, v):
        with open(os.path.join(self.dir, "outcome.v%d.json" % v)) as fh:
            return json.load(fh)

    def close(self, ok):
        for n, p in self.procs.items():
            if n != "ferryd" and p.poll() is None:
                p.kill()
                p.wait()
        # Shared memory of processes that could not unlink theirs (SIGKILL).
        for name in os.listdir("/dev/shm"):
            parts = name.split(".")
            if name.startswith("ferry.") and len(parts) > 2 and parts[-2] in self.pids:
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass
        self.daemon.send_signal(signal.SIGTERM)
        try:
            self.daemon.wait(15)
        except subprocess.TimeoutExpired:
            self.daemon.kill()
            self.daemon.wait()
        if not ok:
            for n, path in self.logs:
                with open(path) as fh:
                    text = fh.read()
                print("----- %s (last 60 lines) -----" % n)
                print("\n".join(text.splitlines()[-60:]))
        if os.environ.get("FERRY_E2E_KEEP"):
            print("  kept %s" % self.dir)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


def run_normal(ferryd, versions):
    t0 = time.monotonic()
    run = Run("normal", ferryd)
    ok = False
    try:
        run.engine("tp2.0", "tp2", 2, 0, versions)
        run.engine("tp2.1", "tp2", 2, 1, versions)
        run.engine("tp1.0", "tp1", 1, 0, versions)
        run.trainers(versions)
        run.explain(["tp1", "tp2"])
        run.wait_all(120)
        run.check_training(versions)
        worst = 0.0
        for v in range(0, versions + 1):
            if v > 0:
                out = run.outcome(v)
                assert all(s["state"] == "INSTANCE_STATE_COMMITTED" and s["committed_version"] == v
                           for s in out.values()) and sorted(out) == ["tp1", "tp2"], out
            worst = max(worst, run.compare("tp1", v), run.compare("tp2", v))
        print("normal run: versions 0..%d, both instances match the trainer "
              "(max |diff| %.2g) in %.1f s" % (versions, worst, time.monotonic() - t0))
        ok = True
    finally:
        run.close(ok)


def run_kill(ferryd, versions, kill_v):
    t0 = time.monotonic()
    run = Run("kill", ferryd)
    ok = False
    try:
        run.engine("tp2.0", "tp2", 2, 0, versions)
        victim = run.engine("tp2.1", "tp2", 2, 1, versions, ["--hang_in_apply", str(kill_v)])
        run.engine("tp1.0", "tp1", 1, 0, versions)
        run.trainers(versions)
        run.wait_file(os.path.join(run.dir, "hanging.tp2.1"), 90)
        victim.send_signal(signal.SIGKILL)
        victim.wait()  # reaped: the daemon sees the pid gone
        del run.procs["tp2.1"]
        print("  killed tp2 rank 1 (pid %d) in APPLY of version %d" % (victim.pid, kill_v))
        # The survivor saw a dirty abort; only then restart the rank.
        run.wait_file(os.path.join(run.dir, "dirty.tp2.0.v%d.json" % kill_v), 60)
        run.engine("tp2.1.restarted", "tp2", 2, 1, versions, ["--replace", "--gen", "2"])
        run.wait_all(120)
        out = run.outcome(kill_v)
        assert out["tp1"]["state"] == "INSTANCE_STATE_COMMITTED", out
        assert out["tp2"]["state"] == "INSTANCE_STATE_ABORTED" and out["tp2"]["dirty"], out
        assert out["tp2"]["committed_version"] == kill_v - 1, out
        with open(os.path.join(run.dir, "dirty.tp2.0.v%d.json" % kill_v)) as fh:
            dirty = json.load(fh)
        assert dirty["refused"], "tp2 rank 0 served a half-written model: %s" % dirty
        assert dirty["committed_version"] == kill_v - 1, dirty
        assert not os.path.exists(os.path.join(run.dir, "report.tp2.v%d.pt" % kill_v)), \
            "tp2 served version %d" % kill_v
        print("  version %d: tp1 committed, tp2 aborted dirty (%s); tp2 rank 0 refused "
              "to serve" % (kill_v, out["tp2"]["reason"]))
        worst = 0.0
        for v in range(0, versions + 1):
            worst = max(worst, run.compare("tp1", v))
            if v != kill_v:
                if v > 0:
                    out = run.outcome(v)
                    assert all(s["state"] == "INSTANCE_STATE_COMMITTED" for s in out.values()), out
                worst = max(worst, run.compare("tp2", v))
        print("kill run: tp2 caught up at version %d after the restart; logits match "
              "(max |diff| %.2g) in %.1f s" % (kill_v + 1, worst, time.monotonic() - t0))
        ok = True
    finally:
        run.close(ok)


def run_late(ferryd, versions):
    t0 = time.monotonic()
    run = Run("late", ferryd)
    ok = False
    try:
        done = os.path.join(run.dir, "late.done")
        for r in range(2):
            run.engine("tp2.%d" % r, "tp2", 2, r, versions, ["--linger_until", done])
        # The trainer holds after version 1 until the late engine served
        # it: the late engine joins between versions, never as one begins
        # (it would then take that version from the trainer, not a peer).
        for r in range(2):
            run.spawn("trainer.%d" % r, [os.path.join(HERE, "trainer.py"), "--rank", str(r),
                                         "--world", "2", "--daemon", run.sock, "--dir",
                                         run.dir, "--versions", str(versions),
                                         "--instances", "tp2", "--hold_after", "1",
                                         "--hold_until",
                                         os.path.join(run.dir, "report.late.v1.pt")])
        run.wait_file(os.path.join(run.dir, "outcome.v1.json"), 120)
        late = run.engine("late.0", "late", 1, 0, versions, ["--late"])
        # The late engine exits after serving the last version; then the
        # peers may go.
        rc = late.wait(180)
        assert rc == 0, "late engine exited with %d" % rc
        import ferry
        conn = ferry.connect(run.sock)  # tp2 lingers: the stream is still there
        info = [s for s in conn.list_streams() if s.name == "policy"][0]
        open(done, "w").close()
        d = info.delivery
        assert (d.kind, d.instance_id, d.peer_instance_id) == ("bootstrap", "late", "tp2"), d
        assert d.status.state == ferry.COMMITTED and d.bytes_moved == d.bytes_total > 0, d
        first = d.version
        conn.close()
        run.wait_all(120)
        outcome = run.outcome(first)
        assert "late" not in outcome, (
            "version %d reached late from the trainer, not a peer: %s" % (first, outcome))
        worst = 0.0
        for v in range(first, versions + 1):
            worst = max(worst, run.compare("late", v), run.compare("tp2", v))
        print("late run: late joined, was bootstrapped from tp2 at version %d "
              "(%d bytes in %d ms), then followed to version %d; logits match "
              "(max |diff| %.2g) in %.1f s" % (first, d.bytes_total, d.elapsed_ms,
                                               versions, worst, time.monotonic() - t0))
        ok = True
    finally:
        run.close(ok)


def run_checkpoint(ferryd, ferry_load):
    t0 = time.monotonic()
    run = Run("checkpoint", ferryd)
    ok = False
    try:
        ckpt = os.path.join(run.dir, "step1.safetensors")
        for r in range(2):
            run.engine("tp2.%d" % r, "tp2", 2, r, 3)
        for r in range(2):
            run.spawn("trainer.%d" % r, [os.path.join(HERE, "trainer.py"), "--rank", str(r),
                                         "--world", "2", "--daemon", run.sock, "--dir",
                                         run.dir, "--versions", "2", "--instances", "tp2",
                                         "--save_checkpoint", ckpt, "--save_after", "1"])
        for r in range(2):  # the trainer is done (and deregistered)
            p = run.procs["trainer.%d" % r]
            rc = p.wait(120)
            assert rc == 0, "trainer %d exited with %d" % (r, rc)
        assert os.path.exists(ckpt), "the trainer wrote no checkpoint"
        out = subprocess.run([ferry_load, "--file=" + ckpt, "--stream=policy",
                              "--publish_version=3", "--daemon=unix:" + run.sock],
                             capture_output=True, text=True, timeout=120)
        print("  " + (out.stdout + out.stderr).strip())
        assert out.returncode == 0, "ferry_load exited with %d" % out.returncode
        run.wait_all(120)
        import torch
        step1 = torch.load(os.path.join(run.dir, "trainer.v1.pt"))
        step2 = torch.load(os.path.join(run.dir, "trainer.v2.pt"))
        rep = torch.load(os.path.join(run.dir, "report.tp2.v3.pt"))
        assert rep["version"] == 3 and rep["committed_version"] == 3, rep["version"]
        diff1 = (rep["logits"] - step1).abs().max().item()
        diff2 = (rep["logits"] - step2).abs().max().item()
        assert diff1 <= TOL, "version 3 (the step-1 checkpoint) differs from the " \
            "trainer's step-1 logits by %.3g" % diff1
        assert diff2 > 1e-3, "version 3 still serves step 2 (|diff| %.3g)" % diff2
        print("checkpoint run: the step-1 safetensors file published as version 3 "
              "into tp2; logits match step 1 (max |diff| %.2g), not step 2 (%.2g), "
              "in %.1f s" % (diff1, diff2, time.monotonic() - t0))
        ok = True
    finally:
        run.close(ok)


def second_adapter(run):
    """Adapter "b" on tp2 while "sql" trains: its own stream (world 1, this
    process), loaded before its first version, shares checked against the
    tensors published, updated to another configuration, unloaded."""
    import torch
    import ferry
    sys.path.insert(0, HERE)
    import model as M
    conn = ferry.connect(run.sock)
    g = torch.Generator().manual_seed(11)
    full = {n: torch.randn(s, generator=g) for n, s in M.lora_shapes().items()}
    arena = ferry.SharedTensorArena("lora-b", sum(4 * t.numel() for t in full.values())
                                    + (1 << 16))
    params = []
    for n, t in full.items():
        local = arena.tensor(t.shape)
        local.copy_(t)
        params.append((local, ferry.Shard(n, tuple(t.shape))))
    src = ferry.SourceClient.register(conn, "policy-lora-b", 0, 1, arena, params)
    cfg1 = json.dumps({"r": M.LORA["r"], "lora_alpha": 8,
                       "target_modules": ["q_proj", "v_proj"]})
    cfg2 = json.dumps({"r": M.LORA["r"], "lora_alpha": 32,
                       "target_modules": ["q_proj", "v_proj"]})
    st = conn.load_adapter("tp2", "b", "policy-lora-b", cfg1)
    assert st.state == ferry.types_pb2.INSTANCE_STATE_IDLE, st
    out = src.publish(1)
    assert [s.state for s in out.instances] == [ferry.COMMITTED], out.summary()

    def check_shares(cfg):
        for rank in range(2):
            path = os.path.join(run.dir, "adapter.tp2.%d.b.pt" % rank)
            deadline = time.monotonic() + 30
            while True:
                got = torch.load(path) if os.path.exists(path) else None
                if got is not None and got["config"] == json.loads(cfg):
                    break
                assert time.monotonic() < deadline, "tp2 rank %d: no adapter b with %s" % (
                    rank, cfg)
                time.sleep(0.05)
            assert len(got["shares"]) == len(full), sorted(got["shares"])
            for key, (tensor, share) in got["shares"].items():
                layer, module, ab = key.split(".")
                name = "base_model.model.model.layers.%s.self_attn.%s.lora_%s.weight" % (
                    layer, module, ab)
                # vLLM's slicing: lora_A whole, lora_B the rank's rows of the
                # column-parallel output (q rows; v: the rank's kv head).
                want = full[name] if ab == "A" else full[name].chunk(2, 0)[rank]
                assert torch.equal(tensor, want), (rank, name, share)
                if ab == "B":
                    assert share == ((rank * want.shape[0], 0), tuple(want.shape)), share
    check_shares(cfg1)
    st = conn.update_adapter("tp2", "b", adapter_config_json=cfg2)
    assert st.state == ferry.COMMITTED and st.committed_version == 1, st
    check_shares(cfg2)
    conn.unload_adapter("tp2", "b")
    for rank in range(2):
        assert os.path.exists(os.path.join(run.dir, "adapter.tp2.%d.b.unloaded" % rank))
    names = [a.name for a in conn.wait_instances("policy", ["tp2"])[0].adapters]
    assert names == ["sql"], names
    src.close()
    arena.close()
    conn.close()


def run_lora(ferryd, versions):
    t0 = time.monotonic()
    run = Run("lora", ferryd)
    ok = False
    try:
        import ferry
        import torch
        for name, inst, tp, rank in (("tp2.0", "tp2", 2, 0), ("tp2.1", "tp2", 2, 1),
                                     ("tp1.0", "tp1", 1, 0)):
            run.engine(name, inst, tp, rank, 1, ["--lora_versions", str(versions)])
        for r in range(2):
            run.spawn("trainer.%d" % r, [os.path.join(HERE, "lora_trainer.py"), "--rank",
                                         str(r), "--world", "2", "--daemon", run.sock,
                                         "--dir", run.dir, "--versions", str(versions)])
        run.wait_file(os.path.join(run.dir, "lora-registered"), 120)
        conn = ferry.connect(run.sock)
        import model as M
        for inst in ("tp2", "tp1"):
            st = conn.load_adapter(inst, "sql", "policy-lora", M.lora_config_json())
            assert st.state == ferry.types_pb2.INSTANCE_STATE_IDLE, st
        open(os.path.join(run.dir, "adapters-loaded"), "w").close()
        run.wait_file(os.path.join(run.dir, "report.tp2.lora.v2.pt"), 120)
        second_adapter(run)
        open(os.path.join(run.dir, "b-done"), "w").close()
        run.wait_all(180)
        conn.close()
        base = torch.load(os.path.join(run.dir, "trainer.base.pt"))
        worst, moved, prev = 0.0, 0.0, base
        for v in range(1, versions + 1):
            want = torch.load(os.path.join(run.dir, "trainer.lora.v%d.pt" % v))
            moved = max(moved, (want - prev).abs().max().item())
            prev = want
            with open(os.path.join(run.dir, "lora-outcome.v%d.json" % v)) as fh:
                out = json.load(fh)
            assert sorted(out) == ["tp1", "tp2"] and all(
                x == "INSTANCE_STATE_COMMITTED" for x in out.values()), out
            for inst in ("tp2", "tp1"):
                rep = torch.load(os.path.join(run.dir, "report.%s.lora.v%d.pt" % (inst, v)))
                diff = (rep["lora"] - want).abs().max().item()
                assert diff <= TOL, "%s: adapter version %d logits differ from the " \
                    "trainer's by %.3g" % (inst, v, diff)
                base_diff = (rep["base"] - base).abs().max().item()
                assert base_diff <= TOL, "%s: without the adapter at version %d the " \
                    "logits differ from the base model's by %.3g" % (inst, v, base_diff)
                worst = max(worst, diff, base_diff)
        assert moved > 1e-3, "the adapter changed nothing (max |diff| %.3g)" % moved
        print("lora run: adapter versions 1..%d on tp2 and tp1 match the trainer, "
              "the base without it unchanged (max |diff| %.2g); a second adapter "
              "loaded, checked, updated and unloaded on tp2; in %.1f s"
              % (versions, worst, time.monotonic() - t0))
        ok = True
    finally:
        run.close(ok)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferryd", required=True)
    ap.add_argument("--ferry_load", default="",
                    help="//tools:ferry_load (the checkpoint run needs it)")
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--kill_versions", type=int, default=3)
    ap.add_argument("--kill_version", type=int, default=2)
    ap.add_argument("--late_versions", type=int, default=3)
    ap.add_argument("--lora_versions", type=int, default=4)
    ap.add_argument("--only", choices=["normal", "kill", "late", "checkpoint", "lora"])
    ap.add_argument("--device", default="cpu",
                    help="cpu, or cuda[:N]: every trainer and engine rank keeps its "
                    "weights in CUDA tensors on that GPU (the ranks share it)")
    args = ap.parse_args()
    assert args.kill_version < args.kill_versions
    # Every rank this script starts reads it (their --device default).
    os.environ["FERRY_EXAMPLE_DEVICE"] = args.device
    # The checkout's python/ when its ferry package has the generated stubs
    # (Bazel's runfiles); else the installed ferry wheel.
    python_dir = os.path.join(os.path.dirname(os.path.dirname(HERE)), "python")
    if os.path.exists(os.path.join(python_dir, "ferry", "v1", "types_pb2.py")):
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [python_dir] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                            if p])
        sys.path.insert(0, python_dir)
    sys.path.insert(0, HERE)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.only in (None, "normal"):
        run_normal(args.ferryd, args.versions)
    if args.only in (None, "kill"):
        run_kill(args.ferryd, args.kill_versions, args.kill_version)
    if args.only in (None, "late"):
        run_late(args.ferryd, args.late_versions)
    if args.only in (None, "checkpoint"):
        assert args.ferry_load, "the checkpoint run needs --ferry_load"
        run_checkpoint(args.ferryd, os.path.abspath(args.ferry_load))
    if args.only in (None, "lora"):
        run_lora(args.ferryd, args.lora_versions)
    print("PASSED")


if __name__ == "__main__":
    main()

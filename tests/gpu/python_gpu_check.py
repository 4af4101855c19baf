"""The Python client on a GPU, against the real ferryd (tests/gpu/device_check.sh
runs it with the machine's own python3 and the installed ferry wheel).

1. Correctness: a TP-2 trainer (two source ranks) and a TP-2 engine
   instance, every tensor a CUDA tensor, no arena. The engine fuses
   qkv_proj (direct into its live tensor) and loads lm_head itself (CUSTOM:
   a fallback tensor, staged by ferryd on the engine's GPU and handed to
   on_apply as a CUDA tensor). Three versions of random weights; after each
   every live engine byte equals the trainer's full tensors (the oracle,
   concatenated from the trainer's shards here), and lm_head as the loader
   took it too.
2. Offload and onload: the instance gives its GPU memory back and is
   refilled from ferryd's host copy into fresh allocations (new CUDA IPC
   handles, registered again); the next version lands in them.
3. Refusals: a tensor in PyTorch expandable_segments memory (when this
   torch can switch to it) and a freed tensor are refused naming the
   tensor.
4. The measured figure: a same-node update of the 1.6 GiB demo model
   (Llama-3.1-8B scaled to 6 layers, hidden 2048: 1.73 GB of bf16) from a
   Python source rank into a Python engine rank with fused qkv/gate_up,
   begin to committed, against torch's copy_ (cudaMemcpy device to device)
   of the same bytes in the same run. Target: at least 0.7x.

Usage: python_gpu_check.py FERRYD_BINARY [--versions=N]
Prints "python gpu check: PASS ..." lines and one "bench ..." line; exits
non-zero on any failure, 0 with "SKIPPED: no GPU" where torch sees none.
"""

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import ferry
import ferry.cuda


def start_ferryd(binary, tmp, extra=()):
    sock = os.path.join(tmp, "ferryd.sock")
    log = open(os.path.join(tmp, "ferryd.log"), "w")
    proc = subprocess.Popen([binary, "--socket=" + sock, "--node=gpu-node",
                             "--lease_ms=20000"] + list(extra),
                            stdout=log, stderr=subprocess.STDOUT)
    conn = ferry.connect(sock, timeout_s=30)
    return proc, conn, sock


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


# ---------------------------------------------------------------------------
# 1 and 2: correctness, offload/onload

H, Q, KV, V = 256, 256, 128, 1024   # hidden, q rows, k/v rows, vocab
TP = 2


def full_tensors(gen):
    return {
        "q": torch.randn(Q, H, generator=gen).to(torch.bfloat16),
        "k": torch.randn(KV, H, generator=gen).to(torch.bfloat16),
        "v": torch.randn(KV, H, generator=gen).to(torch.bfloat16),
        "norm": torch.randn(H, generator=gen).to(torch.bfloat16),
        "lm_head": torch.randn(V, H, generator=gen).to(torch.bfloat16),
    }


class Trainer:
    """TP-2 Megatron-style ranks: q, k, v and lm_head split by rows, norm
    replicated. Tensors live on cuda:0 (one process, both ranks)."""

    def __init__(self, conn, dev):
        self.dev = dev
        self.local = []
        self.clients = []
        for r in range(TP):
            t = {n: torch.zeros(s, dtype=torch.bfloat16, device=dev)
                 for n, s in (("q", (Q // TP, H)), ("k", (KV // TP, H)),
                              ("v", (KV // TP, H)), ("norm", (H,)),
                              ("lm_head", (V // TP, H)))}
            params = [(t["q"], ferry.Shard("q", (Q, H), dim=0, rank=r, world=TP)),
                      (t["k"], ferry.Shard("k", (KV, H), dim=0, rank=r, world=TP)),
                      (t["v"], ferry.Shard("v", (KV, H), dim=0, rank=r, world=TP)),
                      (t["norm"], ferry.Shard("norm", (H,))),
                      (t["lm_head"], ferry.Shard("lm_head", (V, H), dim=0,
                                                 rank=r, world=TP))]
            self.local.append(t)
            self.clients.append(ferry.SourceClient.register(
                conn, "policy", r, TP, None, params))

    def write(self, full):
        for r, t in enumerate(self.local):
            for n in ("q", "k", "v", "lm_head"):
                rows = full[n].shape[0] // TP
                t[n].copy_(full[n][r * rows:(r + 1) * rows])
            t["norm"].copy_(full["norm"])
        torch.cuda.synchronize(self.dev)

    def publish(self, v):
        for c in self.clients:
            c.begin(v)
        outcomes = [None] * TP
        import threading
        threads = [threading.Thread(target=lambda i=i: outcomes.__setitem__(
            i, self.clients[i].commit(v))) for i in range(TP)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return outcomes[0]


class EngineRank(ferry.EngineCallbacks):
    """vLLM-style: fused qkv_proj, replicated norm, lm_head loaded by the
    engine's own loader from ferryd's (device) staging."""

    def __init__(self, r, dev):
        self.r, self.dev = r, dev
        self.alloc()
        self.staging_devices = []
        self.applied = 0

    def alloc(self):
        rows = Q // TP + 2 * (KV // TP)
        self.qkv = torch.zeros(rows, H, dtype=torch.bfloat16, device=self.dev)
        self.norm = torch.zeros(H, dtype=torch.bfloat16, device=self.dev)
        self.lm_head = torch.zeros(V // TP, H, dtype=torch.bfloat16, device=self.dev)

    def table(self):
        return [ferry.EngineParam("qkv_proj", self.qkv, ferry.FUSED, shard_dim=0,
                                  fused_parts=["q", "k", "v"]),
                ferry.EngineParam("norm", self.norm, ferry.REPLICATED),
                ferry.EngineParam("lm_head", self.lm_head, ferry.CUSTOM,
                                  consumes=["lm_head"])]

    def on_apply(self, version, fallback):
        for name, t in fallback:
            assert name == "lm_head", name
            self.staging_devices.append(str(t.device))
            rows = V // TP
            self.lm_head.copy_(t[self.r * rows:(self.r + 1) * rows])
        torch.cuda.synchronize(self.dev)
        self.applied = version

    def on_offload(self, region_ids, host_copy_kept):
        self.qkv = self.norm = self.lm_head = None

    def expected(self, full):
        r = self.r
        q, k, v = (full[n][r * (full[n].shape[0] // TP):(r + 1) * (full[n].shape[0] // TP)]
                   for n in ("q", "k", "v"))
        rows = V // TP
        return {"qkv": torch.cat([q, k, v]), "norm": full["norm"],
                "lm_head": full["lm_head"][r * rows:(r + 1) * rows]}

    def check(self, full):
        want = self.expected(full)
        for n, w in want.items():
            got = getattr(self, n).cpu()
            if not torch.equal(got, w):
                bad = (got != w).nonzero()[0].tolist()
                raise AssertionError("engine rank %d: %s differs from the trainer "
                                     "at %s" % (self.r, n, bad))


def correctness(conn, versions):
    dev = torch.device("cuda:0")
    gen = torch.Generator().manual_seed(7)
    trainer = Trainer(conn, dev)
    ranks = [EngineRank(r, dev) for r in range(TP)]
    dsts = [ferry.DestinationClient.register(conn, "vllm-0", "policy", r, TP, None,
                                             ranks[r].table(), ranks[r])
            for r in range(TP)]
    conn.wait_instances("policy", ["vllm-0"], sources=True)
    assert dsts[0].registration.staging == ferry.registration_pb2.STAGING_PLACEMENT_DEVICE
    full = None
    for v in range(1, versions + 1):
        full = full_tensors(gen)
        trainer.write(full)
        out = trainer.publish(v)
        assert out.all_committed(), out.summary()
        for e in ranks:
            e.check(full)
    uuid = ferry.cuda.device_uuid(0)
    assert all(d == "cuda:0" for e in ranks for d in e.staging_devices), \
        [e.staging_devices for e in ranks]
    print("python gpu check: PASS correctness: %d versions, TP2 -> TP2 fused "
          "qkv, lm_head through device staging on %s" % (versions, uuid))

    # 2. Offload with a host copy, then onload: fresh allocations.
    old_handles = [r.handle for d in dsts for r in d.memory.cuda_regions]
    st = conn.offload("vllm-0", keep_host_copy=True)
    assert st.state == ferry.types_pb2.INSTANCE_STATE_OFFLOADED, st
    torch.cuda.empty_cache()

    st = conn.onload("vllm-0")
    assert st.state == ferry.COMMITTED, st
    for e, d in zip(ranks, dsts):
        # The engine's tensors anew, at their registered places in the
        # fresh allocations.
        e.qkv, e.norm, e.lm_head = (d.live_tensor(n)
                                    for n in ("qkv_proj", "norm", "lm_head"))
        assert e.qkv.is_cuda
        e.check(full)
    # The caching allocator may place a fresh buffer in a segment that
    # outlived the offload (the trainer's tensors share this GPU), so the
    # handles need not all change; count those that did.
    new_handles = [r.handle for d in dsts for r in d.memory.cuda_regions]
    changed = sum(a != b for a, b in zip(old_handles, new_handles))
    v = versions + 1
    full = full_tensors(gen)
    trainer.write(full)
    assert trainer.publish(v).all_committed()
    for e in ranks:
        e.check(full)
    print("python gpu check: PASS offload/onload: refilled from the host copy "
          "into new buffers (%d of %d regions in a new allocation), version %d "
          "landed in them" % (changed, len(new_handles), v))
    for d in dsts:
        d.close()
    for c in trainer.clients:
        c.close()


def fp8(conn):
    """FP8 in flight from a GPU trainer (issue 40): two bf16 trainer ranks
    on cuda:0 (a [256, 256] weight, 128 rows each) into an FP8 instance on
    cuda:0 (float8_e4m3fn weight, float32 block scales); ferryd reads the
    trainer's pieces through the host (daemon/memory/gpu_reads.h) and
    quantizes them. Every byte and scale against the numpy oracle written
    from the rule (python/tests/fp8_oracle.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..",
                                    "python", "tests"))
    from fp8_oracle import oracle
    import numpy as np
    dev = torch.device("cuda:0")
    shards = [torch.zeros(128, 256, dtype=torch.bfloat16, device=dev)
              for _ in range(2)]
    srcs = [ferry.SourceClient.register(
        conn, "fp8", r, 2, None,
        [(shards[r], ferry.Shard("fw", (256, 256), dim=0, rank=r, world=2))])
        for r in range(2)]
    w = torch.zeros(256, 256, dtype=torch.float8_e4m3fn, device=dev)
    s = torch.zeros(2, 2, dtype=torch.float32, device=dev)
    dst = ferry.DestinationClient.register(
        conn, "fp8-0", "fp8", 0, 1, None,
        [ferry.EngineParam("m.fw", w, ferry.REPLICATED, consumes=["fw"],
                           fp8=ferry.Fp8("m.fw_scale_inv")),
         ferry.EngineParam("m.fw_scale_inv", s, ferry.CUSTOM)],
        ferry.EngineCallbacks())
    gen = torch.Generator().manual_seed(11)
    for v in (1, 2):
        full = (torch.randn(256, 256, generator=gen) * 0.02).to(torch.bfloat16)
        full[7, 3] = 4.0 * v
        for r in range(2):
            shards[r].copy_(full[128 * r:128 * (r + 1)])
        torch.cuda.synchronize(dev)
        for c in srcs:
            c.begin(v)
        import threading
        outs = [None, None]
        ths = [threading.Thread(target=lambda i=i: outs.__setitem__(
            i, srcs[i].commit(v))) for i in range(2)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        assert outs[0].all_committed(), outs[0].summary()
        want_q, want_s = oracle(full.float().numpy())
        got_q = w.view(torch.uint8).cpu().numpy()
        assert np.array_equal(got_q, want_q), (v, int((got_q != want_q).sum()))
        assert np.array_equal(s.cpu().numpy(), want_s), v
    print("python gpu check: PASS fp8: a GPU bf16 trainer into a GPU FP8 "
          "instance, 2 versions, every byte and scale as the rule gives")
    dst.close()
    for c in srcs:
        c.close()


def refusals(conn):
    freed = torch.zeros(16, device="cuda:0")
    freed.untyped_storage().resize_(0)
    try:
        ferry.SourceClient(conn, "refused", 0, 1, None,
                           [(freed, ferry.Shard("w", (16,)))])
        raise AssertionError("a freed tensor was registered")
    except ferry.cuda.CudaMemoryError as e:
        assert "w" in str(e) and "no memory" in str(e), e
    said = "freed tensor refused"
    try:
        from torch.cuda.memory import _set_allocator_settings
    except ImportError:
        _set_allocator_settings = None
    if _set_allocator_settings is not None:
        _set_allocator_settings("expandable_segments:True")
        try:
            t = torch.zeros(1 << 20, device="cuda:0")
            try:
                ferry.SourceClient(conn, "refused", 0, 1, None,
                                   [(t, ferry.Shard("w", (1 << 20,)))])
                raise AssertionError("expandable_segments memory was registered")
            except ferry.cuda.CudaMemoryError as e:
                assert "expandable_segments" in str(e), e
            said += ", expandable_segments refused"
        finally:
            del t
            torch.cuda.empty_cache()
            _set_allocator_settings("expandable_segments:False")
    print("python gpu check: PASS refusals: " + said)


# ---------------------------------------------------------------------------
# 4. The 1.6 GiB demo model, one source rank into one engine rank.

def demo_shapes():
    hidden, inter, vocab, q, kv = 2048, 7168, 128256, 2048, 1024
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for layer in range(6):
        p = "model.layers.%d." % layer
        shapes += [(p + "self_attn.q_proj.weight", (q, hidden)),
                   (p + "self_attn.k_proj.weight", (kv, hidden)),
                   (p + "self_attn.v_proj.weight", (kv, hidden)),
                   (p + "self_attn.o_proj.weight", (hidden, q)),
                   (p + "mlp.gate_proj.weight", (inter, hidden)),
                   (p + "mlp.up_proj.weight", (inter, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, inter)),
                   (p + "input_layernorm.weight", (hidden,)),
                   (p + "post_attention_layernorm.weight", (hidden,))]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return shapes


def bench(conn, versions):
    dev = torch.device("cuda:0")
    shapes = demo_shapes()
    src = {n: torch.randn(s, device=dev).to(torch.bfloat16) for n, s in shapes}
    total = sum(t.numel() * t.element_size() for t in src.values())
    source = ferry.SourceClient.register(
        conn, "bench", 0, 1, None, [(t, ferry.Shard(n, t.shape)) for n, t in src.items()])
    live, table = {}, []
    fused = {}
    for n, s in shapes:
        if n.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            continue
        if n.endswith("q_proj.weight"):
            base = n[:-len("q_proj.weight")]
            t = torch.zeros(2048 + 2 * 1024, 2048, dtype=torch.bfloat16, device=dev)
            table.append(ferry.EngineParam(base + "qkv_proj.weight", t, ferry.FUSED,
                                           fused_parts=[n, base + "k_proj.weight",
                                                        base + "v_proj.weight"]))
            fused[base + "qkv_proj.weight"] = [n, base + "k_proj.weight", base + "v_proj.weight"]
        elif n.endswith("gate_proj.weight"):
            base = n[:-len("gate_proj.weight")]
            t = torch.zeros(2 * 7168, 2048, dtype=torch.bfloat16, device=dev)
            table.append(ferry.EngineParam(base + "gate_up_proj.weight", t, ferry.FUSED,
                                           fused_parts=[n, base + "up_proj.weight"]))
            fused[base + "gate_up_proj.weight"] = [n, base + "up_proj.weight"]
        else:
            t = torch.zeros(s, dtype=torch.bfloat16, device=dev)
            table.append(ferry.EngineParam(n, t, ferry.REPLICATED))
            fused[n] = [n]
        live[table[-1].name] = t
    dst = ferry.DestinationClient.register(conn, "bench-0", "bench", 0, 1, None, table)
    conn.wait_instances("bench", ["bench-0"], sources=True)

    ferry_s = []
    for v in range(1, versions + 1):
        for t in src.values():
            t.add_(1)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = source.publish(v)
        ferry_s.append(time.perf_counter() - t0)
        assert out.all_committed(), out.summary()
    for name, parts in fused.items():
        want = torch.cat([src[p] for p in parts])
        assert torch.equal(live[name], want), name
    # The physical limit in the same run: device-to-device copies of the
    # same bytes (torch's copy_ of contiguous tensors is cudaMemcpyAsync D2D).
    dsts = {n: torch.empty_like(t) for n, t in src.items()}
    copy_s = []
    for _ in range(versions):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for n, t in src.items():
            dsts[n].copy_(t)
        torch.cuda.synchronize(dev)
        copy_s.append(time.perf_counter() - t0)
    gb = total / 1e9
    f_med, c_med = statistics.median(ferry_s), statistics.median(copy_s)
    print("bench python_gpu_update: %.2f GB bf16, %d versions: ferry %.1f ms "
          "median (min %.1f, max %.1f) = %.1f GB/s; D2D copy %.1f ms median "
          "(min %.1f, max %.1f) = %.1f GB/s; ratio %.2fx (target >= 0.7x)"
          % (gb, versions, f_med * 1e3, min(ferry_s) * 1e3, max(ferry_s) * 1e3,
             gb / f_med, c_med * 1e3, min(copy_s) * 1e3, max(copy_s) * 1e3,
             gb / c_med, c_med / f_med))
    dst.close()
    source.close()


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    versions = 5
    for a in sys.argv[2:]:
        if a.startswith("--versions="):
            versions = int(a.split("=", 1)[1])
    if not torch.cuda.is_available():
        print("SKIPPED: no GPU (torch.cuda.is_available() is False)")
        return 0
    ok, why = ferry.cuda.available()
    if not ok:
        print("python gpu check: FAIL: %s" % why)
        return 1
    tmp = tempfile.mkdtemp(prefix="ferry-pygpu-")
    proc, conn, _ = start_ferryd(sys.argv[1], tmp)
    try:
        correctness(conn, 3)
        fp8(conn)
        refusals(conn)
        bench(conn, versions)
    except Exception:
        with open(os.path.join(tmp, "ferryd.log")) as f:
            sys.stderr.write(f.read()[-4000:])
        raise
    finally:
        stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""ferry.vllm_table against the real ferryd: a Qwen3-MoE config.json (small
sizes, the real architecture) turned into vLLM's tables in one call per
rank, bound into shared memory, registered as a TP-2 instance with expert
parallelism and a TP-2 instance without; one trainer rank publishes the
whole checkpoint. Every live tensor checked is compared with slices of the
trainer's tensors cut here as vLLM lays them out (fused qkv_proj with one
kv head per rank, MoE w13 = gate;up per expert, w2 = down per expert, whole
experts under EP, vocabulary rows), not with ferry's own plan. Also the
errors a user meets: an architecture ferry does not build, a size vLLM
would refuse.

Usage: vllm_table_test.py FERRYD_BINARY
"""

import sys

import torch

import ferry
import ferryd_process

CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "vocab_size": 256, "num_experts": 4, "num_experts_per_tok": 2,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
TP = 2


def checkpoint(version):
    """The trainer's tensors, whole, with values that say where they are."""
    table = ferry.vllm_table(CONFIG, TP, 0)
    out = {}
    for i, (name, dtype, shape) in enumerate(table.checkpoint):
        assert dtype == "bf16", (name, dtype)
        n = 1
        for d in shape:
            n *= d
        out[name] = ((torch.arange(n, dtype=torch.float32) % 251) / 8 + i +
                     100 * version).to(torch.bfloat16).view(shape)
    return out


def expected(ckpt, name, rank, ep):
    """What vLLM holds in live parameter `name` on `rank`, from the
    checkpoint tensors (vLLM's layout, written out here)."""
    L = name.split(".")[2] if name.startswith("model.layers.") else None
    p = "model.layers.%s." % L
    if name.endswith("self_attn.qkv_proj.weight"):
        q = ckpt[p + "self_attn.q_proj.weight"]      # 4 heads x 16 rows
        k = ckpt[p + "self_attn.k_proj.weight"]      # 2 kv heads: one per rank
        v = ckpt[p + "self_attn.v_proj.weight"]
        return torch.cat([q[32 * rank:32 * rank + 32], k[16 * rank:16 * rank + 16],
                          v[16 * rank:16 * rank + 16]])
    if name.endswith("self_attn.o_proj.weight"):
        return ckpt[name][:, 32 * rank:32 * rank + 32]
    if name.endswith("mlp.experts.w13_weight"):
        experts = range(2 * rank, 2 * rank + 2) if ep else range(4)
        rows = slice(0, 32) if ep else slice(16 * rank, 16 * rank + 16)
        return torch.stack([torch.cat([
            ckpt[p + "mlp.experts.%d.gate_proj.weight" % e][rows],
            ckpt[p + "mlp.experts.%d.up_proj.weight" % e][rows]]) for e in experts])
    if name.endswith("mlp.experts.w2_weight"):
        experts = range(2 * rank, 2 * rank + 2) if ep else range(4)
        cols = slice(0, 32) if ep else slice(16 * rank, 16 * rank + 16)
        return torch.stack([ckpt[p + "mlp.experts.%d.down_proj.weight" % e][:, cols]
                            for e in experts])
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return ckpt[name][128 * rank:128 * rank + 128]   # 256 rows, no padding
    return ckpt[name]  # norms, q_norm / k_norm, the router: replicated


def check_errors():
    for bad, says in [
            (dict(CONFIG, architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
            (dict(CONFIG, num_attention_heads=3), "3"),
            ("{not json", "config.json")]:
        try:
            ferry.vllm_table(bad, TP, 0)
            raise AssertionError("accepted: %s" % (bad,))
        except ValueError as e:
            assert says in str(e), str(e)
    try:
        ferry.vllm_table(CONFIG, 2, 2)
        raise AssertionError("tp_rank 2 of 2 accepted")
    except ValueError as e:
        assert "tp_rank 2" in str(e), str(e)


def main():
    check_errors()
    with ferryd_process.Ferryd(sys.argv[1], "tables") as d:
        clients = d.clients
        sock = d.sock
        conn = ferry.connect(sock)
        ckpt = checkpoint(1)
        total = sum(t.numel() * 2 for t in ckpt.values())
        src_arena = ferry.SharedTensorArena("tables.src", total + 256 * len(ckpt))
        src_tensors = {}
        pairs = []
        for name, t in ckpt.items():
            s = src_arena.tensor(t.shape, torch.bfloat16)
            s.copy_(t)
            src_tensors[name] = s
            pairs.append((s, ferry.Shard(name, tuple(t.shape))))
        src = ferry.SourceClient.register(conn, "policy", 0, 1, src_arena, pairs)
        clients.append(src)

        engines = {}
        for instance, ep in (("vllm-ep", True), ("vllm-tp", False)):
            for r in range(TP):
                table = ferry.vllm_table(CONFIG, TP, r, ep=ep)
                names = [p.name for p in table.params]
                assert "model.layers.0.self_attn.qkv_proj.weight" in names, names
                assert "model.layers.1.mlp.experts.w13_weight" in names, names
                arena = ferry.SharedTensorArena("tables.%s.%d" % (instance, r),
                                                table.buffer_bytes + 4096)
                params = table.bind(arena)
                dst = ferry.DestinationClient.register(conn, instance, "policy", r,
                                                       TP, arena, params)
                clients.append(dst)
                engines[(instance, r, ep)] = (dst, params)

        out = src.publish(1)
        assert out.all_committed(), out.summary()
        checked = 0
        for (instance, r, ep), (dst, params) in engines.items():
            dst.wait_committed(1, 20)
            for p in params:
                want = expected(ckpt, p.name, r, ep)
                assert tuple(p.tensor.shape) == tuple(want.shape), (
                    instance, r, p.name, tuple(p.tensor.shape), tuple(want.shape))
                assert torch.equal(p.tensor, want), (instance, r, p.name)
                checked += 1
        print("vllm_table_test: %d live tensors on 4 ranks hold the trainer's "
              "bytes as vLLM lays them out" % checked)

if __name__ == "__main__":
    main()

"""ferry.vllm_table(trainer_dtype="bf16") against the real ferryd: a small
DeepSeek-V3 config.json (the real architecture: MLA, a dense layer, a MoE
layer with a shared expert; FP8 with 128x128 block scales) as the FP8
engines' tables, fed by a trainer that holds the model in bf16 (one rank,
every tensor whole). Every FP8 weight is quantized in flight; MLA's
kv_b_proj, which vLLM transforms after loading, reaches the engine's loader
quantized, whole. The bytes checked are the rule's (tests/fp8_oracle.py,
numpy, written from the definition) over the trainer's tensors, cut as
vLLM lays them out. Also: the table's form, and the errors a user meets.

Usage: vllm_fp8_table_test.py FERRYD_BINARY
"""

import sys

import numpy as np
import torch

import ferry
import ferryd_process
from fp8_oracle import oracle

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 256, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 2,
    "n_shared_experts": 1, "num_experts_per_tok": 1, "first_k_dense_replace": 1,
    "vocab_size": 256, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                            "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}
TP = 2
KV_B = "model.layers.0.self_attn.kv_b_proj.weight"


class Loader(ferry.EngineCallbacks):
    """Records what reaches the engine's loader."""

    def __init__(self):
        self.loaded = {}

    def on_apply(self, v, fallback):
        self.loaded = {n: t.clone() for n, t in fallback}


def check_table():
    table = ferry.vllm_table(CONFIG, TP, 0, trainer_dtype="bf16")
    fp8 = {p.name: p for p in table.params if p.fp8 is not None}
    assert "model.layers.0.self_attn.o_proj.weight" in fp8, sorted(fp8)
    assert "model.layers.1.mlp.experts.w13_weight" in fp8, sorted(fp8)
    for name, p in fp8.items():
        assert p.dtype_name == "f8_e4m3", (name, p.dtype_name)
        assert p.fp8.scale == name + "_scale_inv", (name, p.fp8.scale)
        assert p.fp8.block == (128, 128), (name, p.fp8.block)
    assert ferry.TRANSFORMED in fp8[KV_B].flags, fp8[KV_B].flags
    for name, dtype, shape in table.checkpoint:
        assert dtype in ("bf16", "f32"), (name, dtype)
        assert not name.endswith("_scale_inv"), name
    # The checkpoint as it is, without trainer_dtype: FP8 and scales.
    plain = ferry.vllm_table(CONFIG, TP, 0)
    assert all(p.fp8 is None for p in plain.params)
    assert any(n.endswith("_scale_inv") for n, _, _ in plain.checkpoint)
    for bad, says in [(dict(trainer_dtype="i8"), "quantizes bf16, f16 or f32"),
                      (dict(trainer_dtype="bf16", config=dict(
                          CONFIG, quantization_config=None)), "no FP8")]:
        config = bad.pop("config", CONFIG)
        if config.get("quantization_config") is None:
            config = {k: v for k, v in config.items() if k != "quantization_config"}
        try:
            ferry.vllm_table(config, TP, 0, **bad)
            raise AssertionError("accepted: %s" % (bad,))
        except ValueError as e:
            assert says in str(e), str(e)


def main():
    check_table()
    with ferryd_process.Ferryd(sys.argv[1], "fp8tables") as d:
        conn = ferry.connect(d.sock)
        table0 = ferry.vllm_table(CONFIG, TP, 0, trainer_dtype="bf16")
        total = sum(2 * int(np.prod(s)) + 256 for _, _, s in table0.checkpoint)
        src_arena = ferry.SharedTensorArena("fp8tables.src", total * 2)
        gen = torch.Generator().manual_seed(7)
        ckpt, pairs = {}, []
        for name, dtype, shape in table0.checkpoint:
            t = src_arena.tensor(shape, torch.bfloat16 if dtype == "bf16"
                                 else torch.float32)
            t.copy_(torch.randn(shape, generator=gen) * 0.02)
            ckpt[name] = t
            pairs.append((t, ferry.Shard(name, tuple(shape))))
        src = ferry.SourceClient.register(conn, "policy", 0, 1, src_arena, pairs)
        d.clients.append(src)
        ranks = []
        for r in range(TP):
            table = ferry.vllm_table(CONFIG, TP, r, trainer_dtype="bf16")
            arena = ferry.SharedTensorArena("fp8tables.dst%d" % r,
                                            table.buffer_bytes + 4096)
            params = {p.name: p for p in table.bind(arena)}
            loader = Loader()
            d.clients.append(ferry.DestinationClient.register(
                conn, "ds", "policy", r, TP, arena, list(params.values()), loader))
            ranks.append((params, loader))

        for v in (1, 2):
            with torch.no_grad():
                ckpt["model.layers.0.self_attn.o_proj.weight"][5, 200] = 3.0 * v
            out = src.publish(v)
            assert out.all_committed(), out.summary()
            # o_proj [256, 4 heads x 128] is row-parallel: rank r holds
            # columns 256r:256(r+1), scale columns 2r:2r+2.
            o = "model.layers.0.self_attn.o_proj.weight"
            want_q, want_s = oracle(ckpt[o].float().numpy())
            # kv_b_proj of each layer: the whole tensor, through the loader,
            # on each rank.
            kv_b = ["model.layers.%d.self_attn.kv_b_proj.weight" % l for l in (0, 1)]
            kv_want = {n: oracle(ckpt[n].float().numpy()) for n in kv_b}
            for r, (params, loader) in enumerate(ranks):
                got = params[o].tensor.view(torch.uint8).numpy()
                assert np.array_equal(got, want_q[:, 256 * r:256 * (r + 1)]), (v, r)
                assert np.array_equal(params[o + "_scale_inv"].tensor.numpy(),
                                      want_s[:, 2 * r:2 * r + 2]), (v, r)
                assert sorted(loader.loaded) == sorted(
                    kv_b + [n + "_scale_inv" for n in kv_b]), sorted(loader.loaded)
                for n in kv_b:
                    q, sc = kv_want[n]
                    assert np.array_equal(loader.loaded[n].view(torch.uint8).numpy(),
                                          q), (v, r, n)
                    assert np.array_equal(loader.loaded[n + "_scale_inv"].numpy(),
                                          sc), (v, r, n)
        plan = conn.explain_plan("ds")
        rows = {(p.name, p.tp_rank): p for p in plan.parameters}
        quantized = 0
        for (name, r), row in rows.items():
            if name.endswith("_scale_inv"):
                continue
            p = ranks[r][0][name]
            if p.tensor.element_size() == 1:
                assert row.resolution == ferry.inspection_pb2.RESOLUTION_QUANTIZED, row
                quantized += 1
        assert rows[(KV_B, 0)].reason.startswith(
            "quantized, through the engine's loader"), rows[(KV_B, 0)].reason
        print("vllm_fp8_table_test: %d FP8 weights quantized in flight on %d ranks, "
              "kv_b_proj through the loader" % (quantized, TP))


if __name__ == "__main__":
    main()

"""A small GPT-style (Llama-like) model in plain PyTorch, in two tensor-
parallel forms that share the math:

- the trainer's (Megatron style): separate q/k/v/gate/up column-parallel
  linears (split along the output dim), o/down row-parallel (split along the
  input dim, all-reduce after), vocab-parallel embedding and lm_head;
- the engine's (vLLM style): fused ``qkv_proj`` and ``gate_up_proj``
  (each rank holds its q rows, then its k rows, then its v rows), the rest as
  above.

Checkpoint names are Hugging Face Llama names. GQA: 8 query heads, 2 kv
heads; SwiGLU MLP; RMSNorm; untied embeddings; causal attention without
positional encoding beyond causality (rotary is orthogonal to weight sync).
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

CONFIG = dict(vocab=512, hidden=256, layers=4, heads=8, kv_heads=2,
              intermediate=512, eps=1e-5)


def hf_config(cfg=CONFIG):
    """The model as a Hugging Face config.json says it (a Llama), for
    ferry.vllm_table and the engine adapter."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg["hidden"], "intermediate_size": cfg["intermediate"],
        "num_hidden_layers": cfg["layers"], "num_attention_heads": cfg["heads"],
        "num_key_value_heads": cfg["kv_heads"], "vocab_size": cfg["vocab"],
        "head_dim": cfg["hidden"] // cfg["heads"], "rms_norm_eps": cfg["eps"],
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }


def checkpoint_shapes(cfg=CONFIG):
    """Checkpoint name -> global shape, in a fixed order."""
    H, V, I = cfg["hidden"], cfg["vocab"], cfg["intermediate"]
    hd = H // cfg["heads"]
    kv = cfg["kv_heads"] * hd
    shapes = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg["layers"]):
        p = "model.layers.%d." % i
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "self_attn.q_proj.weight"] = (H, H)
        shapes[p + "self_attn.k_proj.weight"] = (kv, H)
        shapes[p + "self_attn.v_proj.weight"] = (kv, H)
        shapes[p + "self_attn.o_proj.weight"] = (H, H)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        shapes[p + "mlp.gate_proj.weight"] = (I, H)
        shapes[p + "mlp.up_proj.weight"] = (I, H)
        shapes[p + "mlp.down_proj.weight"] = (H, I)
    shapes["model.norm.weight"] = (H,)
    shapes["lm_head.weight"] = (V, H)
    return shapes


def base_checkpoint(cfg=CONFIG, seed=0):
    """Version 0: the weights every party loads before the first version."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in checkpoint_shapes(cfg).items():
        if len(shape) == 1:
            out[name] = torch.ones(shape)
        else:
            out[name] = torch.randn(shape, generator=g) * 0.02  # GPT-2's init
    return out


# How each checkpoint parameter is split across TP ranks: (dim or None).
def device_of(spec):
    """--device: "cpu", "cuda" (cuda:0) or "cuda:N"; every rank of the
    example may share one GPU."""
    if spec == "cuda":
        spec = "cuda:0"
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device=%s: torch sees no GPU" % spec)
        torch.cuda.set_device(device)
        # Logits are compared at 1e-5 between TP layouts: full fp32 matmuls.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device


def split_dim(name):
    if name.endswith("norm.weight") or "layernorm" in name:
        return None
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1
    return 0  # column parallel, vocab parallel


def shard_of(tensor, dim, rank, world):
    if dim is None or world == 1:
        return tensor.clone()
    return tensor.chunk(world, dim)[rank].clone()


# ---------------------------------------------------------------------------
# Tensor-parallel communication (gloo), with Megatron's autograd rules.
# Ranks on a GPU (--device=cuda) may share one GPU, which NCCL refuses, so
# the groups stay on gloo and their collectives go through host memory:
# the example is about weight sync, not about the trainer's all-reduces.

def all_reduce_(x):
    """In-place sum over the TP group, for host or CUDA tensors."""
    if x.is_cuda:
        host = x.cpu()
        dist.all_reduce(host)
        x.copy_(host)
    else:
        dist.all_reduce(x)
    return x


def all_gather(x):
    """The group's tensors of x's shape, in rank order, on x's device."""
    world = dist.get_world_size()
    host = x.detach().contiguous().cpu()
    parts = [torch.empty_like(host) for _ in range(world)]
    dist.all_gather(parts, host)
    return [t.to(x.device) for t in parts]

class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient (Megatron's f)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce_(g.contiguous())


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x):
        return all_reduce_(x.contiguous().clone())

    @staticmethod
    def backward(ctx, g):
        return g


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.rank, ctx.width = dist.get_rank(), x.shape[-1]
        return torch.cat(all_gather(x), dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width].contiguous()


class TP:
    """The TP group of a rank: size 1 needs no communication."""

    def __init__(self, rank=0, size=1):
        self.rank, self.size = rank, size

    def copy_in(self, x):
        return _CopyToTP.apply(x) if self.size > 1 else x

    def reduce(self, x):
        return _ReduceFromTP.apply(x) if self.size > 1 else x

    def gather(self, x):
        return _GatherLastDim.apply(x) if self.size > 1 else x


# ---------------------------------------------------------------------------
# The math, shared by trainer and engine.

def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def embed(ids, w_local, tp):
    rows = w_local.shape[0]
    lo = tp.rank * rows
    if tp.size == 1:
        return F.embedding(ids, w_local)
    local = ids - lo
    mask = (local < 0) | (local >= rows)
    out = F.embedding(local.masked_fill(mask, 0), w_local)
    out = out.masked_fill(mask.unsqueeze(-1), 0.0)
    return tp.reduce(out)


def attention(q, k, v, heads, kv_heads):
    B, T, _ = q.shape
    hd = q.shape[-1] // heads
    q = q.view(B, T, heads, hd).transpose(1, 2)
    k = k.view(B, T, kv_heads, hd).transpose(1, 2)
    v = v.view(B, T, kv_heads, hd).transpose(1, 2)
    rep = heads // kv_heads
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(causal, float("-inf"))
    out = scores.softmax(-1) @ v
    return out.transpose(1, 2).reshape(B, T, heads * hd)


class TrainerModel(torch.nn.Module):
    """One Megatron TP rank: parameters named by their checkpoint names
    (dots replaced, see ``checkpoint_name``)."""

    def __init__(self, full, tp, cfg=CONFIG):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.params = torch.nn.ParameterDict()
        for name, t in full.items():
            self.params[name.replace(".", "__")] = torch.nn.Parameter(
                shard_of(t, split_dim(name), tp.rank, tp.size))

    @staticmethod
    def checkpoint_name(param_name):
        return param_name.split(".", 1)[1].replace("__", ".")

    def w(self, name):
        return self.params[name.replace(".", "__")]

    def forward(self, ids):
        cfg, tp = self.cfg, self.tp
        heads, kvh = cfg["heads"] // tp.size, cfg["kv_heads"] // tp.size
        x = embed(ids, self.w("model.embed_tokens.weight"), tp)
        for i in range(cfg["layers"]):
            p = "model.layers.%d." % i
            h = tp.copy_in(rms_norm(x, self.w(p + "input_layernorm.weight"), cfg["eps"]))
            q = F.linear(h, self.w(p + "self_attn.q_proj.weight"))
            k = F.linear(h, self.w(p + "self_attn.k_proj.weight"))
            v = F.linear(h, self.w(p + "self_attn.v_proj.weight"))
            a = attention(q, k, v, heads, kvh)
            x = x + tp.reduce(F.linear(a, self.w(p + "self_attn.o_proj.weight")))
            h = tp.copy_in(rms_norm(x, self.w(p + "post_attention_layernorm.weight"),
                                    cfg["eps"]))
            m = F.silu(F.linear(h, self.w(p + "mlp.gate_proj.weight"))) * \
                F.linear(h, self.w(p + "mlp.up_proj.weight"))
            x = x + tp.reduce(F.linear(m, self.w(p + "mlp.down_proj.weight")))
        h = tp.copy_in(rms_norm(x, self.w("model.norm.weight"), cfg["eps"]))
        return tp.gather(F.linear(h, self.w("lm_head.weight")))


class EngineModel:
    """One vLLM-style engine rank. Its live parameters (``self.params``,
    engine names -> tensors) are allocated by ``alloc(shape)`` (the ferry
    arena) and filled from the base checkpoint."""

    def __init__(self, full, tp, alloc, cfg=CONFIG):
        self.cfg, self.tp = cfg, tp
        r, n = tp.rank, tp.size
        self.params = {}

        def put(name, value):
            t = alloc(value.shape)
            t.copy_(value)
            self.params[name] = t

        put("model.embed_tokens.weight", shard_of(full["model.embed_tokens.weight"], 0, r, n))
        for i in range(cfg["layers"]):
            p = "model.layers.%d." % i
            put(p + "input_layernorm.weight", full[p + "input_layernorm.weight"])
            put(p + "self_attn.qkv_proj.weight", torch.cat(
                [shard_of(full[p + "self_attn.%s_proj.weight" % x], 0, r, n) for x in "qkv"]))
            put(p + "self_attn.o_proj.weight", shard_of(full[p + "self_attn.o_proj.weight"], 1, r, n))
            put(p + "post_attention_layernorm.weight", full[p + "post_attention_layernorm.weight"])
            put(p + "mlp.gate_up_proj.weight", torch.cat(
                [shard_of(full[p + "mlp.%s_proj.weight" % x], 0, r, n) for x in ("gate", "up")]))
            put(p + "mlp.down_proj.weight", shard_of(full[p + "mlp.down_proj.weight"], 1, r, n))
        put("model.norm.weight", full["model.norm.weight"])
        put("lm_head.weight", shard_of(full["lm_head.weight"], 0, r, n))

    @torch.no_grad()
    def load_weights(self, weights):
        """The engine's own loader, as vLLM's ``load_weights``: whole
        checkpoint tensors (name, tensor) placed into the live parameters,
        each sharded for this rank and q/k/v, gate/up written into their
        slices of the fused tensors. Returns the live names it wrote."""
        cfg, r, n = self.cfg, self.tp.rank, self.tp.size
        hd = cfg["hidden"] // cfg["heads"]
        q_rows = cfg["heads"] // n * hd
        kv_rows = max(cfg["kv_heads"] // n, 1) * hd
        inter = cfg["intermediate"] // n
        fused = {"q_proj": ("self_attn.qkv_proj.weight", 0, q_rows),
                 "k_proj": ("self_attn.qkv_proj.weight", q_rows, kv_rows),
                 "v_proj": ("self_attn.qkv_proj.weight", q_rows + kv_rows, kv_rows),
                 "gate_proj": ("mlp.gate_up_proj.weight", 0, inter),
                 "up_proj": ("mlp.gate_up_proj.weight", inter, inter)}
        written = []
        for name, full in weights:
            full = full.to(torch.float32)
            parent, module, _ = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", "")
            if module in fused:
                layer = parent.rsplit(".", 1)[0] + "."   # "model.layers.3."
                live, start, rows = fused[module]
                target = self.params[layer + live]
                if module in ("k_proj", "v_proj") and cfg["kv_heads"] < n:
                    part = full.view(cfg["kv_heads"], hd, -1)[r * cfg["kv_heads"] // n]
                else:
                    part = shard_of(full, 0, r, n)
                target[start:start + rows].copy_(part.to(target.device))
                written.append(layer + live)
                continue
            live = self.params[name]
            part = shard_of(full, split_dim(name), r, n)
            # A live tensor the engine pads (vocabulary rows) takes the
            # checkpoint's rows at its start.
            live[tuple(slice(0, d) for d in part.shape)].copy_(part.to(live.device))
            written.append(name)
        return written

    def ferry_table(self):
        """The engine parameter table: loader kind per live parameter, as
        vLLM's weight loaders place checkpoint tensors."""
        import ferry
        cfg, n = self.cfg, self.tp.size
        hd = cfg["hidden"] // cfg["heads"]
        table = []
        for name, t in self.params.items():
            if name.endswith("qkv_proj.weight"):
                base = name[:-len("qkv_proj.weight")]
                # kv rows per rank: whole heads; replicated when TP > kv heads.
                kv_rows = max(cfg["kv_heads"] // n, 1) * hd
                table.append(ferry.EngineParam(name, t, ferry.FUSED, shard_dim=0, fused_parts=[
                    ferry.FusedPart(base + "q_proj.weight"),
                    ferry.FusedPart(base + "k_proj.weight", local_extent=kv_rows),
                    ferry.FusedPart(base + "v_proj.weight", local_extent=kv_rows)]))
            elif name.endswith("gate_up_proj.weight"):
                base = name[:-len("gate_up_proj.weight")]
                table.append(ferry.EngineParam(name, t, ferry.FUSED, shard_dim=0, fused_parts=[
                    base + "gate_proj.weight", base + "up_proj.weight"]))
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                table.append(ferry.EngineParam(name, t, ferry.ROW, shard_dim=1))
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                table.append(ferry.EngineParam(name, t, ferry.VOCAB_PARALLEL, shard_dim=0))
            else:
                table.append(ferry.EngineParam(name, t, ferry.REPLICATED))
        return table

    @torch.no_grad()
    def forward(self, ids):
        cfg, tp, w = self.cfg, self.tp, self.params
        hd = cfg["hidden"] // cfg["heads"]
        heads, kvh = cfg["heads"] // tp.size, max(cfg["kv_heads"] // tp.size, 1)
        x = embed(ids, w["model.embed_tokens.weight"], tp)
        for i in range(cfg["layers"]):
            p = "model.layers.%d." % i
            h = rms_norm(x, w[p + "input_layernorm.weight"], cfg["eps"])
            qkv = F.linear(h, w[p + "self_attn.qkv_proj.weight"])
            q, k, v = qkv.split([heads * hd, kvh * hd, kvh * hd], dim=-1)
            a = attention(q, k, v, heads, kvh)
            x = x + tp.reduce(F.linear(a, w[p + "self_attn.o_proj.weight"]))
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg["eps"])
            gate, up = F.linear(h, w[p + "mlp.gate_up_proj.weight"]).chunk(2, dim=-1)
            x = x + tp.reduce(F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"]))
        h = rms_norm(x, w["model.norm.weight"], cfg["eps"])
        return tp.gather(F.linear(h, w["lm_head.weight"]))


def train_step(net, opt, inputs, targets):
    """One step of next-token cross entropy; returns the loss."""
    logits = net(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def corpus(cfg=CONFIG, batch=8, seq=32, seed=1):
    """A fixed synthetic corpus: noisy affine-recurrence token sequences."""
    g = torch.Generator().manual_seed(seed)
    V = cfg["vocab"]
    x = torch.empty(batch, seq + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, V, (batch,), generator=g)
    for t in range(1, seq + 1):
        x[:, t] = (x[:, t - 1] * 5 + 17) % V
    return x[:, :-1], x[:, 1:]


def prompts(cfg=CONFIG, batch=4, seq=16, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg["vocab"], (batch, seq), generator=g)


# ---------------------------------------------------------------------------
# LoRA on q_proj and v_proj of the frozen base (run 5 of run_e2e.py).

LORA = dict(r=8, alpha=16, modules=("q_proj", "v_proj"))


def lora_config_json(lora=LORA):
    """The PEFT adapter_config.json text the engines receive."""
    import json
    return json.dumps({"peft_type": "LORA", "r": lora["r"],
                       "lora_alpha": lora["alpha"],
                       "target_modules": list(lora["modules"])})


def lora_shapes(cfg=CONFIG, lora=LORA):
    """PEFT tensor name -> global shape: lora_A [r, in], lora_B [out, r]."""
    base = checkpoint_shapes(cfg)
    out = {}
    for i in range(cfg["layers"]):
        for m in lora["modules"]:
            w = base["model.layers.%d.self_attn.%s.weight" % (i, m)]
            stem = "base_model.model.model.layers.%d.self_attn.%s." % (i, m)
            out[stem + "lora_A.weight"] = (lora["r"], w[1])
            out[stem + "lora_B.weight"] = (w[0], lora["r"])
    return out


def lora_key(name):
    """(layer, module, "A" or "B") of a PEFT tensor name."""
    parts = name.split(".")
    return int(parts[4]), parts[6], parts[7][-1]


def lora_init(cfg=CONFIG, lora=LORA, seed=3):
    """PEFT's init, made deterministic: A small random, B zero (so version
    0 of the adapter is the base model)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in lora_shapes(cfg, lora).items():
        if name.endswith("lora_A.weight"):
            out[name] = torch.randn(shape, generator=g) * 0.05
        else:
            out[name] = torch.zeros(shape)
    return out


class TrainerLora(torch.nn.Module):
    """The trainer's adapter, Megatron style: lora_A replicated on every TP
    rank (its gradient all-reduced), lora_B split along its output dim like
    the column-parallel layer it belongs to."""

    def __init__(self, full, tp, lora=LORA):
        super().__init__()
        self.tp, self.scale = tp, lora["alpha"] / lora["r"]
        self.params = torch.nn.ParameterDict()
        for name, t in full.items():
            dim = None if name.endswith("lora_A.weight") else 0
            self.params[name.replace(".", "__")] = torch.nn.Parameter(
                shard_of(t, dim, tp.rank, tp.size))

    def split_dim(self, name):
        return None if name.endswith("lora_A.weight") else 0

    def pairs(self):
        """(layer, module) -> (A, B_local)."""
        out = {}
        for key, p in self.params.items():
            layer, module, ab = lora_key(key.replace("__", "."))
            out.setdefault((layer, module), {})[ab] = p
        return {k: (v["A"], v["B"]) for k, v in out.items()}

    def sync_grads(self):
        """lora_A is replicated: each rank holds part of its gradient."""
        if self.tp.size > 1:
            for key, p in self.params.items():
                if key.endswith("lora_A__weight") and p.grad is not None:
                    all_reduce_(p.grad)


def lora_delta(h, pair, scale):
    a, b = pair
    return scale * F.linear(F.linear(h, a), b)


def trainer_forward_lora(net, ids, lora):
    """TrainerModel.forward with the adapter on q_proj and v_proj."""
    cfg, tp = net.cfg, net.tp
    pairs = lora.pairs()
    heads, kvh = cfg["heads"] // tp.size, cfg["kv_heads"] // tp.size
    x = embed(ids, net.w("model.embed_tokens.weight"), tp)
    for i in range(cfg["layers"]):
        p = "model.layers.%d." % i
        h = tp.copy_in(rms_norm(x, net.w(p + "input_layernorm.weight"), cfg["eps"]))
        q = F.linear(h, net.w(p + "self_attn.q_proj.weight"))
        k = F.linear(h, net.w(p + "self_attn.k_proj.weight"))
        v = F.linear(h, net.w(p + "self_attn.v_proj.weight"))
        if (i, "q_proj") in pairs:
            q = q + lora_delta(h, pairs[(i, "q_proj")], lora.scale)
        if (i, "v_proj") in pairs:
            v = v + lora_delta(h, pairs[(i, "v_proj")], lora.scale)
        a = attention(q, k, v, heads, kvh)
        x = x + tp.reduce(F.linear(a, net.w(p + "self_attn.o_proj.weight")))
        h = tp.copy_in(rms_norm(x, net.w(p + "post_attention_layernorm.weight"),
                                cfg["eps"]))
        m = F.silu(F.linear(h, net.w(p + "mlp.gate_proj.weight"))) * \
            F.linear(h, net.w(p + "mlp.up_proj.weight"))
        x = x + tp.reduce(F.linear(m, net.w(p + "mlp.down_proj.weight")))
    h = tp.copy_in(rms_norm(x, net.w("model.norm.weight"), cfg["eps"]))
    return tp.gather(F.linear(h, net.w("lm_head.weight")))


@torch.no_grad()
def engine_forward_lora(engine, ids, pairs, scale):
    """EngineModel.forward with an adapter: ``pairs`` maps (layer, module)
    to this rank's (A, B) as ferry delivered them (A whole, B the rank's
    rows of q, or of its kv heads)."""
    cfg, tp, w = engine.cfg, engine.tp, engine.params
    hd = cfg["hidden"] // cfg["heads"]
    heads, kvh = cfg["heads"] // tp.size, max(cfg["kv_heads"] // tp.size, 1)
    x = embed(ids, w["model.embed_tokens.weight"], tp)
    for i in range(cfg["layers"]):
        p = "model.layers.%d." % i
        h = rms_norm(x, w[p + "input_layernorm.weight"], cfg["eps"])
        qkv = F.linear(h, w[p + "self_attn.qkv_proj.weight"])
        q, k, v = qkv.split([heads * hd, kvh * hd, kvh * hd], dim=-1)
        if (i, "q_proj") in pairs:
            q = q + lora_delta(h, pairs[(i, "q_proj")], scale)
        if (i, "v_proj") in pairs:
            v = v + lora_delta(h, pairs[(i, "v_proj")], scale)
        a = attention(q, k, v, heads, kvh)
        x = x + tp.reduce(F.linear(a, w[p + "self_attn.o_proj.weight"]))
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg["eps"])
        gate, up = F.linear(h, w[p + "mlp.gate_up_proj.weight"]).chunk(2, dim=-1)
        x = x + tp.reduce(F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"]))
    h = rms_norm(x, w["model.norm.weight"], cfg["eps"])
    return tp.gather(F.linear(h, w["lm_head.weight"]))

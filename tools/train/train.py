#!/usr/bin/python3
"""Trains the small MoE that `make demo` and the realism tests use, in PyTorch, with
exactly llama.cpp's qwen3moe forward (RMS norms, q/k norms, NeoX RoPE, GQA attention,
softmax router with top-k and renormalized weights, SiLU-gated experts, tied output),
and writes it as a GGUF whose metadata is that of a `moeprune synth` model of the same
shape (so every key is one llama.cpp reads) plus the recipe's own record.

  train.py --template T.gguf --data DIR --out MODEL.gguf --reference REF.json [--steps N]
"""
import argparse
import hashlib
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "third_party", "llama.cpp", "gguf-py"))
import gguf  # noqa: E402

DOMAINS = ("prose", "code", "zh", "chat")
BOS = 1


def field_value(reader, key):
    return reader.fields[key].contents()


class Hparams:
    def __init__(self, reader):
        a = "qwen3moe."
        self.n_embd = field_value(reader, a + "embedding_length")
        self.n_layer = field_value(reader, a + "block_count")
        self.n_head = field_value(reader, a + "attention.head_count")
        self.n_head_kv = field_value(reader, a + "attention.head_count_kv")
        self.n_expert = field_value(reader, a + "expert_count")
        self.n_expert_used = field_value(reader, a + "expert_used_count")
        self.n_ff_exp = field_value(reader, a + "expert_feed_forward_length")
        self.eps = float(field_value(reader, a + "attention.layer_norm_rms_epsilon"))
        self.rope_base = float(field_value(reader, a + "rope.freq_base"))
        self.n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
        self.head_dim = self.n_embd // self.n_head


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_neox(x, base):
    """ggml_rope_ext with GGML_ROPE_TYPE_NEOX: dimension i pairs with i + d/2."""
    t, d = x.shape[-3], x.shape[-1]
    half = d // 2
    inv = base ** (-torch.arange(0, half, dtype=torch.float64) * 2.0 / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Model(torch.nn.Module):
    def __init__(self, hp):
        super().__init__()
        self.hp = hp
        d, E, f, L = hp.n_embd, hp.n_expert, hp.n_ff_exp, hp.n_layer
        kv = hp.n_head_kv * hp.head_dim
        P = torch.nn.Parameter
        self.tok_embd = P(torch.randn(hp.n_vocab, d) * 0.02)
        self.output_norm = P(torch.ones(d))
        self.layers = torch.nn.ModuleList()
        for _ in range(L):
            m = torch.nn.Module()
            m.attn_norm = P(torch.ones(d))
            m.wq = P(torch.randn(d, d) / math.sqrt(d))
            m.wk = P(torch.randn(kv, d) / math.sqrt(d))
            m.wv = P(torch.randn(kv, d) / math.sqrt(d))
            m.wo = P(torch.randn(d, d) / math.sqrt(d) / math.sqrt(2 * L))
            m.q_norm = P(torch.ones(hp.head_dim))
            m.k_norm = P(torch.ones(hp.head_dim))
            m.ffn_norm = P(torch.ones(d))
            m.gate_inp = P(torch.randn(E, d) * 0.02)
            m.gate_exps = P(torch.randn(E, f, d) / math.sqrt(d))
            m.up_exps = P(torch.randn(E, f, d) / math.sqrt(d))
            m.down_exps = P(torch.randn(E, d, f) / math.sqrt(f) / math.sqrt(2 * L))
            self.layers.append(m)

    def attention(self, m, x):
        hp = self.hp
        B, T, _ = x.shape
        q = (x @ m.wq.T).view(B, T, hp.n_head, hp.head_dim)
        k = (x @ m.wk.T).view(B, T, hp.n_head_kv, hp.head_dim)
        v = (x @ m.wv.T).view(B, T, hp.n_head_kv, hp.head_dim)
        q = rope_neox(rms_norm(q, m.q_norm, hp.eps), hp.rope_base)
        k = rope_neox(rms_norm(k, m.k_norm, hp.eps), hp.rope_base)
        rep = hp.n_head // hp.n_head_kv
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hp.head_dim)
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        return (att @ v).transpose(1, 2).reshape(B, T, -1) @ m.wo.T

    def moe(self, m, x):
        """Returns the experts' output and the switch-style load-balancing term."""
        hp = self.hp
        flat = x.reshape(-1, x.shape[-1])
        probs = (flat @ m.gate_inp.T).softmax(-1)
        w, ids = probs.topk(hp.n_expert_used, dim=-1)
        w = w / w.sum(-1, keepdim=True).clamp_min(6.103515625e-5)
        out = torch.zeros_like(flat)
        for e in range(hp.n_expert):
            rows, slot = (ids == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            h = flat[rows]
            y = (F.silu(h @ m.gate_exps[e].T) * (h @ m.up_exps[e].T)) @ m.down_exps[e].T
            out.index_add_(0, rows, y * w[rows, slot, None])
        share = torch.zeros(hp.n_expert).index_add_(0, ids.reshape(-1), torch.ones(ids.numel())) / ids.numel()
        balance = hp.n_expert * (share.detach() * probs.mean(0)).sum()
        return out.view_as(x), balance, ids.view(*x.shape[:-1], -1)

    def forward(self, tokens, want_routes=False):
        hp = self.hp
        x = self.tok_embd[tokens]
        balance = 0.0
        routes = []
        for m in self.layers:
            x = x + self.attention(m, rms_norm(x, m.attn_norm, hp.eps))
            y, b, ids = self.moe(m, rms_norm(x, m.ffn_norm, hp.eps))
            x = x + y
            balance = balance + b
            routes.append(ids)
        logits = rms_norm(x, self.output_norm, hp.eps) @ self.tok_embd.T
        return (logits, balance / hp.n_layer, routes) if want_routes else (logits, balance / hp.n_layer)


def batches(streams, rng, mix, seq):
    """Windows of every domain, mix[d] of them, each after a BOS as llama-perplexity scores them."""
    rows = []
    for d in DOMAINS:
        s = streams[d]
        for start in rng.integers(0, len(s) - seq, size=mix[d]):
            rows.append(np.concatenate([[BOS], s[start:start + seq]]))
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def copy_metadata(reader, writer, skip_prefixes):
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key.startswith(skip_prefixes):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def write_gguf(model, reader, path, record):
    hp = model.hp
    writer = gguf.GGUFWriter(path + ".tmp", "qwen3moe")
    # The vocabulary file's own phi3.* keys came along with it into the template; they describe
    # Phi-3, not this model. general.name and file_type are this model's.
    copy_metadata(reader, writer, ("phi3.", "moeprune.synth.", "general.name", "general.file_type"))
    writer.add_name("moeprune-trained-qwen3moe")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, value in record.items():
        writer.add_string("moeprune.train." + key, value if isinstance(value, str) else json.dumps(value, sort_keys=True))

    def t(name, p):
        writer.add_tensor(name, p.detach().float().contiguous().numpy())
    t("token_embd.weight", model.tok_embd)
    t("output_norm.weight", model.output_norm)
    for i, m in enumerate(model.layers):
        for name, p in (("attn_norm", m.attn_norm), ("attn_q", m.wq), ("attn_k", m.wk), ("attn_v", m.wv),
                        ("attn_output", m.wo), ("attn_q_norm", m.q_norm), ("attn_k_norm", m.k_norm),
                        ("ffn_norm", m.ffn_norm), ("ffn_gate_inp", m.gate_inp), ("ffn_gate_exps", m.gate_exps),
                        ("ffn_up_exps", m.up_exps), ("ffn_down_exps", m.down_exps)):
            t(f"blk.{i}.{name}.weight", p)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(path + ".tmp", path)


def reference(model, heldout, per_domain, seq, n_random, seed):
    """PyTorch's logits on held-out windows: for each position the 16 highest and n_random
    fixed pseudo-random token ids, which the test compares with llama.cpp's."""
    rng = np.random.default_rng(seed)
    out = {"seq": seq, "sequences": []}
    with torch.no_grad():
        for d in DOMAINS:
            s = heldout[d]
            for start in rng.integers(0, len(s) - seq, size=per_domain):
                toks = np.concatenate([[BOS], s[start:start + seq - 1]]).astype(np.int64)
                logits = model(torch.from_numpy(toks)[None])[0][0]
                positions = []
                for p in range(seq):
                    top = logits[p].topk(16).indices.tolist()
                    rand = rng.integers(0, model.hp.n_vocab, size=n_random).tolist()
                    ids = top + rand
                    positions.append({"ids": ids, "logits": [float(logits[p, i]) for i in ids]})
                out["sequences"].append({"domain": d, "tokens": toks.tolist(), "positions": positions})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--template", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reference", required=True)
    ap.add_argument("--steps", type=int, default=330)
    ap.add_argument("--seq", type=int, default=128)
    # Windows per step by domain: chat most, since ending an answer is what behaviour checks
    # look for; code least, since it is the easiest to predict.
    ap.add_argument("--mix", default="prose=6,code=3,zh=6,chat=9")
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--balance", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    mix = {k: int(v) for k, v in (kv.split("=") for kv in a.mix.split(","))}

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)
    reader = gguf.GGUFReader(a.template)
    hp = Hparams(reader)
    streams = {d: np.load(os.path.join(a.data, "train", d + ".tokens.npy")) for d in DOMAINS}
    heldout = {d: np.load(os.path.join(a.data, "heldout", d + ".tokens.npy")) for d in DOMAINS}
    model = Model(hp)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": other, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    warm = max(1, a.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / a.steps)))))
    rng = np.random.default_rng(a.seed)
    began = time.time()
    for step in range(a.steps):
        batch = batches(streams, rng, mix, a.seq)
        logits, balance = model(batch[:, :-1])
        ce = F.cross_entropy(logits.reshape(-1, hp.n_vocab), batch[:, 1:].reshape(-1))
        loss = ce + a.balance * balance
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == a.steps - 1:
            el = time.time() - began
            print(f"step {step:5d}  ce {ce.item():.3f}  balance {balance.item():.3f}  {el:6.0f} s"
                  f"  eta {el / (step + 1) * (a.steps - step - 1):5.0f} s", flush=True)
    seconds = time.time() - began

    digests = {}
    for side in ("train", "heldout"):
        for d in DOMAINS:
            with open(os.path.join(a.data, side, d + ".tokens.npy"), "rb") as f:
                digests[f"{side}/{d}"] = hashlib.sha256(f.read()).hexdigest()
    record = {
        "recipe": "tools/train/train.py (data: tools/train/data.py); docs/trained-model.md",
        "seed": str(a.seed),
        "settings": {"steps": a.steps, "seq": a.seq, "mix": mix, "lr": a.lr,
                     "balance": a.balance, "threads": a.threads, "torch": torch.__version__},
        "data_sha256": digests,
        "train_seconds": f"{seconds:.0f}",
        "train_tokens": {d: int(len(streams[d])) for d in DOMAINS},
    }
    model.eval()
    write_gguf(model, reader, a.out, record)
    ref = reference(model, heldout, 2, 64, 16, a.seed + 1)
    ref["model_sha256"] = hashlib.sha256(open(a.out, "rb").read()).hexdigest()
    with open(a.reference + ".tmp", "w") as f:
        json.dump(ref, f)
    os.replace(a.reference + ".tmp", a.reference)
    print(f"trained {a.steps} steps in {seconds:.0f} s -> {a.out} ({os.path.getsize(a.out) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()

"""An independent plain-NumPy qwen4exp forward pass, for tests only.

Written from the architecture description (docs/qwen4exp.md), not from
FLE's torch code, and deliberately in a different form: float64, one token
at a time through every layer (the delta rule always recurrent), the PLE
hash in Python integers, the QSA block choice by an explicit per-query sort,
attention one query at a time. Slow; meant for a few dozen tokens.
"""
from __future__ import annotations

import math

import numpy as np

from fle_quant.gguf_reader import GGUFModel
from fle_quant.ggml_types import GGMLType
from fle_quant.quants import dequantize


def read_tensors(*paths) -> tuple[dict, dict]:
    """(tensors in numpy order as float64, metadata of the first file)."""
    out, meta = {}, None
    for path in paths:
        g = GGUFModel.open(path)
        try:
            meta = meta or dict(g.metadata)
            for name, t in g.tensors.items():
                raw = g.tensor_bytes(name)
                if t.qtype == GGMLType.F32:
                    v = np.array(raw.view(np.float32))
                elif t.qtype == GGMLType.F16:
                    v = raw.view(np.float16).astype(np.float32)
                else:
                    v = dequantize(raw, t.qtype)
                out[name] = v.reshape(tuple(reversed(t.shape))).astype(np.float64)
        finally:
            g.close()
    return out, meta


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0.0)


def rotate(x, pos, n_rot, base):
    """NEOX rotary of the first n_rot dims of vector(s) x [..., Dh] at pos."""
    half = n_rot // 2
    ang = pos * base ** (-np.arange(half) * 2.0 / n_rot)
    c, s = np.cos(ang), np.sin(ang)
    y = x.copy()
    a, b = x[..., :half], x[..., half:n_rot]
    y[..., :half] = a * c - b * s
    y[..., half:n_rot] = b * c + a * s
    return y


class NumpyQwen4Exp:
    def __init__(self, path, mtp_path=None):
        self.t, meta = read_tensors(path, *([mtp_path] if mtp_path else []))
        m = {k.removeprefix("qwen4exp."): v for k, v in meta.items()}
        self.m = m
        self.n_layer = int(m["block_count"]) - int(m.get("nextn_predict_layers", 0))
        self.d = int(m["embedding_length"])
        self.S = int(m["hyper_connection.count"])
        self.eps = float(m["attention.layer_norm_rms_epsilon"])
        self.n_rot = int(m["rope.dimension_count"])
        self.base = float(m["rope.freq_base"])
        self.rec = [bool(r) for r in m["attention.recurrent_layers"]]
        self.ratios = [int(r) for r in m["attention.compress_ratios"]]
        self.ple_layers = [int(x) for x in m.get("ple.layers", [])]

    # ------------------------------------------------------------------
    def hc_read(self, R, prefix):
        S, d, t = self.S, self.d, self.t
        xn = np.stack([rms(R[s], t[prefix + "norm.weight"][s * d:(s + 1) * d], self.eps) for s in range(S)])
        flat = xn.reshape(-1)
        lo = silu(t[prefix + "down.weight"] @ flat / S)
        g = (t[prefix + "up.weight"] @ lo).reshape(S, d)
        mixed = sum(xn[s] * sigmoid(g[s]) for s in range(S)) / S
        inj = None
        if prefix + "inject.weight" in t:
            inj = 2.0 * sigmoid(t[prefix + "inject.weight"] @ flat / S)
        return mixed, inj

    def ple_rows(self, history):
        """Rows of the last token of ``history`` (all tokens so far)."""
        m = self.m
        n, per, eos = int(m["ple.ngram_size"]), int(m["ple.heads_per_ngram"]), int(m["ple.eos_token_id"])
        mult = [int(x) for x in m["ple.layer_multipliers"]]
        offs = [int(x) for x in m["ple.head_offsets"]]
        sizes = [int(x) for x in m["ple.head_vocab_sizes"]]
        t = len(history) - 1
        ctx, cut = [int(history[t])], False
        for s in range(1, n):
            j = t - s
            tok = int(history[j]) if j >= 0 else eos
            cut = cut or tok == eos
            ctx.append(eos if cut else tok)
        rows = []
        for g in range(2, n + 1):
            mixed = 0
            for j in range(g):
                mixed ^= ctx[j] * mult[j]
            for h in range((g - 2) * per, (g - 1) * per):
                rows.append(mixed % sizes[h] + offs[h])
        return rows

    # ------------------------------------------------------------------
    def run(self, tokens):
        """Logits [T, V] and the wide residuals [T, S, D] after the last layer."""
        t, S, d, eps = self.t, self.S, self.d, self.eps
        emb, out_w = t["token_embd.weight"], t["output.weight"]
        T = len(tokens)
        st = {}
        for il in range(self.n_layer):
            if self.rec[il]:
                nk, nv = int(self.m["ssm.group_count"]), int(self.m["ssm.time_step_rank"])
                dk = int(self.m["ssm.state_size"])
                C = 2 * nk * dk + nv * dk
                st[il] = {"conv": np.zeros((int(self.m["ssm.conv_kernel"]) - 1, C)), "S": np.zeros((nv, dk, dk))}
            else:
                st[il] = {"k": [], "v": [], "ik": []}
            if il in self.ple_layers:
                K = int(self.m["ple.conv_kernel"])
                st[il]["ple"] = np.zeros(((K - 1) * int(self.m["ple.ngram_size"]), S * d))
        logits, hidden = [], []
        for p in range(T):
            R = np.repeat(emb[tokens[p]][None], S, 0)
            for il in range(self.n_layer):
                pre = f"blk.{il}."
                if il in self.ple_layers:
                    R = self.ple(R, tokens[:p + 1], st[il], pre)
                x, inj = self.hc_read(R, pre + "hc_attn_")
                y = self.gdn(x, st[il], pre) if self.rec[il] else self.attn(x, p, st[il], pre, self.ratios[il])
                R = R + inj[:, None] * y[None]
                x, inj = self.hc_read(R, pre + "hc_ffn_")
                R = R + inj[:, None] * self.moe(x, pre)[None]
            hidden.append(R)
            mixed, _ = self.hc_read(R, "output_hc_")
            logits.append(out_w @ mixed)
        return np.array(logits), np.array(hidden)

    def ple(self, R, history, st, pre):
        t, S, d, eps = self.t, self.S, self.d, self.eps
        e = np.concatenate([t["per_layer_token_embd.weight"][r] for r in self.ple_rows(history)])
        key = (t[pre + "ple_key.weight"] @ e).reshape(S, d)
        val = t[pre + "ple_value.weight"] @ e
        gated = np.zeros((S, d))
        for s in range(S):
            sl = slice(s * d, (s + 1) * d)
            k = rms(key[s], t[pre + "ple_norm_key.weight"][sl], eps)
            q = rms(R[s], t[pre + "ple_norm_query.weight"][sl], eps)
            sc = float(k @ q) / math.sqrt(d)
            gated[s] = val * sigmoid(math.copysign(math.sqrt(max(abs(sc), 1e-6)), sc) if sc != 0 else 0.0)
        normed = np.concatenate([rms(gated[s], t[pre + "ple_norm_conv.weight"][s * d:(s + 1) * d], eps)
                                 for s in range(S)])
        hist = np.concatenate([st["ple"], normed[None]])                # oldest first, current last
        w = t[pre + "ple_conv1d.weight"]                                 # [S*d, K]
        K, dil = w.shape[1], int(self.m["ple.ngram_size"])
        conv = sum(w[:, k] * hist[len(hist) - 1 - (K - 1 - k) * dil] for k in range(K))
        st["ple"] = hist[1:]
        return R + gated + silu(conv).reshape(S, d)

    def gdn(self, x, st, pre):
        t, m, eps = self.t, self.m, self.eps
        nk, nv, dk = int(m["ssm.group_count"]), int(m["ssm.time_step_rank"]), int(m["ssm.state_size"])
        qkv = t[pre + "attn_qkv.weight"] @ x
        hist = np.concatenate([st["conv"], qkv[None]])
        w = t[pre + "ssm_conv1d.weight"]                                 # [C, K], tap K-1 on the current token
        c = silu(np.einsum("kc,ck->c", hist, w))
        st["conv"] = hist[1:]
        q = c[:nk * dk].reshape(nk, dk)
        k = c[nk * dk:2 * nk * dk].reshape(nk, dk)
        v = c[2 * nk * dk:].reshape(nv, dk)
        z = (t[pre + "attn_gate.weight"] @ x).reshape(nv, dk)
        beta = sigmoid(t[pre + "ssm_beta.weight"] @ x)
        g = softplus(t[pre + "ssm_alpha.weight"] @ x + t[pre + "ssm_dt.bias"]) * t[pre + "ssm_a"]
        out = np.zeros((nv, dk))
        for j in range(nv):
            kh = j % nk                                                  # tiled: V head j reads K head j mod n_k
            qj = q[kh] / math.sqrt(np.sum(q[kh] ** 2) + eps)
            kj = k[kh] / math.sqrt(np.sum(k[kh] ** 2) + eps)
            Sj = st["S"][j] * math.exp(g[j])
            Sj = Sj + beta[j] * np.outer(v[j] - Sj @ kj, kj)
            st["S"][j] = Sj
            out[j] = Sj @ qj / math.sqrt(dk)
            out[j] = rms(out[j], t[pre + "ssm_norm.weight"], eps) * sigmoid(z[j])
        return t[pre + "ssm_out.weight"] @ out.reshape(-1)

    def attn(self, x, p, st, pre, ratio):
        t, m, eps = self.t, self.m, self.eps
        H, Hkv, Dh = int(m["attention.head_count"]), int(m["attention.head_count_kv"]), int(m["attention.key_length"])
        qg = (t[pre + "attn_q.weight"] @ x).reshape(H, 2 * Dh)
        q = np.stack([rotate(rms(qg[h, :Dh], t[pre + "attn_q_norm.weight"], eps), p, self.n_rot, self.base)
                      for h in range(H)])
        gate = qg[:, Dh:]
        k = (t[pre + "attn_k.weight"] @ x).reshape(Hkv, Dh)
        k = np.stack([rotate(rms(k[h], t[pre + "attn_k_norm.weight"], eps), p, self.n_rot, self.base)
                      for h in range(Hkv)])
        st["k"].append(k)
        st["v"].append((t[pre + "attn_v.weight"] @ x).reshape(Hkv, Dh))
        cells = list(range(p + 1))
        if ratio:
            st["ik"].append(t[pre + "indexer.k_proj.weight"] @ x)
            cells = self.qsa_cells(x, p, st["ik"], pre, ratio)
        K, V = np.array(st["k"]), np.array(st["v"])
        out = np.zeros((H, Dh))
        for h in range(H):
            kv = h // (H // Hkv)
            sc = np.array([q[h] @ K[c, kv] for c in cells]) / math.sqrt(Dh)
            pr = np.exp(sc - sc.max())
            pr /= pr.sum()
            out[h] = sum(pr[i] * V[c, kv] for i, c in enumerate(cells))
        return t[pre + "attn_output.weight"] @ (out * sigmoid(gate)).reshape(-1)

    def qsa_cells(self, x, p, keys, pre, r):
        """Positions query p attends to: the best top_k / r complete blocks
        (ties to the earlier block) and the incomplete tail block."""
        t, m, eps = self.t, self.m, self.eps
        Hi, Di = int(m["attention.indexer.head_count"]), int(m["attention.indexer.key_length"])
        n_keep = int(m["attention.indexer.top_k"]) // r
        q = (t[pre + "indexer.q_proj.weight"] @ x).reshape(Hi, Di)
        q = np.stack([rotate(rms(q[h], t[pre + "indexer.q_norm.weight"], eps), p, self.n_rot, self.base)
                      for h in range(Hi)])
        n_complete = (p + 1) // r
        scored = []
        for b in range(n_complete):
            kb = rms(np.mean(keys[b * r:(b + 1) * r], 0), t[pre + "indexer.k_norm.weight"], eps)
            kb = rotate(kb, b * r, self.n_rot, self.base)
            scored.append((-sum(max(0.0, float(q[h] @ kb)) for h in range(Hi)), b))
        chosen = sorted(b for _, b in sorted(scored)[:n_keep])
        return [c for b in chosen for c in range(b * r, b * r + r)] + list(range(n_complete * r, p + 1))

    def moe(self, x, pre):
        t, m = self.t, self.m
        n_used = int(m["expert_used_count"])
        logits = t[pre + "ffn_gate_inp.weight"] @ x
        pr = np.exp(logits - logits.max())
        pr /= pr.sum()
        top = np.argsort(-pr, kind="stable")[:n_used]
        w = pr[top] / pr[top].sum()
        out = np.zeros(self.d)
        for e, we in zip(top, w):
            h = silu(t[pre + "ffn_gate_exps.weight"][e] @ x) * (t[pre + "ffn_up_exps.weight"][e] @ x)
            out += we * (t[pre + "ffn_down_exps.weight"][e] @ h)
        sh = silu(t[pre + "ffn_gate_shexp.weight"] @ x) * (t[pre + "ffn_up_shexp.weight"] @ x)
        gate = sigmoid(float(t[pre + "ffn_gate_inp_shexp.weight"].reshape(-1) @ x))
        return out + gate * (t[pre + "ffn_down_shexp.weight"] @ sh)

    # ------------------------------------------------------------------
    def mtp_logits(self, hidden, next_tokens):
        """MTP head logits for pairs (hidden[j], next_tokens[j]) at
        positions 0..n-1, dense attention over the earlier pairs."""
        t, S, d, eps = self.t, self.S, self.d, self.eps
        il = self.n_layer
        pre = f"blk.{il}."
        st = {"k": [], "v": [], "ik": []}
        out = []
        for j, (h, tok) in enumerate(zip(hidden, next_tokens)):
            e = rms(t["token_embd.weight"][tok], t[pre + "nextn.enorm.weight"], eps)
            X = np.stack([t[pre + "nextn.eh_proj.weight"] @ np.concatenate(
                [e, rms(h[s], t[pre + "nextn.hnorm.weight"][s * d:(s + 1) * d], eps)]) for s in range(S)])
            x, inj = self.hc_read(X, pre + "hc_attn_")
            X = X + inj[:, None] * self.attn(x, j, st, pre, 0)[None]
            x, inj = self.hc_read(X, pre + "hc_ffn_")
            X = X + inj[:, None] * self.moe(x, pre)[None]
            mixed, _ = self.hc_read(X, pre + "nextn.hc_head_")
            out.append(t["output.weight"] @ mixed)
        return np.array(out)

"""An independent float64 numpy forward pass of Kimi K3, written from docs/model.md
("Forward pass"), for small synthetic checkpoints.

It shares no code with our engine or with llama.cpp, so when it agrees with llama.cpp
its logits are a second reference, and its per-layer states localize a disagreement.

Usage:
  python numpy_forward.py MODEL_DIR IDS OUT.f32 [--layers-out DIR]
IDS is comma-separated token ids; OUT gets little-endian f32 [positions x vocab].
--layers-out writes DIR/l_out-{i}.f64 (the hidden state h after layer i, [T x H]).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from k3_checkpoint import load_config, load_text_tensors

L2_EPS = 1e-6  # KDA q/k l2 normalization (section 4.2 step 3); --l2-eps overrides


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def rms(x, w, eps):
    """Row-wise RMSNorm over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


class K3:
    def __init__(self, model_dir: Path, l2_eps: float = L2_EPS):
        self.l2_eps = l2_eps
        _, self.cfg = load_config(model_dir)
        self.w = {k: v.astype(np.float64) for k, v in load_text_tensors(model_dir).items()}
        c = self.cfg
        self.eps = c["rms_norm_eps"]
        self.la = c["linear_attn_config"]
        self.full = set(self.la["full_attn_layers"])  # 1-based

    def t(self, name):
        try:
            return self.w[name]
        except KeyError:
            raise KeyError(f"tensor {name} missing from the checkpoint") from None

    # --- 4.1 AttnRes ---
    def mix(self, bank, cur, w):
        """bank: list of [T, H]; cur: [T, H]; w: [H]."""
        entries = np.stack(bank + [cur], axis=0)  # [J, T, H]
        normed = entries / np.sqrt(np.mean(entries**2, axis=-1, keepdims=True) + self.eps)
        score = np.einsum("jth,h->jt", normed, w)
        score = score - score.max(axis=0, keepdims=True)
        p = np.exp(score)
        p /= p.sum(axis=0, keepdims=True)
        return np.einsum("jt,jth->th", p, entries)

    def res_w(self, i, kind):
        p = f"model.layers.{i}."
        return (self.t(p + f"{kind}_res_norm.weight") * self.t(p + f"{kind}_res_proj.weight")).reshape(-1)

    # --- 4.2 KDA ---
    def kda(self, i, x):
        p = f"model.layers.{i}.self_attn."
        T = x.shape[0]
        nh, hd = self.la["num_heads"], self.la["head_dim"]
        K = self.la["short_conv_kernel_size"]

        def conv(name, inp):
            w = self.t(p + name).reshape(inp.shape[1], K)
            padded = np.concatenate([np.zeros((K - 1, inp.shape[1])), inp], axis=0)
            out = np.zeros_like(inp)
            for j in range(K):
                out += w[:, j] * padded[j : j + T]
            return silu(out)

        q = conv("q_conv1d.weight", x @ self.t(p + "q_proj.weight").T).reshape(T, nh, hd)
        k = conv("k_conv1d.weight", x @ self.t(p + "k_proj.weight").T).reshape(T, nh, hd)
        v = conv("v_conv1d.weight", x @ self.t(p + "v_proj.weight").T).reshape(T, nh, hd)
        q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + self.l2_eps) * hd**-0.5
        k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + self.l2_eps)

        z = (x @ self.t(p + "f_a_proj.weight").T) @ self.t(p + "f_b_proj.weight").T
        z = (z + self.t(p + "dt_bias").reshape(-1)).reshape(T, nh, hd)
        a_log = self.t(p + "A_log").reshape(-1)[:nh]
        lb = self.la.get("gate_lower_bound")
        if lb is not None:
            g = lb * sigmoid(np.exp(a_log)[None, :, None] * z)
        else:
            g = -np.exp(a_log)[None, :, None] * np.logaddexp(0.0, z)
        alpha = np.exp(g)
        beta = sigmoid(x @ self.t(p + "b_proj.weight").T)  # [T, nh]

        o = np.zeros((T, nh, hd))
        S = np.zeros((nh, hd, hd))  # [h][k][v]
        for t in range(T):
            for h in range(nh):
                S[h] = alpha[t, h][:, None] * S[h]
                u = S[h].T @ k[t, h]
                S[h] = S[h] + np.outer(k[t, h], beta[t, h] * (v[t, h] - u))
                o[t, h] = S[h].T @ q[t, h]
        o = rms(o, self.t(p + "o_norm.weight"), self.eps)
        gate = sigmoid(x @ self.t(p + "g_proj.weight").T).reshape(T, nh, hd)
        return (o * gate).reshape(T, nh * hd) @ self.t(p + "o_proj.weight").T

    # --- 4.3 MLA ---
    def mla(self, i, x):
        c = self.cfg
        p = f"model.layers.{i}.self_attn."
        T = x.shape[0]
        nh = c["num_attention_heads"]
        nope, rope, vd, kvl = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        q = rms(x @ self.t(p + "q_a_proj.weight").T, self.t(p + "q_a_layernorm.weight"), self.eps)
        q = (q @ self.t(p + "q_b_proj.weight").T).reshape(T, nh, nope + rope)
        ckv = x @ self.t(p + "kv_a_proj_with_mqa.weight").T
        lat = rms(ckv[:, :kvl], self.t(p + "kv_a_layernorm.weight"), self.eps)
        r = ckv[:, kvl:]
        kvb = self.t(p + "kv_b_proj.weight").reshape(nh, nope + vd, kvl)
        out = np.zeros((T, nh, vd))
        mask = np.tril(np.ones((T, T), dtype=bool))
        for h in range(nh):
            kh = lat @ kvb[h, :nope].T  # [T, nope]
            vh = lat @ kvb[h, nope:].T  # [T, vd]
            s = (q[:, h, :nope] @ kh.T + q[:, h, nope:] @ r.T) / np.sqrt(nope + rope)
            s = np.where(mask, s, -np.inf)
            s = s - s.max(axis=1, keepdims=True)
            pr = np.exp(s)
            pr /= pr.sum(axis=1, keepdims=True)
            out[:, h] = pr @ vh
        o = out.reshape(T, nh * vd) * sigmoid(x @ self.t(p + "g_proj.weight").T)
        return o @ self.t(p + "o_proj.weight").T

    # --- 4.4 FFN ---
    def situ(self, g, u):
        b, bl = self.cfg["activation_situ_beta"], self.cfg["activation_situ_linear_beta"]
        return b * np.tanh(g / b) * sigmoid(g) * bl * np.tanh(u / bl)

    def dense(self, i, x):
        p = f"model.layers.{i}.mlp."
        h = self.situ(x @ self.t(p + "gate_proj.weight").T, x @ self.t(p + "up_proj.weight").T)
        return h @ self.t(p + "down_proj.weight").T

    def moe(self, i, x, chosen_log=None):
        c = self.cfg
        p = f"model.layers.{i}.block_sparse_moe."
        T = x.shape[0]
        topk = c["num_experts_per_token"]
        s = sigmoid(x @ self.t(p + "gate.weight").T)  # [T, E]
        biased = s + self.t(p + "gate.e_score_correction_bias").reshape(-1)
        z = x @ self.t(p + "routed_expert_down_proj.weight").T  # [T, D]
        u = np.zeros_like(z)
        for t in range(T):
            # stable sort on -score: ties go to the lower index
            sel = np.argsort(-biased[t], kind="stable")[:topk]
            wts = s[t, sel] / (s[t, sel].sum() + 1e-20) * c["routed_scaling_factor"]
            if chosen_log is not None:
                chosen_log.append((i, t, sel.tolist(), np.sort(biased[t])[::-1][: topk + 1].tolist()))
            for e, we in zip(sel, wts):
                q = f"{p}experts.{e}."
                hmid = self.situ(self.t(q + "w1.weight") @ z[t], self.t(q + "w3.weight") @ z[t])
                u[t] += we * (self.t(q + "w2.weight") @ hmid)
        y = rms(u, self.t(p + "routed_expert_norm.weight"), self.eps) @ self.t(p + "routed_expert_up_proj.weight").T
        sp = p + "shared_experts."
        sh = self.situ(x @ self.t(sp + "gate_proj.weight").T, x @ self.t(sp + "up_proj.weight").T)
        return y + sh @ self.t(sp + "down_proj.weight").T

    # --- whole model ---
    def forward(self, ids, layers_out: Path | None = None, chosen_log=None):
        c = self.cfg
        bs = c["attn_res_block_size"]
        h = self.t("model.embed_tokens.weight")[np.asarray(ids)]
        bank: list[np.ndarray] = []
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = self.mix(bank, h, self.res_w(i, "self_attention")) if bank else h
            banked = i % bs == 0
            if banked:
                bank.append(h)
            xn = rms(x, self.t(p + "input_layernorm.weight"), self.eps)
            a = self.mla(i, xn) if (i + 1) in self.full else self.kda(i, xn)
            pre = a if banked else h + a
            xf = rms(self.mix(bank, pre, self.res_w(i, "mlp")), self.t(p + "post_attention_layernorm.weight"), self.eps)
            f = self.dense(i, xf) if i < c["first_k_dense_replace"] else self.moe(i, xf, chosen_log)
            h = pre + f
            if layers_out is not None:
                h.astype("<f8").tofile(layers_out / f"l_out-{i}.f64")
        w_out = (self.t("model.output_attn_res_norm.weight") * self.t("model.output_attn_res_proj.weight")).reshape(-1)
        final = rms(self.mix(bank, h, w_out), self.t("model.norm.weight"), self.eps)
        return final @ self.t("lm_head.weight").T


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("ids")
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers-out", type=Path)
    ap.add_argument("--l2-eps", type=float, default=L2_EPS,
                    help="KDA q/k l2-norm eps (1e-5 reproduces llama.cpp, which uses rms_norm_eps)")
    ap.add_argument("--routing-log", type=Path, help="write the chosen experts and top scores per layer/token")
    args = ap.parse_args()
    ids = [int(s) for s in args.ids.split(",") if s]
    if args.layers_out:
        args.layers_out.mkdir(parents=True, exist_ok=True)
    log = [] if args.routing_log else None
    logits = K3(args.model_dir, args.l2_eps).forward(ids, args.layers_out, log)
    logits.astype("<f4").tofile(args.out)
    if args.routing_log:
        with open(args.routing_log, "w") as f:
            for layer, t, sel, top in log:
                f.write(f"layer {layer} pos {t} experts {sel} top biased scores {['%.6f' % s for s in top]}\n")
    print(f"wrote {logits.shape[0]} x {logits.shape[1]} logits to {args.out}")


if __name__ == "__main__":
    main()

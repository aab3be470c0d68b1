// The fused KDA step, one workgroup per head, the chunk's tokens in order inside the
// kernel: causal conv + SiLU (history advanced in place), l2 norms of q and k, decay gate,
// delta-rule update of the head's state S[k][v] (in global memory, never leaving the GPU),
// output q·S, gated RMSNorm.
//
// inp   = q | k | v | f | gate (each [n, P]) | beta ([n, heads])
// wts   = conv_q | conv_k | conv_v (each [P, K]) | A_log [heads] | dt_bias [P] | o_norm [dk]
// state = hist_q | hist_k | hist_v (each [K-1, P]) | S [heads, dk, dk]

const MAX_D: u32 = 256u;

struct KdaParams {
    n: u32,
    heads: u32,
    dk: u32,
    conv_k: u32,
    has_lb: u32,
    lower_bound: f32,
    norm_eps: f32,
    l2_eps: f32,
}

@group(0) @binding(0) var<uniform> p: KdaParams;
@group(0) @binding(1) var<storage, read> inp: array<f32>;
@group(0) @binding(2) var<storage, read> wts: array<f32>;
@group(0) @binding(3) var<storage, read_write> st: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

var<workgroup> sq: array<f32, MAX_D>;
var<workgroup> sk: array<f32, MAX_D>;
var<workgroup> sv: array<f32, MAX_D>;
var<workgroup> sa: array<f32, MAX_D>;
// Partial column sums of the state pass, one per lane.
var<workgroup> spart: array<f32, 256>;

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

fn silu(v: f32) -> f32 {
    return v * sigmoid(v);
}

fn softplus(v: f32) -> f32 {
    if (v > 20.0) {
        return v;
    }
    return log(1.0 + exp(v));
}

// Conv + SiLU of channel c of stream m (0 q, 1 k, 2 v) for the token at `row`, advancing
// that channel's history.
fn conv(m: u32, c: u32, row: u32, pw: u32) -> f32 {
    let k = p.conv_k;
    let taps = m * pw * k + c * k;
    let hist = m * (k - 1u) * pw;
    let x = inp[m * p.n * pw + row * pw + c];
    var acc = wts[taps + k - 1u] * x;
    for (var j = 0u; j + 1u < k; j++) {
        acc += wts[taps + j] * st[hist + j * pw + c];
    }
    if (k > 1u) {
        for (var j = 0u; j + 2u < k; j++) {
            st[hist + j * pw + c] = st[hist + (j + 1u) * pw + c];
        }
        st[hist + (k - 2u) * pw + c] = x;
    }
    return silu(acc);
}

@compute @workgroup_size(WG)
fn kda(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let lid = lanes.lid;
    let h = wg.x;
    let dk = p.dk;
    let pw = p.heads * dk;
    let w_alog = 3u * pw * p.conv_k;
    let w_dt = w_alog + p.heads;
    let w_onorm = w_dt + pw;
    let s_base = 3u * (p.conv_k - 1u) * pw + h * dk * dk;
    let a = exp(wts[w_alog + h]);
    let q_scale = 1.0 / sqrt(f32(dk));
    for (var t = 0u; t < p.n; t++) {
        var ssq = 0.0;
        var ssk = 0.0;
        for (var i = lid; i < dk; i += WG) {
            let c = h * dk + i;
            let qv = conv(0u, c, t, pw);
            let kv = conv(1u, c, t, pw);
            sq[i] = qv;
            sk[i] = kv;
            sv[i] = conv(2u, c, t, pw);
            ssq += qv * qv;
            ssk += kv * kv;
            let z = inp[3u * p.n * pw + t * pw + c] + wts[w_dt + c];
            var g: f32;
            if (p.has_lb != 0u) {
                g = p.lower_bound * sigmoid(a * z);
            } else {
                g = -a * softplus(z);
            }
            sa[i] = exp(g);
        }
        let qn = q_scale / sqrt(wg_sum(ssq) + p.l2_eps);
        let kn = 1.0 / sqrt(wg_sum(ssk) + p.l2_eps);
        for (var i = lid; i < dk; i += WG) {
            sq[i] = sq[i] * qn;
            sk[i] = sk[i] * kn;
        }
        workgroupBarrier();
        let b = sigmoid(inp[5u * p.n * pw + t * p.heads + h]);
        // The state pass: column j of S takes u = Σ_i S[i][j]·a_i·k_i, then the update and
        // o_j = Σ_i S'[i][j]·q_i. With dk < WG the rows are split among `parts` lanes per
        // column (all WG lanes busy, fewer serial loads each) and the partial sums meet in
        // workgroup memory; with one part the sums are the plain serial ones.
        let parts = max(WG / dk, 1u);
        let step = WG / parts;
        let part = lid / step;
        let rp = (dk + parts - 1u) / parts;
        let i0 = min(part * rp, dk);
        let i1 = min(i0 + rp, dk);
        var oss = 0.0;
        for (var jb = 0u; jb < dk; jb += step) {
            let j = jb + lid % step;
            let live = j < dk;
            let jj = min(j, dk - 1u);
            var u = 0.0;
            if (live) {
                for (var i = i0; i < i1; i++) {
                    u += (st[s_base + i * dk + jj] * sa[i]) * sk[i];
                }
            }
            spart[lid] = u;
            workgroupBarrier();
            var ut = 0.0;
            for (var k = 0u; k < parts; k++) {
                ut += spart[k * step + lid % step];
            }
            workgroupBarrier();
            let delta = b * (sv[jj] - ut);
            var o = 0.0;
            if (live) {
                for (var i = i0; i < i1; i++) {
                    let s = st[s_base + i * dk + jj] * sa[i] + sk[i] * delta;
                    st[s_base + i * dk + jj] = s;
                    o += s * sq[i];
                }
            }
            spart[lid] = o;
            workgroupBarrier();
            if (live && part == 0u) {
                var ot = 0.0;
                for (var k = 0u; k < parts; k++) {
                    ot += spart[k * step + lid % step];
                }
                out[t * pw + h * dk + j] = ot;
                oss += ot * ot;
            }
            workgroupBarrier();
        }
        let r = 1.0 / sqrt(wg_sum(oss) / f32(dk) + p.norm_eps);
        for (var j = lid; j < dk; j += WG) {
            let gate = inp[4u * p.n * pw + t * pw + h * dk + j];
            let o = out[t * pw + h * dk + j];
            out[t * pw + h * dk + j] = o * r * wts[w_onorm + j] * sigmoid(gate);
        }
    }
}

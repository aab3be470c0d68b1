// The KDA step. A token or a few run `kda_fused`, one workgroup per head doing every step;
// chunks run three passes:
// 1. `kda_conv`, one lane per channel: causal conv + SiLU of q, k, v for every token in
//    order (history advanced in place) and the decay gate exp(g), into `mid`;
// 2. `kda_state`, one workgroup per (head, group of CG state columns), the tokens in order:
//    l2 norms of q and k, delta-rule update of its columns of S[k][v] (in global memory,
//    never leaving the GPU) and their outputs q·S, into `out`;
// 3. `kda_norm`, one workgroup per (token, head): the gated RMSNorm of the output.
// Splitting the columns is what lets a head use more than one workgroup: one workgroup per
// head (96 on K3) walked every column's rows in turn.
//
// inp   = q | k | v | f | gate (each [n_all, P]) | beta ([n_all, heads]); a call runs its n
//         rows from row0 on and writes them to rows orow0 on of `out` (`kda_fused` runs one
//         piece of a batch of sequences so, into an output of its own; the three passes run
//         a whole call: row0 and orow0 0, n_all n)
// wts   = conv_q | conv_k | conv_v (each [P, K]) | A_log [heads] | dt_bias [P] | o_norm [dk]
// state = hist_q | hist_k | hist_v (each [K-1, P]) | S [heads, dk, dk]
// mid   = q | k | v (conv + SiLU) | exp(g) (each [n, P])

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
    row0: u32,
    n_all: u32,
    orow0: u32,
}

@group(0) @binding(0) var<uniform> p: KdaParams;
@group(0) @binding(1) var<storage, read> inp: array<f32>;
@group(0) @binding(2) var<storage, read> wts: array<f32>;
@group(0) @binding(3) var<storage, read_write> st: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> mid: array<f32>;

// State columns of one `kda_state` workgroup.
override CG: u32 = 16u;

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
    let x = inp[m * p.n_all * pw + (p.row0 + row) * pw + c];
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

// exp(g), the decay of a channel whose gate input (f + dt_bias) is z, a = exp(A_log[head]).
fn decay(a: f32, z: f32) -> f32 {
    if (p.has_lb != 0u) {
        return exp(p.lower_bound * sigmoid(a * z));
    }
    return exp(-a * softplus(z));
}

// l2-normalizes the staged q and k (sum of squares ssq, ssk of this lane's elements); q
// also takes 1/sqrt(dk).
fn normalize_qk(lid: u32, ssq: f32, ssk: f32) {
    let qn = (1.0 / sqrt(f32(p.dk))) / sqrt(wg_sum(ssq) + p.l2_eps);
    let kn = 1.0 / sqrt(wg_sum(ssk) + p.l2_eps);
    for (var i = lid; i < p.dk; i += WG) {
        sq[i] = sq[i] * qn;
        sk[i] = sk[i] * kn;
    }
    workgroupBarrier();
}

// Rows i .. i + 3 of state column j (head at s_base), and whether each is below `end`; rows
// at or past `end` read row end - 1 (end > i).
struct Rows4 {
    v: vec4<f32>,
    live: vec4<bool>,
}

fn st4(s_base: u32, i: u32, j: u32, end: u32) -> Rows4 {
    let is = vec4<u32>(i, i + 1u, i + 2u, i + 3u);
    let r = min(is, vec4<u32>(end - 1u)) * p.dk + vec4<u32>(s_base + j);
    return Rows4(vec4<f32>(st[r.x], st[r.y], st[r.z], st[r.w]), is < vec4<u32>(end));
}

// Entries i .. i + 3 of a staged vector (indices kept inside the array).
fn sa4(i: u32) -> vec4<f32> {
    let is = min(vec4<u32>(i, i + 1u, i + 2u, i + 3u), vec4<u32>(MAX_D - 1u));
    return vec4<f32>(sa[is.x], sa[is.y], sa[is.z], sa[is.w]);
}

fn sk4(i: u32) -> vec4<f32> {
    let is = min(vec4<u32>(i, i + 1u, i + 2u, i + 3u), vec4<u32>(MAX_D - 1u));
    return vec4<f32>(sk[is.x], sk[is.y], sk[is.z], sk[is.w]);
}

fn sq4(i: u32) -> vec4<f32> {
    let is = min(vec4<u32>(i, i + 1u, i + 2u, i + 3u), vec4<u32>(MAX_D - 1u));
    return vec4<f32>(sq[is.x], sq[is.y], sq[is.z], sq[is.w]);
}

// Updates rows i .. i + 3 of column j (read as `r`; only the live ones are written) and
// returns their terms of o_j.
fn update4(r: Rows4, s_base: u32, i: u32, j: u32, delta: f32) -> vec4<f32> {
    let s = r.v * sa4(i) + sk4(i) * delta;
    for (var k = 0u; k < 4u; k++) {
        if (r.live[k]) {
            st[s_base + (i + k) * p.dk + j] = s[k];
        }
    }
    return select(vec4<f32>(0.0), s * sq4(i), r.live);
}

// The state pass over columns j0 .. j0 + jc - 1 of the head's S (at s_base) for one token
// with gate b: column j takes u = Σ_i S[i][j]·a_i·k_i, then the update, and
// o_j = Σ_i S'[i][j]·q_i, written to out[orow + j]. Each column is worked by `parts` lanes,
// `step` apart, that split its rows; their partial sums meet in workgroup memory (one part:
// the plain serial sums). Returns o_j on the lane that wrote it, else 0.
// A lane reads eight of its rows before using any: one load per iteration waited out the
// memory latency once per row (64 rows a lane on K3 in decode), the pattern that made
// one-workgroup kernels run at 2-20 times an element-wise pass (docs/perf.md#kernels).
fn update_columns(lid: u32, s_base: u32, orow: u32, j0: u32, jc: u32, step: u32, b: f32) -> f32 {
    let dk = p.dk;
    let parts = WG / step;
    let part = lid / step;
    let rp = (dk + parts - 1u) / parts;
    let i0 = min(part * rp, dk);
    let i1 = min(i0 + rp, dk);
    let jl = lid % step;
    let live = jl < jc;
    let j = j0 + min(jl, jc - 1u);
    var uv = vec4<f32>(0.0);
    if (live) {
        for (var i = i0; i < i1; i += 8u) {
            let r0 = st4(s_base, i, j, i1);
            let r1 = st4(s_base, i + 4u, j, i1);
            uv += select(vec4<f32>(0.0), (r0.v * sa4(i)) * sk4(i), r0.live);
            uv += select(vec4<f32>(0.0), (r1.v * sa4(i + 4u)) * sk4(i + 4u), r1.live);
        }
    }
    spart[lid] = (uv.x + uv.y) + (uv.z + uv.w);
    workgroupBarrier();
    var ut = 0.0;
    for (var k = 0u; k < parts; k++) {
        ut += spart[k * step + jl];
    }
    workgroupBarrier();
    let delta = b * (sv[j] - ut);
    var ov = vec4<f32>(0.0);
    if (live) {
        for (var i = i0; i < i1; i += 8u) {
            // Both reads before either write, so all eight are in flight together.
            let r0 = st4(s_base, i, j, i1);
            let r1 = st4(s_base, i + 4u, j, i1);
            ov += update4(r0, s_base, i, j, delta);
            ov += update4(r1, s_base, i + 4u, j, delta);
        }
    }
    spart[lid] = (ov.x + ov.y) + (ov.z + ov.w);
    workgroupBarrier();
    var ot = 0.0;
    if (live && part == 0u) {
        for (var k = 0u; k < parts; k++) {
            ot += spart[k * step + jl];
        }
        out[orow + j] = ot;
    }
    workgroupBarrier();
    return ot;
}

// The gated RMSNorm of one (token, head) output row at out[orow ..], whose gate is at input
// row `row` and whose squares this lane has summed into oss.
fn gated_norm(lid: u32, row: u32, orow: u32, oss: f32) {
    let pw = p.heads * p.dk;
    let w_onorm = 3u * pw * p.conv_k + p.heads + pw;
    let r = 1.0 / sqrt(wg_sum(oss) / f32(p.dk) + p.norm_eps);
    for (var j = lid; j < p.dk; j += WG) {
        let gate = inp[4u * p.n_all * pw + row + j];
        out[orow + j] = out[orow + j] * r * wts[w_onorm + j] * sigmoid(gate);
    }
}

// Decode (a token or few): every step in one workgroup per head, tokens in order. Cheaper
// than the three passes below for a single token (their launches and the `mid` round trip
// outweigh the column split); slower per token on chunks.
@compute @workgroup_size(WG)
fn kda_fused(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let lid = lanes.lid;
    let h = wg.x;
    let dk = p.dk;
    let pw = p.heads * dk;
    let w_dt = 3u * pw * p.conv_k + p.heads;
    let s_base = 3u * (p.conv_k - 1u) * pw + h * dk * dk;
    let a = exp(wts[3u * pw * p.conv_k + h]);
    // With dk < WG each column's rows are split over WG / dk lanes (all lanes busy).
    let step = WG / max(WG / dk, 1u);
    for (var t = 0u; t < p.n; t++) {
        var ssq = 0.0;
        var ssk = 0.0;
        let at = p.row0 + t;
        let row = at * pw + h * dk;
        let orow = (p.orow0 + t) * pw + h * dk;
        for (var i = lid; i < dk; i += WG) {
            let c = h * dk + i;
            let qv = conv(0u, c, t, pw);
            let kv = conv(1u, c, t, pw);
            sq[i] = qv;
            sk[i] = kv;
            sv[i] = conv(2u, c, t, pw);
            ssq += qv * qv;
            ssk += kv * kv;
            sa[i] = decay(a, inp[3u * p.n_all * pw + at * pw + c] + wts[w_dt + c]);
        }
        normalize_qk(lid, ssq, ssk);
        let b = sigmoid(inp[5u * p.n_all * pw + at * p.heads + h]);
        var oss = 0.0;
        for (var jb = 0u; jb < dk; jb += step) {
            let o = update_columns(lid, s_base, orow, jb, min(step, dk - jb), step, b);
            oss += o * o;
        }
        gated_norm(lid, row, orow, oss);
    }
}

@compute @workgroup_size(WG)
fn kda_conv(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let pw = p.heads * p.dk;
    let i = gid.x + gid.y * nwg.x * WG;
    if (i >= 4u * pw) {
        return;
    }
    let m = i / pw;
    let c = i % pw;
    if (m < 3u) {
        for (var t = 0u; t < p.n; t++) {
            mid[m * p.n * pw + t * pw + c] = conv(m, c, t, pw);
        }
        return;
    }
    let w_dt = 3u * pw * p.conv_k + p.heads;
    let a = exp(wts[3u * pw * p.conv_k + c / p.dk]);
    for (var t = 0u; t < p.n; t++) {
        mid[3u * p.n * pw + t * pw + c] = decay(a, inp[3u * p.n * pw + t * pw + c] + wts[w_dt + c]);
    }
}

// One workgroup per (head, CG state columns), the tokens in order.
@compute @workgroup_size(WG)
fn kda_state(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let lid = lanes.lid;
    let h = wg.x;
    let dk = p.dk;
    let pw = p.heads * dk;
    let s_base = 3u * (p.conv_k - 1u) * pw + h * dk * dk;
    let j0 = wg.y * CG;
    for (var t = 0u; t < p.n; t++) {
        var ssq = 0.0;
        var ssk = 0.0;
        let row = t * pw + h * dk;
        for (var i = lid; i < dk; i += WG) {
            let qv = mid[row + i];
            let kv = mid[p.n * pw + row + i];
            sq[i] = qv;
            sk[i] = kv;
            sv[i] = mid[2u * p.n * pw + row + i];
            sa[i] = mid[3u * p.n * pw + row + i];
            ssq += qv * qv;
            ssk += kv * kv;
        }
        normalize_qk(lid, ssq, ssk);
        let b = sigmoid(inp[5u * p.n * pw + t * p.heads + h]);
        update_columns(lid, s_base, row, j0, min(CG, dk - j0), CG, b);
    }
}

@compute @workgroup_size(WG)
fn kda_norm(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let lid = lanes.lid;
    let row = wg.x * p.heads * p.dk + wg.y * p.dk;
    var oss = 0.0;
    for (var j = lid; j < p.dk; j += WG) {
        let o = out[row + j];
        oss += o * o;
    }
    gated_norm(lid, row, row, oss);
}

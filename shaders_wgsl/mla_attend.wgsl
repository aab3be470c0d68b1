// Absorbed MLA attention over the latent cache (which never leaves the GPU). The cache is
// [capacity, cs] rows of (normalized latent | rope | zero pad), cs a multiple of 4, so the
// scores are an f32 matvec with the cache as the matrix (matvec_f32.wgsl), and:
//   append  — normalize each new latent and write it (and its rope part) at pos0 + t;
//   qabs    — X[t·h + hh] = (q_nope·W_k[hh] | q_rope | 0): the query in cache space;
//   softmax — causal softmax of scale·scores over positions ≤ pos0 + t;
//   ctx     — ctx[t·h + hh] = Σ_p prob · latent[p], for 8 heads per workgroup, positions
//             split in chunks of `plen` (partial sums, added up by ctx_sum);
//   outv    — out[t, hh·v + j] = W_v[hh, j] · ctx[t·h + hh].

const HT: u32 = 8u;
override LPR: u32 = 32u;

struct MlaParams {
    n: u32,
    heads: u32,
    kv: u32,
    rope: u32,
    nope: u32,
    v: u32,
    cs: u32,
    pos0: u32,
    total: u32,
    eps: f32,
    scale: f32,
    // Positions per `ctx` chunk.
    plen: u32,
    // The call's first row in q, c and out: a piece of a batch of sequences reads and
    // writes its rows in place (the other buffers are the piece's own).
    row0: u32,
}

@group(0) @binding(0) var<uniform> p: MlaParams;
// Bindings: a (first input), o (output), b (second input, absent from softmax).
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> o: array<f32>;
@group(0) @binding(3) var<storage, read> b: array<f32>;

// a = c ([row0 + n, kv + rope]), b = kv_norm, o = cache.
@compute @workgroup_size(WG)
fn append(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let t = wg.x;
    let cw = p.kv + p.rope;
    let src = (p.row0 + t) * cw;
    var ss = 0.0;
    for (var c = lanes.lid; c < p.kv; c += WG) {
        let x = a[src + c];
        ss += x * x;
    }
    let s = 1.0 / sqrt(wg_sum(ss) / f32(p.kv) + p.eps);
    let dst = (p.pos0 + t) * p.cs;
    for (var c = lanes.lid; c < p.cs; c += WG) {
        var val = 0.0;
        if (c < p.kv) {
            val = a[src + c] * s * b[c];
        } else if (c < cw) {
            val = a[src + c];
        }
        o[dst + c] = val;
    }
}

// a = q ([row0 + n, heads·(nope+rope)]), b = W_k ([heads·nope, kv]), o = X ([n·heads, cs]).
@compute @workgroup_size(WG)
fn qabs(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, lanes: Lanes) {
    let row = wg.x + wg.y * nwg.x;
    if (row >= p.n * p.heads) {
        return;
    }
    let t = row / p.heads;
    let hh = row % p.heads;
    let qw = p.nope + p.rope;
    let qb = (p.row0 + t) * p.heads * qw + hh * qw;
    for (var c = lanes.lid; c < p.cs; c += WG) {
        var val = 0.0;
        if (c < p.kv) {
            // Four independent partial sums, so four loads of W_k are in flight per lane
            // instead of one at a time down the 128 rows.
            let wb = hh * p.nope * p.kv + c;
            var s0 = 0.0;
            var s1 = 0.0;
            var s2 = 0.0;
            var s3 = 0.0;
            var i = 0u;
            for (; i + 3u < p.nope; i += 4u) {
                s0 += a[qb + i] * b[wb + i * p.kv];
                s1 += a[qb + i + 1u] * b[wb + (i + 1u) * p.kv];
                s2 += a[qb + i + 2u] * b[wb + (i + 2u) * p.kv];
                s3 += a[qb + i + 3u] * b[wb + (i + 3u) * p.kv];
            }
            for (; i < p.nope; i++) {
                s0 += a[qb + i] * b[wb + i * p.kv];
            }
            val = (s0 + s1) + (s2 + s3);
        } else if (c < p.kv + p.rope) {
            val = a[qb + p.nope + c - p.kv];
        }
        o[row * p.cs + c] = val;
    }
}

// a = scores ([n·heads, total]), o = probabilities (same shape; masked ones are 0).
@compute @workgroup_size(WG)
fn softmax(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let ri = wg.x + wg.y * nwg.x;
    let row = min(ri, p.n * p.heads - 1u);
    let t = row / p.heads;
    let len = p.pos0 + t + 1u;
    let base = row * p.total;
    var m = -3.4e38;
    for (var i = lanes.lid; i < len; i += WG) {
        m = max(m, a[base + i] * p.scale);
    }
    let mx = wg_max(m);
    var tot = 0.0;
    for (var i = lanes.lid; i < len; i += WG) {
        tot += exp(a[base + i] * p.scale - mx);
    }
    let sum = wg_sum(tot);
    for (var i = lanes.lid; i < p.total && ri == row; i += WG) {
        var pr = 0.0;
        if (i < len) {
            pr = exp(a[base + i] * p.scale - mx) / sum;
        }
        o[base + i] = pr;
    }
}

// a = probabilities, b = cache, o = partial ctx ([chunks, n·heads, kv]; with one chunk, the
// ctx itself). wg = (column block, head tile, t · chunks + chunk). Each workgroup walks one
// chunk of positions: a single workgroup per head tile walking a whole 4096-position cache
// left most of the GPU idle.
@compute @workgroup_size(WG)
fn ctx(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let c = wg.x * WG + lid;
    let h0 = wg.y * HT;
    let chunks = (p.total + p.plen - 1u) / p.plen;
    let t = wg.z / chunks;
    let ch = wg.z % chunks;
    let len = min(p.pos0 + t + 1u, (ch + 1u) * p.plen);
    let cc = min(c, p.kv - 1u);
    // Two positions per step into two sets of sums, so each lane has two positions' loads
    // in flight.
    var acc: array<f32, HT>;
    var acc2: array<f32, HT>;
    var pos = ch * p.plen;
    for (; pos + 1u < len; pos += 2u) {
        let l = b[pos * p.cs + cc];
        let l2 = b[(pos + 1u) * p.cs + cc];
        for (var j = 0u; j < HT; j++) {
            let hh = min(h0 + j, p.heads - 1u);
            let pr = (t * p.heads + hh) * p.total + pos;
            acc[j] += a[pr] * l;
            acc2[j] += a[pr + 1u] * l2;
        }
    }
    if (pos < len) {
        let l = b[pos * p.cs + cc];
        for (var j = 0u; j < HT; j++) {
            let hh = min(h0 + j, p.heads - 1u);
            acc[j] += a[(t * p.heads + hh) * p.total + pos] * l;
        }
    }
    for (var j = 0u; j < HT; j++) {
        acc[j] += acc2[j];
    }
    if (c < p.kv) {
        let base = (ch * p.n + t) * p.heads;
        for (var j = 0u; j < HT; j++) {
            if (h0 + j < p.heads) {
                o[(base + h0 + j) * p.kv + c] = acc[j];
            }
        }
    }
}

// a = partial ctx ([chunks, n·heads, kv]), o = ctx: the chunks' sums, in chunk order.
@compute @workgroup_size(WG)
fn ctx_sum(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wg.x + wg.y * nwg.x) * WG + lid;
    let m = p.n * p.heads * p.kv;
    if (i >= m) {
        return;
    }
    let chunks = (p.total + p.plen - 1u) / p.plen;
    var s = 0.0;
    for (var ch = 0u; ch < chunks; ch++) {
        s += a[ch * m + i];
    }
    o[i] = s;
}

// a = ctx, b = W_v ([heads·v, kv]), o = out ([row0 + n, heads·v]). wg = (row tile,
// t·heads + hh).
@compute @workgroup_size(WG)
fn outv(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let lane = lanes.lid % LPR;
    let j = wg.x * (WG / LPR) + lanes.lid / LPR;
    let jj = min(j, p.v - 1u);
    let row = wg.y;
    let hh = row % p.heads;
    var acc = 0.0;
    for (var c = lane; c < p.kv; c += LPR) {
        acc += b[(hh * p.v + jj) * p.kv + c] * a[row * p.kv + c];
    }
    let s = seg_sum(acc, LPR);
    if (lane == 0u && j < p.v) {
        o[(p.row0 * p.heads + row) * p.v + jj] = s;
    }
}

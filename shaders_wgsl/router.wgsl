// MoE router, one workgroup per token: σ(logits), top-k of σ + bias with ties to the lower
// expert id, weights from the unbiased scores (renormalized, scaled). Writes k (id, weight
// bits) pairs per token: the only thing the host reads back.

const MAX_K: u32 = 64u;

struct RouterParams {
    rows: u32,
    experts: u32,
    k: u32,
    renorm: u32,
    scaling: f32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: RouterParams;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<u32>;

var<workgroup> best_v: array<f32, 256>;
var<workgroup> best_i: array<u32, 256>;
var<workgroup> sel: array<u32, MAX_K>;
var<workgroup> sig: array<f32, MAX_K>;
// The biased scores, computed once: each of the k rounds used to reload the logits and the
// bias and recompute σ, and one-workgroup kernels that load from memory once per loop
// iteration ran at 2–20 times an element-wise pass (docs/perf.md#kernels).
// Routers with more experts than this recompute them per round.
const CACHED: u32 = 1024u;
var<workgroup> vals: array<f32, CACHED>;

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

fn better(av: f32, ai: u32, bv: f32, bi: u32) -> bool {
    return av > bv || (av == bv && ai < bi);
}

@compute @workgroup_size(WG)
fn topk(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let lid = lanes.lid;
    let ri = wg.x + wg.y * nwg.x;
    let r = min(ri, p.rows - 1u);
    let base = r * p.experts;
    let none = 0xFFFFFFFFu;
    let cached = p.experts <= CACHED;
    if (cached) {
        for (var e = lid; e < p.experts; e += WG) {
            vals[e] = sigmoid(logits[base + e]) + bias[e];
        }
    }
    workgroupBarrier();
    for (var round = 0u; round < p.k; round++) {
        var bv = -3.4e38;
        var bi = none;
        for (var e = lid; e < p.experts; e += WG) {
            var taken = false;
            for (var j = 0u; j < round; j++) {
                taken = taken || sel[j] == e;
            }
            var v: f32;
            if (cached) {
                v = vals[e];
            } else {
                v = sigmoid(logits[base + e]) + bias[e];
            }
            if (!taken && (bi == none || better(v, e, bv, bi))) {
                bv = v;
                bi = e;
            }
        }
        best_v[lid] = bv;
        best_i[lid] = bi;
        workgroupBarrier();
        for (var o = WG >> 1u; o > 0u; o = o >> 1u) {
            if (lid < o) {
                let ov = best_v[lid + o];
                let oi = best_i[lid + o];
                if (oi != none && (best_i[lid] == none || better(ov, oi, best_v[lid], best_i[lid]))) {
                    best_v[lid] = ov;
                    best_i[lid] = oi;
                }
            }
            workgroupBarrier();
        }
        if (lid == 0u) {
            sel[round] = best_i[0];
        }
        workgroupBarrier();
    }
    // The chosen experts' σ loaded by k lanes at once (one lane loading all k, twice, waited
    // out 2k memory round trips), then every lane sums them in the same order.
    for (var j = lid; j < p.k; j += WG) {
        sig[j] = sigmoid(logits[base + sel[j]]);
    }
    workgroupBarrier();
    if (ri < p.rows) {
        var sum = 0.0;
        for (var j = 0u; j < p.k; j++) {
            sum += sig[j];
        }
        var norm = 1.0;
        if (p.renorm != 0u) {
            norm = 1.0 / (sum + 1e-20);
        }
        for (var j = lid; j < p.k; j += WG) {
            out[(r * p.k + j) * 2u] = sel[j];
            out[(r * p.k + j) * 2u + 1u] = bitcast<u32>(sig[j] * norm * p.scaling);
        }
    }
}

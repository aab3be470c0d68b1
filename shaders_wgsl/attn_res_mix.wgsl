// Block attention-residual mix: the entries (bank rows, then cur) are packed as
// [entries, rows, cols]; score_e = (E_e·inv_rms(E_e))·w, softmax over e,
// output = Σ_e p_e · E_e.
//
// Two passes: `scores`, one workgroup per (entry, row), then `mix`, the row's columns
// spread over workgroups that each take the softmax of the row's scores. In decode there
// is one row, and one workgroup doing all of it (every entry's sums one after another,
// then every column) took about 20 times an element-wise pass (docs/perf.md#kernels).

const MAX_ENTRIES: u32 = 64u;

struct MixParams {
    entries: u32,
    rows: u32,
    cols: u32,
    eps: f32,
}

@group(0) @binding(0) var<uniform> p: MixParams;
@group(0) @binding(1) var<storage, read> e: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> o: array<f32>;
// [rows, entries] scores, written by `scores`, read by `mix`.
@group(0) @binding(4) var<storage, read_write> sc: array<f32>;

var<workgroup> probs: array<f32, MAX_ENTRIES>;

// Columns c, c + WG, c + 2 WG and c + 3 WG of the entry row at `base`, 0 past the row's
// end: four loads a lane requested before any is used.
fn e4(base: u32, c: u32) -> vec4<f32> {
    let cs = vec4<u32>(c, c + WG, c + 2u * WG, c + 3u * WG);
    let last = p.cols - 1u;
    let v = vec4<f32>(e[base + min(cs.x, last)], e[base + min(cs.y, last)], e[base + min(cs.z, last)], e[base + min(cs.w, last)]);
    return select(vec4<f32>(0.0), v, cs < vec4<u32>(p.cols));
}

fn w4(c: u32) -> vec4<f32> {
    let cs = vec4<u32>(c, c + WG, c + 2u * WG, c + 3u * WG);
    let last = p.cols - 1u;
    let v = vec4<f32>(w[min(cs.x, last)], w[min(cs.y, last)], w[min(cs.z, last)], w[min(cs.w, last)]);
    return select(vec4<f32>(0.0), v, cs < vec4<u32>(p.cols));
}

// Workgroup (entry k, row r): the entry's score for the row.
@compute @workgroup_size(WG)
fn scores(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let k = wg.x;
    let r = wg.y;
    let base = (k * p.rows + r) * p.cols;
    var ss = vec4<f32>(0.0);
    var dw = vec4<f32>(0.0);
    for (var c = lanes.lid; c < p.cols; c += 4u * WG) {
        let v = e4(base, c);
        ss += v * v;
        dw += v * w4(c);
    }
    let tss = wg_sum((ss.x + ss.y) + (ss.z + ss.w));
    let tdw = wg_sum((dw.x + dw.y) + (dw.z + dw.w));
    if (lanes.lid == 0u) {
        sc[r * p.entries + k] = tdw / sqrt(tss / f32(p.cols) + p.eps);
    }
}

// Workgroup (column block, row r): the softmax of the row's scores, then one output
// column a lane.
@compute @workgroup_size(WG)
fn mix(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wg.y;
    // The row's scores into workgroup memory by many lanes at once: one lane reading them
    // from memory one after another would wait out a round trip per entry.
    for (var k = lid; k < p.entries; k += WG) {
        probs[k] = sc[r * p.entries + k];
    }
    workgroupBarrier();
    if (lid == 0u) {
        var m = probs[0];
        for (var k = 1u; k < p.entries; k++) {
            m = max(m, probs[k]);
        }
        var tot = 0.0;
        for (var k = 0u; k < p.entries; k++) {
            let ex = exp(probs[k] - m);
            probs[k] = ex;
            tot += ex;
        }
        for (var k = 0u; k < p.entries; k++) {
            probs[k] = probs[k] / tot;
        }
    }
    workgroupBarrier();
    let c = wg.x * WG + lid;
    if (c < p.cols) {
        // Four entries' loads a step, all requested before any is used.
        var acc = vec4<f32>(0.0);
        let stride = p.rows * p.cols;
        let last = p.entries - 1u;
        for (var k = 0u; k < p.entries; k += 4u) {
            let ks = min(vec4<u32>(k, k + 1u, k + 2u, k + 3u), vec4<u32>(last));
            let v = vec4<f32>(e[ks.x * stride + r * p.cols + c], e[ks.y * stride + r * p.cols + c],
                e[ks.z * stride + r * p.cols + c], e[ks.w * stride + r * p.cols + c]);
            let pk = vec4<f32>(probs[ks.x], probs[ks.y], probs[ks.z], probs[ks.w]);
            acc += select(vec4<f32>(0.0), pk * v, vec4<u32>(k, k + 1u, k + 2u, k + 3u) <= vec4<u32>(last));
        }
        o[r * p.cols + c] = (acc.x + acc.y) + (acc.z + acc.w);
    }
}

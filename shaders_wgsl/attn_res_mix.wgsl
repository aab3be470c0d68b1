// Block attention-residual mix, one workgroup per row: the entries (bank rows, then cur)
// are packed as [entries, rows, cols]; score_e = (E_e·inv_rms(E_e))·w, softmax over e,
// output = Σ_e p_e · E_e.

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

var<workgroup> probs: array<f32, MAX_ENTRIES>;

@compute @workgroup_size(WG)
fn mix(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let ri = wg.x + wg.y * nwg.x;
    let r = min(ri, p.rows - 1u);
    for (var k = 0u; k < p.entries; k++) {
        let base = (k * p.rows + r) * p.cols;
        var ss = 0.0;
        var dw = 0.0;
        for (var c = lanes.lid; c < p.cols; c += WG) {
            let v = e[base + c];
            ss += v * v;
            dw += v * w[c];
        }
        let tss = wg_sum(ss);
        let tdw = wg_sum(dw);
        if (lanes.lid == 0u) {
            probs[k] = tdw / sqrt(tss / f32(p.cols) + p.eps);
        }
    }
    workgroupBarrier();
    if (lanes.lid == 0u) {
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
    if (ri < p.rows) {
        for (var c = lanes.lid; c < p.cols; c += WG) {
            var acc = 0.0;
            for (var k = 0u; k < p.entries; k++) {
                acc += probs[k] * e[(k * p.rows + r) * p.cols + c];
            }
            o[r * p.cols + c] = acc;
        }
    }
}

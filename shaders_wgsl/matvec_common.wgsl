// The matvec/matmul driver every weight format shares. A workgroup owns WG/LPR consecutive
// output rows and TOK tokens: each lane walks its row in 16-byte weight units (LPR lanes
// side by side, so a row is read in coalesced strips), decodes each unit once and uses it
// for all TOK tokens, then the lanes of a row reduce. The format file defines UV (vec4s
// per unit), `Unit` and `load_unit`.

override LPR: u32 = 32u;
override TOK: u32 = 8u;
const TMAX: u32 = 8u;

struct MvParams {
    rows: u32,
    units: u32,
    n: u32,
    row0: u32,
    y_stride: u32,
    x_stride4: u32,
    groups: u32,
    map_off: u32,
    item0: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: MvParams;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

fn lane_partials(wrow: u32, xoff: array<u32, TMAX>, lane: u32) -> array<f32, TMAX> {
    var acc: array<f32, TMAX>;
    for (var u = lane; u < p.units; u += LPR) {
        let w = load_unit(wrow, u);
        for (var t = 0u; t < TOK; t++) {
            let xb = xoff[t] + u * UV;
            var d = 0.0;
            for (var k = 0u; k < UV; k++) {
                d += dot(w.v[k], x[xb + k]);
            }
            acc[t] += d * w.s;
        }
    }
    return acc;
}

fn finish(acc: array<f32, TMAX>, lane: u32, valid_row: bool, yoff: array<u32, TMAX>, nt: u32) {
    for (var t = 0u; t < TOK; t++) {
        let s = seg_sum(acc[t], LPR);
        if (lane == 0u && valid_row && t < nt) {
            y[yoff[t]] = s;
        }
    }
}

// y[t, row0 + r] = W[r] · x[t] for the rows of this chunk of the matrix.
@compute @workgroup_size(WG)
fn dense(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let lane = lanes.lid % LPR;
    let row = wg.x * (WG / LPR) + lanes.lid / LPR;
    let rr = min(row, p.rows - 1u);
    let t0 = wg.y * TOK;
    let nt = min(TOK, p.n - t0);
    var xoff: array<u32, TMAX>;
    var yoff: array<u32, TMAX>;
    for (var t = 0u; t < TOK; t++) {
        let tt = t0 + min(t, nt - 1u);
        xoff[t] = tt * p.x_stride4;
        yoff[t] = tt * p.y_stride + p.row0 + rr;
    }
    let acc = lane_partials(rr, xoff, lane);
    finish(acc, lane, row < p.rows, yoff, nt);
}

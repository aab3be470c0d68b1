// The matvec/matmul driver every weight format shares. A workgroup owns WG/LPR lane groups
// of RPL consecutive output rows each, and TOK tokens: each lane walks its rows in 16-byte
// weight units (LPR lanes side by side, so a row is read in coalesced strips), loads each
// x unit once for its RPL rows and decodes each weight unit once for all TOK tokens; then
// the lanes of a group reduce. The format file defines UV (vec4s per unit), `Unit` and
// `load_unit`.

override LPR: u32 = 32u;
override TOK: u32 = 8u;
override RPL: u32 = 2u;
const TMAX: u32 = 8u;
const RMAX: u32 = 4u;

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

fn lane_partials(wrow: u32, nrows: u32, xoff: array<u32, TMAX>, lane: u32) -> array<f32, 32> {
    var acc: array<f32, 32>;
    for (var u = lane; u < p.units; u += LPR) {
        var ws: array<Unit, RMAX>;
        for (var r = 0u; r < RPL; r++) {
            ws[r] = load_unit(wrow + min(r, nrows - 1u), u);
        }
        for (var t = 0u; t < TOK; t++) {
            var xv: array<vec4<f32>, UV>;
            for (var k = 0u; k < UV; k++) {
                xv[k] = x[xoff[t] + u * UV + k];
            }
            for (var r = 0u; r < RPL; r++) {
                var d = 0.0;
                for (var k = 0u; k < UV; k++) {
                    d += dot(ws[r].v[k], xv[k]);
                }
                acc[r * TMAX + t] += d * ws[r].s;
            }
        }
    }
    return acc;
}

// Reduces the lanes of each group and writes row `row0 + r` for r < nrows.
fn finish(acc: array<f32, 32>, lane: u32, nrows: u32, yoff: array<u32, TMAX>, nt: u32) {
    for (var r = 0u; r < RPL; r++) {
        for (var t = 0u; t < TOK; t++) {
            let s = seg_sum(acc[r * TMAX + t], LPR);
            if (lane == 0u && r < nrows && t < nt) {
                y[yoff[t] + r] = s;
            }
        }
    }
}

// y[t, row0 + r] = W[r] · x[t] for the rows of this chunk of the matrix.
@compute @workgroup_size(WG)
fn dense(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let lane = lanes.lid % LPR;
    let row = (wg.x * (WG / LPR) + lanes.lid / LPR) * RPL;
    let rr = min(row, p.rows - 1u);
    let nrows = min(RPL, p.rows - rr);
    let t0 = wg.y * TOK;
    let nt = min(TOK, p.n - t0);
    var xoff: array<u32, TMAX>;
    var yoff: array<u32, TMAX>;
    for (var t = 0u; t < TOK; t++) {
        let tt = t0 + min(t, nt - 1u);
        xoff[t] = tt * p.x_stride4;
        yoff[t] = tt * p.y_stride + p.row0 + rr;
    }
    let acc = lane_partials(rr, nrows, xoff, lane);
    finish(acc, lane, select(0u, nrows, row < p.rows), yoff, nt);
}

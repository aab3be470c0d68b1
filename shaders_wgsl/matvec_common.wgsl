// The matvec/matmul driver every weight format shares. A workgroup owns WG/LPR lane groups
// of RPL consecutive output rows each, for one token: each lane walks its rows in 16-byte
// weight units (LPR lanes side by side, so a row is read in coalesced strips) and
// `unit_dot` (from the format file) decodes a unit straight into the dot product; then
// the lanes of a group reduce. The format file defines UV (vec4s per unit), `unit_dot`,
// and `Unit`/`load_unit` where a scalar path needs whole units.

override LPR: u32 = 32u;
override RPL: u32 = 2u;

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

// Each lane keeps RPL scalar sums, with no arrays that a driver might leave in memory
// (measured: a TOK × RPL accumulator array ran 10-50x slower on the H200).
fn gemv_rows(wrow: u32, nrows: u32, xb: u32, lane: u32, yb: u32, valid: u32) {
    var a0 = 0.0;
    var a1 = 0.0;
    var a2 = 0.0;
    var a3 = 0.0;
    let last = nrows - 1u;
    for (var u = lane; u < p.units; u += LPR) {
        a0 += unit_dot(wrow, u, xb);
        if (RPL > 1u) {
            a1 += unit_dot(wrow + min(1u, last), u, xb);
        }
        if (RPL > 2u) {
            a2 += unit_dot(wrow + min(2u, last), u, xb);
        }
        if (RPL > 3u) {
            a3 += unit_dot(wrow + min(3u, last), u, xb);
        }
    }
    let sums = array<f32, 4>(a0, a1, a2, a3);
    for (var r = 0u; r < RPL; r++) {
        let s = seg_sum(sums[r], LPR);
        if (lane == 0u && r < valid) {
            y[yb + r] = s;
        }
    }
}

// y[t, row0 + r] = W[r] · x[t]; wg.x is the token, wg.y the row group, so the workgroups
// that run together share their weight rows through L2 (read once from memory per chunk).
@compute @workgroup_size(WG)
fn dense(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let lane = lanes.lid % LPR;
    let t = wg.x;
    let row = (wg.y * (WG / LPR) + lanes.lid / LPR) * RPL;
    let rr = min(row, p.rows - 1u);
    let nrows = min(RPL, p.rows - rr);
    gemv_rows(rr, nrows, t * p.x_stride4, lane, t * p.y_stride + p.row0 + rr, select(0u, nrows, row < p.rows));
}

// The matvec/matmul driver every weight format shares. A workgroup owns WG/LPR lane groups
// of RPL consecutive output rows each, for one token: each lane walks its rows in 16-byte
// weight units (LPR lanes per row, LW of them side by side in a 32-lane block, so a row is
// read in coalesced strips). Per unit the lane loads its slice of x once (`load_x`, from the
// format file) and `unit_dot` decodes each of the RPL rows' unit straight into a dot product
// with it; then the lanes of a group reduce. On the H200 neither the decode nor the x loads
// alone bound the int4/MXFP4 kernels; the two together do: without both, int4 runs at the
// read kernel's bandwidth (docs/perf.md, third pass).
// The format file defines `WU` (a unit of one row, with its scale) and `load_w`, `XU` and
// `load_x`, `DU` (a unit decoded) with `decode_unit(WU)` and `decoded_dot(DU, XU)`. A unit's
// dot product is always `decoded_dot(decode_unit(w), x)`, so the token-tiled kernel
// (`dense_tiled`, which decodes a unit once for TT tokens) gives bit-identical sums.

override LPR: u32 = 32u;
// Of a row's LPR lanes, LW sit side by side in each 32-lane block and the rest in the next
// LPR/LW blocks (LW = LPR: all in one block). A lane reads 128 contiguous bytes of x per
// unit, so a block whose 32 lanes work on 32 different units touches 32 cache lines per x
// load; with LW = 4 the block holds 8 row groups over the same 4 units and touches 4
// (measured on the H200: x loads, not the decode, were what bound the one-block layout).
override LW: u32 = 32u;
// Blocks per row (1 when LW >= LPR).
override PARTS: u32 = max(LPR / LW, 1u);
override RPL: u32 = 4u;
// Decode variant: 0 = convert through the hardware's int/half-to-float instructions,
// 1 = the default (int formats: bit placement, no conversions), 2 = a format's alternative.
override DEC: u32 = 1u;
// 1: software-pipelined loop (next unit's weights loaded before this one is used; loading
// its x too was measured and did not help).
override PIPE: u32 = 1u;
// Tokens one `dense_tiled` workgroup computes (1..=8).
override TT: u32 = 8u;

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

// A lane's RPL row sums live in two vec4s, and its RPL weight units in named fields: no
// dynamically indexed arrays, which a driver might leave in memory (measured: a TOK × RPL
// accumulator array ran 10-50x slower on the H200).
struct Acc {
    a: vec4<f32>,
    b: vec4<f32>,
}

struct W8 {
    w0: WU,
    w1: WU,
    w2: WU,
    w3: WU,
    w4: WU,
    w5: WU,
    w6: WU,
    w7: WU,
}

// Unit u of rows wrow .. wrow + RPL - 1 (rows past `last` repeat the last one).
fn load_w8(wrow: u32, last: u32, u: u32) -> W8 {
    var r: W8;
    r.w0 = load_w(wrow, u);
    if (RPL > 1u) {
        r.w1 = load_w(wrow + min(1u, last), u);
    }
    if (RPL > 2u) {
        r.w2 = load_w(wrow + min(2u, last), u);
    }
    if (RPL > 3u) {
        r.w3 = load_w(wrow + min(3u, last), u);
    }
    if (RPL > 4u) {
        r.w4 = load_w(wrow + min(4u, last), u);
    }
    if (RPL > 5u) {
        r.w5 = load_w(wrow + min(5u, last), u);
    }
    if (RPL > 6u) {
        r.w6 = load_w(wrow + min(6u, last), u);
    }
    if (RPL > 7u) {
        r.w7 = load_w(wrow + min(7u, last), u);
    }
    return r;
}

fn unit_dot(wu: WU, xv: XU) -> f32 {
    return decoded_dot(decode_unit(wu), xv);
}

fn step(acc: Acc, w: W8, xv: XU) -> Acc {
    var r = acc;
    r.a.x += unit_dot(w.w0, xv);
    if (RPL > 1u) {
        r.a.y += unit_dot(w.w1, xv);
    }
    if (RPL > 2u) {
        r.a.z += unit_dot(w.w2, xv);
    }
    if (RPL > 3u) {
        r.a.w += unit_dot(w.w3, xv);
    }
    if (RPL > 4u) {
        r.b.x += unit_dot(w.w4, xv);
    }
    if (RPL > 5u) {
        r.b.y += unit_dot(w.w5, xv);
    }
    if (RPL > 6u) {
        r.b.z += unit_dot(w.w6, xv);
    }
    if (RPL > 7u) {
        r.b.w += unit_dot(w.w7, xv);
    }
    return r;
}

// Eight consecutive vec4s of x: one unit's inputs for the 32-column formats (int4, MXFP4).
// x is read straight from global memory (every row of the workgroup reads the same slice, so
// it stays in L1/L2); staging it in workgroup memory with a bank skew was measured on the
// H200 and did not help (docs/perf.md).
struct X8 {
    x0: vec4<f32>,
    x1: vec4<f32>,
    x2: vec4<f32>,
    x3: vec4<f32>,
    x4: vec4<f32>,
    x5: vec4<f32>,
    x6: vec4<f32>,
    x7: vec4<f32>,
}

fn load_x8(b: u32) -> X8 {
    return X8(x[b], x[b + 1u], x[b + 2u], x[b + 3u], x[b + 4u], x[b + 5u], x[b + 6u], x[b + 7u]);
}

fn gemv_rows(wrow: u32, nrows: u32, xb: u32, lane: u32, yb: u32, valid: u32) {
    var acc = Acc(vec4<f32>(0.0), vec4<f32>(0.0));
    let last = nrows - 1u;
    if (PIPE == 0u) {
        for (var u = lane; u < p.units; u += LPR) {
            acc = step(acc, load_w8(wrow, last, u), load_x(xb + u * UV));
        }
    } else {
        // The next unit's weights are requested before this unit is computed, so every
        // lane keeps two units of loads in flight instead of waiting on each in turn.
        var u = lane;
        var cur = load_w8(wrow, last, min(u, p.units - 1u));
        while (u < p.units) {
            let un = u + LPR;
            let nxt = load_w8(wrow, last, min(un, p.units - 1u));
            acc = step(acc, cur, load_x(xb + u * UV));
            cur = nxt;
            u = un;
        }
    }
    write_sums(acc, RPL, lane, yb, 1u, valid);
}

// Reduces the first `count` (RPL or TT, uniform) sums of `acc` over each row's LPR lanes and
// writes sum i to y[yb + i·ystep] for i < valid.
fn write_sums(acc: Acc, count: u32, lane: u32, yb: u32, ystep: u32, valid: u32) {
    let sums = array<f32, 8>(acc.a.x, acc.a.y, acc.a.z, acc.a.w, acc.b.x, acc.b.y, acc.b.z, acc.b.w);
    if (LW >= LPR) {
        for (var r = 0u; r < count; r++) {
            let s = seg_sum(sums[r], LPR);
            if (lane == 0u && r < valid) {
                y[yb + r * ystep] = s;
            }
        }
        return;
    }
    // Each block's LW lanes reduce first, then the row's LPR / LW blocks meet in workgroup
    // memory: slot (row group, block part), 8 sums each.
    let part = lane / LW;
    let slot = (r_lid % 32u / LW + r_lid / 32u / PARTS * (32u / LW)) * PARTS + part;
    for (var r = 0u; r < count; r++) {
        let s = seg_sum(sums[r], LW);
        if (lane % LW == 0u) {
            mv_part[slot * 8u + r] = s;
        }
    }
    workgroupBarrier();
    if (lane == 0u) {
        for (var r = 0u; r < valid; r++) {
            var t = 0.0;
            for (var k = 0u; k < PARTS; k++) {
                t += mv_part[(slot + k) * 8u + r];
            }
            y[yb + r * ystep] = t;
        }
    }
}

// Partial row sums of the split layout (LW < LPR): WG / LW slots of up to 8 sums.
var<workgroup> mv_part: array<f32, 512>;

// A lane's place: (lane within its row's LPR lanes, row group within the workgroup).
fn lane_place(lid: u32) -> vec2<u32> {
    if (LW >= LPR) {
        return vec2<u32>(lid % LPR, lid / LPR);
    }
    let block = lid / 32u;
    let v = lid % 32u;
    return vec2<u32>((block % PARTS) * LW + v % LW, (block / PARTS) * (32u / LW) + v / LW);
}

// y[t, row0 + r] = W[r] · x[t]; wg.x is the token, wg.y the row group, so the workgroups
// that run together share their weight rows through L2 (read once from memory per chunk).
@compute @workgroup_size(WG)
fn dense(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let place = lane_place(lanes.lid);
    let lane = place.x;
    let t = wg.x;
    let row = (wg.y * (WG / LPR) + place.y) * RPL;
    let rr = min(row, p.rows - 1u);
    let nrows = min(RPL, p.rows - rr);
    gemv_rows(rr, nrows, t * p.x_stride4, lane, t * p.y_stride + p.row0 + rr, select(0u, nrows, row < p.rows));
}

// Token-tiled matmul for chunks of tokens: y[t0 + i, row0 + row] = W[row] · x[t0 + i] for
// the TT tokens of tile wg.x, one row per lane group (wg.y the row group). Each weight unit
// is loaded and decoded once and applied to every token of the tile; the per-token kernel
// above decodes it again for every token.
@compute @workgroup_size(WG)
fn dense_tiled(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let place = lane_place(lanes.lid);
    let lane = place.x;
    let t0 = wg.x * TT;
    let row = wg.y * (WG / LPR) + place.y;
    let rr = min(row, p.rows - 1u);
    let last = p.n - 1u;
    // Tokens past the chunk repeat its last one (not written).
    let x0 = min(t0, last) * p.x_stride4;
    let x1 = min(t0 + 1u, last) * p.x_stride4;
    let x2 = min(t0 + 2u, last) * p.x_stride4;
    let x3 = min(t0 + 3u, last) * p.x_stride4;
    let x4 = min(t0 + 4u, last) * p.x_stride4;
    let x5 = min(t0 + 5u, last) * p.x_stride4;
    let x6 = min(t0 + 6u, last) * p.x_stride4;
    let x7 = min(t0 + 7u, last) * p.x_stride4;
    var acc = Acc(vec4<f32>(0.0), vec4<f32>(0.0));
    for (var u = lane; u < p.units; u += LPR) {
        let du = decode_unit(load_w(rr, u));
        let o = u * UV;
        acc.a.x += decoded_dot(du, load_x(x0 + o));
        if (TT > 1u) {
            acc.a.y += decoded_dot(du, load_x(x1 + o));
        }
        if (TT > 2u) {
            acc.a.z += decoded_dot(du, load_x(x2 + o));
        }
        if (TT > 3u) {
            acc.a.w += decoded_dot(du, load_x(x3 + o));
        }
        if (TT > 4u) {
            acc.b.x += decoded_dot(du, load_x(x4 + o));
        }
        if (TT > 5u) {
            acc.b.y += decoded_dot(du, load_x(x5 + o));
        }
        if (TT > 6u) {
            acc.b.z += decoded_dot(du, load_x(x6 + o));
        }
        if (TT > 7u) {
            acc.b.w += decoded_dot(du, load_x(x7 + o));
        }
    }
    let valid = select(0u, min(TT, p.n - min(t0, p.n)), row < p.rows);
    write_sums(acc, TT, lane, t0 * p.y_stride + p.row0 + rr, p.y_stride, valid);
}

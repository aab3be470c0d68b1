// The matvec/matmul driver every weight format shares. A workgroup owns WG/LPR lane groups
// of RPL consecutive output rows each, for one token: each lane walks its rows in 16-byte
// weight units (LPR lanes per row, LW of them side by side in a 32-lane block, so a row is
// read in coalesced strips). Per unit the lane loads its slice of x once (`load_x`, from the
// format file) and `unit_dot` decodes each of the RPL rows' unit straight into a dot product
// with it; then the lanes of a group reduce. Neither the decode nor the x loads alone bound
// the int4/MXFP4 kernels; the two together do: without both, int4 runs at the read
// kernel's bandwidth (docs/perf.md#kernels). The 32-column formats also have entries
// that read x from a padded copy in workgroup memory (matvec_staged.wgsl).
// The format file defines `WU` (a unit of one row, with its scale) and `load_w`, `XU` and
// `load_x(xb, u)` (unit u's slice of the x row that starts at vec4 xb), `unit_dot(WU, XU)`
// (a unit's dot product with its slice of x), and for the chunk
// kernel `gemm` below, `stage_unit(WU, r, c)`, which writes the unit's plain values (scale
// applied) through `stage4`. Most formats build both from a shared `decode_unit`.

override LPR: u32 = 32u;
// Of a row's LPR lanes, LW sit side by side in each 32-lane block and the rest in the next
// LPR/LW blocks (LW = LPR: all in one block). A lane reads 128 contiguous bytes of x per
// unit, so a block whose 32 lanes work on 32 different units touches 32 cache lines per x
// load; with LW = 4 the block holds 8 row groups over the same 4 units and touches 4
// (measured: x loads, not the decode, were what bound the one-block layout).
override LW: u32 = 32u;
// Blocks per row (1 when LW >= LPR).
override PARTS: u32 = max(LPR / LW, 1u);
override RPL: u32 = 4u;
// 1: software-pipelined loop (next unit's weights loaded before this one is used; loading
// its x too, or the next two units' weights, was measured and did not help).
override PIPE: u32 = 1u;

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
    // The chunk kernel's K steps per segment, and the words between segments' outputs.
    seg_steps: u32,
    seg_stride: u32,
    // The column-stationary kernels' rows per workgroup.
    row_block: u32,
}

@group(0) @binding(0) var<uniform> p: MvParams;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

// A lane's RPL row sums live in two vec4s, and its RPL weight units in named fields: no
// dynamically indexed arrays, which a driver might leave in memory (measured: a TOK × RPL
// accumulator array ran 10-50x slower).
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

// A row-split lane's work: rows wrow .. wrow + nrows - 1 against the x row at vec4 xb, its
// place `lane` among the row's LPR lanes, where its sums go (y[yb + r]) and how many of them
// are real rows (`valid`; rows past the end repeat the last, so every lane reaches the
// reductions).
struct RowJob {
    wrow: u32,
    nrows: u32,
    xb: u32,
    lane: u32,
    yb: u32,
    valid: u32,
}

// A lane's rows of row group `group`: weight rows from wbase, sums from y[yb0 + row].
fn row_job(lid: u32, group: u32, wbase: u32, xb: u32, yb0: u32) -> RowJob {
    let place = lane_place(lid);
    let row = (group * (WG / LPR) + place.y) * RPL;
    let rr = min(row, p.rows - 1u);
    let nrows = min(RPL, p.rows - rr);
    return RowJob(wbase + rr, nrows, xb, place.x, yb0 + rr, select(0u, nrows, row < p.rows));
}

fn gemv_rows(j: RowJob) {
    var acc = Acc(vec4<f32>(0.0), vec4<f32>(0.0));
    let last = j.nrows - 1u;
    if (PIPE == 0u) {
        for (var u = j.lane; u < p.units; u += LPR) {
            acc = step(acc, load_w8(j.wrow, last, u), load_x(j.xb, u));
        }
    } else {
        // The next unit's weights are requested before this unit is computed, so every
        // lane keeps two units of loads in flight instead of waiting on each in turn.
        var u = j.lane;
        var cur = load_w8(j.wrow, last, min(u, p.units - 1u));
        while (u < p.units) {
            let un = u + LPR;
            let nxt = load_w8(j.wrow, last, min(un, p.units - 1u));
            acc = step(acc, cur, load_x(j.xb, u));
            cur = nxt;
            u = un;
        }
    }
    write_sums(acc, RPL, j.lane, j.yb, 1u, j.valid);
}

// Reduces the first `count` (uniform) sums of `acc` over each row's LPR lanes and
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
    gemv_rows(dense_job(wg, lanes.lid));
}

// The lane's rows of `dense` (and of `dense_xs`, matvec_staged.wgsl).
fn dense_job(wg: vec3<u32>, lid: u32) -> RowJob {
    let t = wg.x;
    return row_job(lid, wg.y, 0u, t * p.x_stride4, t * p.y_stride + p.row0);
}

// The column-stationary matvec (`dense_cs`, `moe_cs`; rows of at most SPAN units). Lane c of
// a span of SPAN lanes owns unit c of every row: its slice of x is loaded once, into
// registers, and the span reads each row whole, 16 bytes a lane in order, RPL rows at a time
// with the next RPL rows requested before these are used. The row-split kernel above walks
// units along a row instead, so it reloads x for every unit, and from global memory each x
// load touches as many cache lines as the block has units (without the decode and the x
// traffic, int4 runs at the read kernel's bandwidth: docs/perf.md#kernels). Per row, the
// lanes' sums meet through the subgroup, then across the span's subgroups in `cs_part` once
// the workgroup's rows are done: the host keeps row_block × SPAN / (smallest subgroup)
// within it.
override SPAN: u32 = 256u;
override NSPAN: u32 = max(WG / SPAN, 1u);
var<workgroup> cs_part: array<f32, 1024>;

// Block blk (row_block rows from blk · row_block) of the matrix whose row 0 is weight row
// wbase, against the x row at xb; row r's result goes to y[yb + r]. A block past the last
// row returns at once (the whole workgroup alike, so before any barrier).
fn cs_rows(wbase: u32, blk: u32, xb: u32, yb0: u32) {
    let r0 = blk * p.row_block;
    if (r0 >= p.rows) {
        return;
    }
    let r1 = min(r0 + p.row_block, p.rows);
    let yb = yb0 + r0;
    let c = r_lid % SPAN;
    let h = r_lid / SPAN;
    let cu = min(c, p.units - 1u);
    let xv = load_x(xb, cu);
    let per_row = SPAN / sub_size();
    let sgi = c / sub_size();
    let n = r1 - r0;
    let stride = NSPAN * RPL;
    let rounds = (n + stride - 1u) / stride;
    // Rows past r1 (a span's last round) repeat the last row and are not written.
    var g = h * RPL;
    var gr = min(g, n - 1u);
    var cur = load_w8(wbase + r0 + gr, min(RPL, n - gr) - 1u, cu);
    for (var k = 0u; k < rounds; k++) {
        let gn = g + stride;
        let nr = min(gn, n - 1u);
        let nxt = load_w8(wbase + r0 + nr, min(RPL, n - nr) - 1u, cu);
        var acc = step(Acc(vec4<f32>(0.0), vec4<f32>(0.0)), cur, xv);
        if (c >= p.units) {
            acc = Acc(vec4<f32>(0.0), vec4<f32>(0.0));
        }
        cs_put4(acc.a, min(RPL, 4u), g, n, per_row, sgi);
        if (RPL > 4u) {
            cs_put4(acc.b, RPL - 4u, g + 4u, n, per_row, sgi);
        }
        cur = nxt;
        g = gn;
    }
    workgroupBarrier();
    for (var j = r_lid; j < n; j += WG) {
        var t = 0.0;
        for (var i = 0u; i < per_row; i++) {
            t += cs_part[j * per_row + i];
        }
        y[yb + j] = t;
    }
}

// The first `k` (uniform) of four consecutive rows' sums, from row g on.
fn cs_put4(v: vec4<f32>, k: u32, g: u32, n: u32, per_row: u32, sgi: u32) {
    cs_put(v.x, g, n, per_row, sgi);
    if (k > 1u) {
        cs_put(v.y, g + 1u, n, per_row, sgi);
    }
    if (k > 2u) {
        cs_put(v.z, g + 2u, n, per_row, sgi);
    }
    if (k > 3u) {
        cs_put(v.w, g + 3u, n, per_row, sgi);
    }
}

// The subgroup's sum of one row (g, relative to the block), kept for the final sum.
fn cs_put(v: f32, g: u32, n: u32, per_row: u32, sgi: u32) {
    let s = sub_sum(v);
    if (sub_lane() == 0u && g < n) {
        cs_part[g * per_row + sgi] = s;
    }
}

// y[t, row0 + r] = W[r] · x[t], column-stationary: wg.x is the token, wg.y the block of
// row_block rows.
@compute @workgroup_size(WG)
fn dense_cs(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let t = wg.x;
    cs_rows(0u, wg.y, t * p.x_stride4, t * p.y_stride + p.row0);
}

// Matmul of a chunk of tokens (prefill): a workgroup computes a tile of 4·GTR rows × 4·GTC
// tokens of y, each lane 4 rows × 4 tokens. K goes in steps of GK columns: the step's weight
// units are loaded and decoded once into workgroup memory (`stage_unit`, from the format
// file), its inputs copied next to them, and every lane's 16 sums take 32 multiply-adds of
// vec4 per pair of workgroup loads. The one-token kernel above decodes every unit again
// for every token, which is what made a 32-token chunk cost 40-70 one-token matvecs.

// Lanes along the tile's rows and along its tokens: GTR · GTC = WG.
override GTR: u32 = 16u;
override GTC: u32 = 16u;
// 1: every lane stages at most one weight unit and two vec4 of x per K step (the host sets
// it where the tile and format allow), so the next step's loads are issued before this
// step's multiply-adds and their latency hides behind them; 0: a plain loop per step.
// (Declared here: naga wants an override declared before the functions that use it.)
override PF: u32 = 0u;
// Columns of one K step: one unit of the 32-column formats, several of the others.
const GK: u32 = 32u;

// The step's decoded weights, gw[k · GTR + i] = rows 4i .. 4i + 3 of the tile at column k;
// its inputs, gx[k · GTC + j] = tokens 4j .. 4j + 3 at column k; and where each token's row
// of x starts (the entry point fills it: a chunk's rows in order, or gathered by routing).
// (Sizes through named overrides: naga 30 makes an anonymous one of an expression as an
// array size, and panics when an override declared later, as in matvec_staged.wgsl, is
// resolved past it.)
override GW_LEN: u32 = GK * GTR;
override GX_LEN: u32 = GK * GTC;
override GXROW_LEN: u32 = 4u * GTC;
var<workgroup> gw: array<vec4<f32>, GW_LEN>;
var<workgroup> gx: array<vec4<f32>, GX_LEN>;
var<workgroup> gxrow: array<u32, GXROW_LEN>;

// Decoded weight columns c .. c + 3 of tile row r.
fn stage4(v: vec4<f32>, r: u32, c: u32) {
    let i = c * GTR + r / 4u;
    let k = r % 4u;
    gw[i][k] = v.x;
    gw[i + GTR][k] = v.y;
    gw[i + 2u * GTR][k] = v.z;
    gw[i + 3u * GTR][k] = v.w;
}

// y over K segment `seg` (K steps seg · seg_steps ..) for tile rows r0 .. (weight rows
// wbase + r0 ..; rows past p.rows repeat the last and are not written) and tokens t0 ..
// t0 + 4·GTC - 1 below `tend`; token t's output row is seg · seg_stride + t · y_stride + row0.
fn gemm_tile(lid: u32, wbase: u32, r0: u32, t0: u32, tend: u32, seg: u32) {
    // Each 32-lane block covers 8 row groups × 4 token groups, so a column's workgroup
    // loads touch 8 distinct vec4 of weights and 4 of inputs (128 + 64 bytes) rather than
    // 32 and 1: as one row of 32 lanes, the weight loads alone took 4 wavefronts per
    // column, more than the block's 16 multiply-adds.
    var tr = lid % GTR;
    var tc = lid / GTR;
    if (GTR % 8u == 0u && GTC % 4u == 0u) {
        let b = lid / 32u;
        tr = (b % (GTR / 8u)) * 8u + lid % 8u;
        tc = (b / (GTR / 8u)) * 4u + lid % 32u / 8u;
    }
    let ups = 8u / UV;
    let s0 = seg * p.seg_steps;
    let steps = min((p.units + ups - 1u) / ups, s0 + p.seg_steps);
    var acc = Acc4(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
    if (PF == 1u) {
        var f = fetch(wbase, r0, s0, lid);
        for (var s = s0; s < steps; s++) {
            put(f, lid);
            workgroupBarrier();
            if (s + 1u < steps) {
                f = fetch(wbase, r0, s + 1u, lid);
            }
            acc = mac(acc, tr, tc);
            workgroupBarrier();
        }
    } else {
        for (var s = s0; s < steps; s++) {
            for (var j = lid; j < 4u * GTR * ups; j += WG) {
                let u = s * ups + j % ups;
                stage_or_zero(wbase, r0, j, u < p.units, u);
            }
            for (var j = lid; j < 32u * GTC; j += WG) {
                x_store(j, x_load(s, j));
            }
            workgroupBarrier();
            acc = mac(acc, tr, tc);
            workgroupBarrier();
        }
    }
    let row = r0 + 4u * tr;
    let tok = t0 + 4u * tc;
    let yb = seg * p.seg_stride;
    put_rows(acc.a0, row, tok, tend, yb);
    put_rows(acc.a1, row, tok + 1u, tend, yb);
    put_rows(acc.a2, row, tok + 2u, tend, yb);
    put_rows(acc.a3, row, tok + 3u, tend, yb);
}

// A lane's 4 rows × 4 tokens of sums: a_j holds token j's rows.
struct Acc4 {
    a0: vec4<f32>,
    a1: vec4<f32>,
    a2: vec4<f32>,
    a3: vec4<f32>,
}

// The staged step's multiply-adds for lane (tr, tc).
fn mac(acc: Acc4, tr: u32, tc: u32) -> Acc4 {
    var r = acc;
    for (var k = 0u; k < GK; k++) {
        let wv = gw[k * GTR + tr];
        let xv = gx[k * GTC + tc];
        r.a0 = fma(wv, vec4<f32>(xv.x), r.a0);
        r.a1 = fma(wv, vec4<f32>(xv.y), r.a1);
        r.a2 = fma(wv, vec4<f32>(xv.z), r.a2);
        r.a3 = fma(wv, vec4<f32>(xv.w), r.a3);
    }
    return r;
}

// A lane's loads for one K step, held in registers until the step is staged.
struct Fetch {
    w: WU,
    wv: bool,
    x0: vec4<f32>,
    x1: vec4<f32>,
}

fn fetch(wbase: u32, r0: u32, s: u32, lid: u32) -> Fetch {
    var f: Fetch;
    let ups = 8u / UV;
    let u = s * ups + lid % ups;
    f.wv = lid < 4u * GTR * ups && u < p.units;
    if (f.wv) {
        f.w = load_w(wbase + min(r0 + lid / ups, p.rows - 1u), u);
    }
    f.x0 = x_load(s, lid);
    f.x1 = x_load(s, lid + WG);
    return f;
}

fn put(f: Fetch, lid: u32) {
    let ups = 8u / UV;
    if (lid < 4u * GTR * ups) {
        if (f.wv) {
            stage_unit(f.w, lid / ups, (lid % ups) * 4u * UV);
        } else {
            stage_or_zero(0u, 0u, lid, false, 0u);
        }
    }
    x_store(lid, f.x0);
    x_store(lid + WG, f.x1);
}

// Staging slot j of the step's weights (tile row j / ups, unit u of the row): the unit
// decoded, or zeros past the row's end.
fn stage_or_zero(wbase: u32, r0: u32, j: u32, valid: bool, u: u32) {
    let ups = 8u / UV;
    let r = j / ups;
    let c = (j % ups) * 4u * UV;
    if (valid) {
        stage_unit(load_w(wbase + min(r0 + r, p.rows - 1u), u), r, c);
        return;
    }
    for (var q = 0u; q < UV; q++) {
        stage4(vec4<f32>(0.0), r, c + 4u * q);
    }
}

// Staging slot j of the step's inputs (token j % 4·GTC, vec4 j / 4·GTC of the step), zero
// past the row's end or the slots.
fn x_load(s: u32, j: u32) -> vec4<f32> {
    let c4 = s * 8u + j / (4u * GTC);
    if (j < 32u * GTC && c4 < p.units * UV) {
        return x[gxrow[j % (4u * GTC)] + c4];
    }
    return vec4<f32>(0.0);
}

fn x_store(j: u32, xv: vec4<f32>) {
    if (j >= 32u * GTC) {
        return;
    }
    let t = j % (4u * GTC);
    let i = 4u * (j / (4u * GTC)) * GTC + t / 4u;
    let k = t % 4u;
    gx[i][k] = xv.x;
    gx[i + GTC][k] = xv.y;
    gx[i + 2u * GTC][k] = xv.z;
    gx[i + 3u * GTC][k] = xv.w;
}

// Rows row .. row + 3 of token `tok`'s output, those that exist.
fn put_rows(v: vec4<f32>, row: u32, tok: u32, tend: u32, yb: u32) {
    if (tok >= tend) {
        return;
    }
    let b = yb + tok * p.y_stride + p.row0 + row;
    let sums = array<f32, 4>(v.x, v.y, v.z, v.w);
    for (var i = 0u; i < 4u; i++) {
        if (row + i < p.rows) {
            y[b + i] = sums[i];
        }
    }
}

// y[t, row0 + r] = W[r] · x[t] for the chunk's p.n tokens: wg.x is the token tile, wg.y the
// row tile, wg.z the K segment.
@compute @workgroup_size(WG)
fn gemm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t0 = wg.x * 4u * GTC;
    if (lid < 4u * GTC) {
        gxrow[lid] = min(t0 + lid, p.n - 1u) * p.x_stride4;
    }
    workgroupBarrier();
    gemm_tile(lid, 0u, wg.y * 4u * GTR, t0, p.n, wg.z);
}

// Native MXFP4 weights: E2M1 nibbles (low nibble = even column) with one E8M0 exponent per
// 32 columns, decoded here and never on the host. A unit is one scale block: 32 columns in
// one vec4<u32>. E8M0 is the f32 with bit pattern s << 23 (s = 0 gives 0, s = 255 gives
// +inf), exactly as the CPU decodes it.
//
// The decode is exact: two nibbles become one f16 pair by bit placement, widened by
// `unpack2x16float` (a workgroup-memory table and a conversion-free f32 placement both
// measured slower: docs/perf.md#kernels).

// 0: the host checked that no scale of the dispatch's matrices is above 240, and the
// matvec's per-element path for those scales is compiled out: its mere presence costs the
// batched expert matvec bandwidth in every form tried (docs/perf.md#kernels). 1 (the
// default): the path is kept.
override SPECIAL: u32 = 1u;

@group(0) @binding(3) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> scales: array<u32>;
@group(0) @binding(5) var<storage, read> rt: array<u32>;

alias XU = X8;

const UV: u32 = 8u;

fn load_x(xb: u32, u: u32) -> XU {
    return load_x8(xb + u * UV);
}

// The f16 value is the E2M1 value times 2^-14, exactly (code 1 lands on the f16
// subnormal 2^-15). Nibbles j and j + 4 of the word share a pair: their magnitude bits, at
// 4j..4j+2 and 16+4j.., go to 9..11 and 25..27, their sign bits, at 4j+3 and 16+4j+3, to
// 15 and 31. Masks and multiplies place them (NVIDIA runs an integer multiply on its FMA
// pipe, a shift on the integer pipe the decode saturates); only pair 3, whose bits move
// right, takes a shift; it reads faster than shift-and-mask placement (docs/perf.md#kernels).
struct W2 {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

// A word's eight values: columns 0..3 and 4..7.
fn word_f16(q: u32) -> W2 {
    let a = unpack2x16float((q & 0x00070007u) * 512u + (q & 0x00080008u) * 4096u);
    let c = unpack2x16float((q & 0x00700070u) * 32u + (q & 0x00800080u) * 256u);
    let e = unpack2x16float((q & 0x07000700u) * 2u + (q & 0x08000800u) * 16u);
    let g = unpack2x16float(((q & 0x70007000u) >> 3u) | (q & 0x80008000u));
    return W2(vec4<f32>(a.x, c.x, e.x, g.x), vec4<f32>(a.y, c.y, e.y, g.y));
}

// 2^14, undoing the f16 placement.
const F16_BIAS: f32 = 16384.0;

// The s > 240 path: each of a word's eight E2M1 values (exact in f32) times the scale, as the
// CPU dequantizes. Built from the f16 pairs rather than a table, which a shader compiler
// keeps in memory (lavapipe took minutes to compile the table version).
fn word_plain(q: u32, sc: f32) -> W2 {
    let v = word_f16(q);
    return W2(v.lo * F16_BIAS * sc, v.hi * F16_BIAS * sc);
}

struct WU {
    q: vec4<u32>,
    s: u32,
}

// The unit and its scale byte.
fn load_w(wrow: u32, u: u32) -> WU {
    let si = wrow * p.groups + u;
    return WU(w[wrow * p.units + u], (scales[si >> 2u] >> ((si & 3u) * 8u)) & 0xFFu);
}

// A unit's four words of values and the factor its dot product takes: the scale (times the
// placement's bias), or 1 where the scale went into every element.
struct DU {
    w0: W2,
    w1: W2,
    w2: W2,
    w3: W2,
    f: f32,
}

fn decode_unit(wu: WU) -> DU {
    let s = wu.s;
    let q = wu.q;
    let sc = bitcast<f32>(s << 23u);
    if (s > 240u) {
        // Where the scale is huge, and for the +inf scale (a zero nibble then gives NaN as
        // on the CPU), the scale is applied per element, as the CPU dequantizes.
        return DU(word_plain(q.x, sc), word_plain(q.y, sc), word_plain(q.z, sc), word_plain(q.w, sc), 1.0);
    }
    return DU(word_f16(q.x), word_f16(q.y), word_f16(q.z), word_f16(q.w), sc * F16_BIAS);
}

// The matvec's unit dot product, decoded and summed inside each branch so that only the sum
// leaves it: built as `decoded_dot(decode_unit(w), x)`, each branch carried 33 values out,
// and the batched expert matvec ran markedly slower (docs/perf.md#kernels). Same arithmetic
// in the same order.
fn unit_dot(wu: WU, xv: XU) -> f32 {
    let s = wu.s;
    let q = wu.q;
    if (SPECIAL != 0u && s > 240u) {
        return decoded_dot(decode_unit(wu), xv);
    }
    let sc = bitcast<f32>(s << 23u);
    let d = word_dot(word_f16(q.x), xv.x0, xv.x1) + word_dot(word_f16(q.y), xv.x2, xv.x3)
        + word_dot(word_f16(q.z), xv.x4, xv.x5) + word_dot(word_f16(q.w), xv.x6, xv.x7);
    return d * (sc * F16_BIAS);
}

// Staging (matvec_staged.wgsl) takes x as it is.
fn prep_x4(v: vec4<f32>) -> vec4<f32> {
    return v;
}

fn word_dot(v: W2, xa: vec4<f32>, xb: vec4<f32>) -> f32 {
    return dot(v.lo, xa) + dot(v.hi, xb);
}

fn decoded_dot(du: DU, xv: XU) -> f32 {
    let d = (dot(du.w0.lo, xv.x0) + dot(du.w0.hi, xv.x1)) + (dot(du.w1.lo, xv.x2) + dot(du.w1.hi, xv.x3))
        + (dot(du.w2.lo, xv.x4) + dot(du.w2.hi, xv.x5)) + (dot(du.w3.lo, xv.x6) + dot(du.w3.hi, xv.x7));
    return d * du.f;
}

// Batched experts: work item item0 + wg.x = (expert slot, pair, 1) from `rt`, wg.y the row
// group. The pair's input row comes from the gather table at rt[map_off + pair]; the output
// is row `pair` of y ([pairs, rows]). Pairs are grouped by expert, so the workgroups that
// run together share the expert's rows through L2.
@compute @workgroup_size(WG)
fn moe(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    gemv_rows(moe_job(wg, lanes.lid));
}

// `moe` with x staged in workgroup memory (matvec_staged.wgsl).
@compute @workgroup_size(WG)
fn moe_xs(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    gemv_rows_xs(moe_job(wg, lanes.lid));
}

fn moe_job(wg: vec3<u32>, lid: u32) -> RowJob {
    let item = p.item0 + wg.x;
    let slot = rt[3u * item];
    let pr = rt[3u * item + 1u];
    return row_job(lid, wg.y, slot * p.rows, rt[p.map_off + pr] * p.x_stride4, pr * p.y_stride);
}

// Batched experts, up to four pairs of one expert a workgroup: work item item0 + wg.x =
// (expert slot, first pair, pairs), wg.y the row group, lanes placed as in `moe`. Each lane
// reads and decodes its weight units once for all the item's pairs instead of once a pair
// (a decode step of several streams routes most experts two to eight rows); each pair's
// sums take `moe`'s order. x is read from global memory: four rows do not fit a staging
// tile.
@compute @workgroup_size(WG)
fn moe_t4(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let item = p.item0 + wg.x;
    let slot = rt[3u * item];
    let pr0 = rt[3u * item + 1u];
    let last = max(rt[3u * item + 2u], 1u) - 1u;
    let j = row_job(lanes.lid, wg.y, slot * p.rows, 0u, 0u);
    // Past the item's pairs a lane repeats the last one (computed, never written), so every
    // lane reaches the reductions.
    let m = p.map_off + pr0;
    let xb = vec4<u32>(rt[m], rt[m + min(1u, last)], rt[m + min(2u, last)], rt[m + min(3u, last)]) * p.x_stride4;
    var acc = PairSums(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
    let wl = j.nrows - 1u;
    var u = j.lane;
    var cur = load_w8(j.wrow, wl, min(u, p.units - 1u));
    while (u < p.units) {
        let un = u + LPR;
        let nxt = load_w8(j.wrow, wl, min(un, p.units - 1u));
        acc = step4(acc, cur, xb, u);
        cur = nxt;
        u = un;
    }
    for (var t = 0u; t < 4u; t++) {
        let sums = Acc(vec4<f32>(acc.r0[t], acc.r1[t], acc.r2[t], acc.r3[t]), vec4<f32>(acc.r4[t], acc.r5[t], acc.r6[t], acc.r7[t]));
        write_sums(sums, RPL, j.lane, (pr0 + t) * p.y_stride + j.yb, 1u, select(0u, j.valid, t <= last));
        // The next pair's partial sums reuse this one's workgroup slots.
        workgroupBarrier();
    }
}

// Per row of a lane (RPL at most 8), its sums for each of four pairs.
struct PairSums {
    r0: vec4<f32>,
    r1: vec4<f32>,
    r2: vec4<f32>,
    r3: vec4<f32>,
    r4: vec4<f32>,
    r5: vec4<f32>,
    r6: vec4<f32>,
    r7: vec4<f32>,
}

fn step4(acc: PairSums, w: W8, xb: vec4<u32>, u: u32) -> PairSums {
    var r = acc;
    if (SPECIAL != 0u) {
        // Huge scales may sit in the arena: each unit through `unit_dot`'s per-element path.
        r.r0 += unit_dot4(w.w0, xb, u);
        if (RPL > 1u) {
            r.r1 += unit_dot4(w.w1, xb, u);
        }
        if (RPL > 2u) {
            r.r2 += unit_dot4(w.w2, xb, u);
        }
        if (RPL > 3u) {
            r.r3 += unit_dot4(w.w3, xb, u);
        }
        if (RPL > 4u) {
            r.r4 += unit_dot4(w.w4, xb, u);
        }
        if (RPL > 5u) {
            r.r5 += unit_dot4(w.w5, xb, u);
        }
        if (RPL > 6u) {
            r.r6 += unit_dot4(w.w6, xb, u);
        }
        if (RPL > 7u) {
            r.r7 += unit_dot4(w.w7, xb, u);
        }
        return r;
    }
    // Word by word: the four rows' slices of x are loaded once for all RPL rows, and each
    // row's word is decoded once for the four; the unit's sums then take its scale, as in
    // `unit_dot` (same order: the four word dots left to right, then the scale).
    var d = PairSums(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
    for (var k = 0u; k < 4u; k++) {
        let o = u * UV + 2u * k;
        let xs = X8(x[xb.x + o], x[xb.x + o + 1u], x[xb.y + o], x[xb.y + o + 1u],
            x[xb.z + o], x[xb.z + o + 1u], x[xb.w + o], x[xb.w + o + 1u]);
        d.r0 += word_dots(word_f16(w.w0.q[k]), xs);
        if (RPL > 1u) {
            d.r1 += word_dots(word_f16(w.w1.q[k]), xs);
        }
        if (RPL > 2u) {
            d.r2 += word_dots(word_f16(w.w2.q[k]), xs);
        }
        if (RPL > 3u) {
            d.r3 += word_dots(word_f16(w.w3.q[k]), xs);
        }
        if (RPL > 4u) {
            d.r4 += word_dots(word_f16(w.w4.q[k]), xs);
        }
        if (RPL > 5u) {
            d.r5 += word_dots(word_f16(w.w5.q[k]), xs);
        }
        if (RPL > 6u) {
            d.r6 += word_dots(word_f16(w.w6.q[k]), xs);
        }
        if (RPL > 7u) {
            d.r7 += word_dots(word_f16(w.w7.q[k]), xs);
        }
    }
    r.r0 += d.r0 * unit_factor(w.w0);
    if (RPL > 1u) {
        r.r1 += d.r1 * unit_factor(w.w1);
    }
    if (RPL > 2u) {
        r.r2 += d.r2 * unit_factor(w.w2);
    }
    if (RPL > 3u) {
        r.r3 += d.r3 * unit_factor(w.w3);
    }
    if (RPL > 4u) {
        r.r4 += d.r4 * unit_factor(w.w4);
    }
    if (RPL > 5u) {
        r.r5 += d.r5 * unit_factor(w.w5);
    }
    if (RPL > 6u) {
        r.r6 += d.r6 * unit_factor(w.w6);
    }
    if (RPL > 7u) {
        r.r7 += d.r7 * unit_factor(w.w7);
    }
    return r;
}

// A unit's scale times the f16 placement's bias (scales of at most 240).
fn unit_factor(wu: WU) -> f32 {
    return bitcast<f32>(wu.s << 23u) * F16_BIAS;
}

// One word's dot products with the matching slices of four x rows (x0, x1: the first
// row's two vec4s, x2, x3: the second's, ...).
fn word_dots(v: W2, xs: X8) -> vec4<f32> {
    return vec4<f32>(word_dot(v, xs.x0, xs.x1), word_dot(v, xs.x2, xs.x3),
        word_dot(v, xs.x4, xs.x5), word_dot(v, xs.x6, xs.x7));
}

// A word's dot products with four x rows (vec4 offsets xb + o, xb + o + 1).
fn word_dot4(v: W2, xb: vec4<u32>, o: u32) -> vec4<f32> {
    return vec4<f32>(
        word_dot(v, x[xb.x + o], x[xb.x + o + 1u]),
        word_dot(v, x[xb.y + o], x[xb.y + o + 1u]),
        word_dot(v, x[xb.z + o], x[xb.z + o + 1u]),
        word_dot(v, x[xb.w + o], x[xb.w + o + 1u]));
}

// `unit_dot` of one unit against unit u of four x rows, each word decoded once.
fn unit_dot4(wu: WU, xb: vec4<u32>, u: u32) -> vec4<f32> {
    let s = wu.s;
    if (SPECIAL != 0u && s > 240u) {
        return vec4<f32>(unit_dot(wu, load_x(xb.x, u)), unit_dot(wu, load_x(xb.y, u)),
            unit_dot(wu, load_x(xb.z, u)), unit_dot(wu, load_x(xb.w, u)));
    }
    let q = wu.q;
    let o = u * UV;
    let d = word_dot4(word_f16(q.x), xb, o) + word_dot4(word_f16(q.y), xb, o + 2u)
        + word_dot4(word_f16(q.z), xb, o + 4u) + word_dot4(word_f16(q.w), xb, o + 6u);
    return d * (bitcast<f32>(s << 23u) * F16_BIAS);
}

// Batched experts, column-stationary (`cs_rows`): work item item0 + wg.x as in `moe`, wg.y
// the block of row_block rows.
@compute @workgroup_size(WG)
fn moe_cs(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let item = p.item0 + wg.x;
    let slot = rt[3u * item];
    let pr = rt[3u * item + 1u];
    cs_rows(slot * p.rows, wg.y, rt[p.map_off + pr] * p.x_stride4, pr * p.y_stride);
}

// Exact values: the f16 placement times its bias and the scale (a power of two that keeps
// them normal below s = 241), or the per-element path.
fn stage_unit(wu: WU, r: u32, c: u32) {
    let d = decode_unit(wu);
    stage4(d.w0.lo * d.f, r, c);
    stage4(d.w0.hi * d.f, r, c + 4u);
    stage4(d.w1.lo * d.f, r, c + 8u);
    stage4(d.w1.hi * d.f, r, c + 12u);
    stage4(d.w2.lo * d.f, r, c + 16u);
    stage4(d.w2.hi * d.f, r, c + 20u);
    stage4(d.w3.lo * d.f, r, c + 24u);
    stage4(d.w3.hi * d.f, r, c + 28u);
}

// Batched experts over chunks of tokens: work item item0 + wg.x = (expert slot, first pair,
// pairs), up to 4·GTC consecutive pairs of one expert, wg.y the row tile, wg.z the K segment. Each pair's input
// row is gathered as in `moe`; its output is row `pair` of y.
@compute @workgroup_size(WG)
fn moe_gemm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let item = p.item0 + wg.x;
    let slot = rt[3u * item];
    let pr0 = rt[3u * item + 1u];
    let cnt = rt[3u * item + 2u];
    if (lid < 4u * GTC) {
        gxrow[lid] = rt[p.map_off + pr0 + min(lid, cnt - 1u)] * p.x_stride4;
    }
    workgroupBarrier();
    gemm_tile(lid, slot * p.rows, wg.y * 4u * GTR, pr0, pr0 + cnt, wg.z);
}

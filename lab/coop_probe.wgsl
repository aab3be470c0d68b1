// Probe (lab/coop_probe.rs): an int4 matmul of up to 8 tokens on the GPU's matrix units
// (wgpu's cooperative matrices, 16x16x16 f16 -> f32), to see what a decode step of several
// streams could cost where each weight is decoded once for every row.
//
// Weights: int4, two's complement nibbles, low nibble = even column, one f32 scale per 64
// columns (the engine's dense int4 layout). x arrives as B: K x 16 f16, column t < 8 the
// high part of token t's x (scaled by 2^s_t so its largest entry is near 2^11), column 8 + t
// the low part (x 2^s_t - high, also f16): high + low carries 22 bits of each entry, as the
// engine's digit planes carry x to 2^-22 of a unit's largest entry. Products of int4 and f16
// are exact in the f32 accumulator, so the sum of the two columns is the 22-bit x's dot
// product; the group scale and 2^-s_t are applied in f32.
//
// A workgroup takes RB = 64 rows (four subgroups of 16) and walks K in steps of one scale
// group (64 columns): the 64 x 64 weight tile is decoded into workgroup memory as f16, each
// subgroup runs four 16x16x16 products into a fresh C, stores C, and each lane adds its
// rows' scaled sums into its registers.

enable f16;
enable wgpu_cooperative_matrix;

struct P {
    rows: u32,
    k: u32,
    tokens: u32,
    _p: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> sc: array<f32>;
@group(0) @binding(3) var<storage, read> xb: array<f16>;
@group(0) @binding(4) var<storage, read> down: array<f32>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;

const RB: u32 = 64u;
const KB: u32 = 64u;

var<workgroup> at: array<f16, 4096>;
var<workgroup> ct: array<f32, 1024>;

@compute @workgroup_size(128)
fn coop_int4(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row0 = wg.x * RB;
    let sg = lid / 32u;
    let lane = lid % 32u;
    let wpr = p.k / 8u;
    let groups = p.k / 64u;
    // Lane's C elements: row lane / 2 of its subgroup's 16, tokens 4 (lane % 2) .. + 4.
    let cr = lane / 2u;
    let ct0 = (lane % 2u) * 4u;
    var acc = vec4<f32>(0.0);
    let my_row = min(row0 + sg * 16u + cr, p.rows - 1u);
    for (var g = 0u; g < groups; g++) {
        // Decode: 64 rows x 8 words, four words a lane.
        for (var i = 0u; i < 4u; i++) {
            let wi = lid + 128u * i;
            let r = wi / 8u;
            let j = wi % 8u;
            let row = min(row0 + r, p.rows - 1u);
            let q = w[row * wpr + g * 8u + j];
            let b = r * KB + j * 8u;
            for (var c = 0u; c < 8u; c++) {
                let v = i32(q << (28u - 4u * c)) >> 28u;
                at[b + c] = f16(v);
            }
        }
        workgroupBarrier();
        var cm = coop_mat16x16<f32, C>();
        for (var kk = 0u; kk < 4u; kk++) {
            let a = coopLoadT<coop_mat16x16<f16, A>>(&at[sg * 16u * KB + kk * 16u], KB);
            let bm = coopLoadT<coop_mat16x16<f16, B>>(&xb[(g * KB + kk * 16u) * 16u], 16u);
            cm = coopMultiplyAdd(a, bm, cm);
        }
        coopStoreT(cm, &ct[sg * 256u], 16u);
        workgroupBarrier();
        let s = sc[my_row * groups + g];
        let base = sg * 256u + cr * 16u + ct0;
        let hi = vec4<f32>(ct[base], ct[base + 1u], ct[base + 2u], ct[base + 3u]);
        let lo = vec4<f32>(ct[base + 8u], ct[base + 9u], ct[base + 10u], ct[base + 11u]);
        acc += s * (hi + lo);
    }
    let row = row0 + sg * 16u + cr;
    if (row < p.rows) {
        for (var t = 0u; t < 4u; t++) {
            let tok = ct0 + t;
            if (tok < p.tokens) {
                y[tok * p.rows + row] = acc[t] * down[tok];
            }
        }
    }
}

// MXFP4 (E2M1 nibbles, one E8M0 byte per 32 columns): the block scale folds into the f16
// weight exactly, as value x 2^(s - o_r) with o_r the row's offset (its largest s minus 13),
// while every block of the row lies within 36 binades of its largest, so C sums the whole
// row in one product chain and is stored once. `ro` holds o_r per row.
@group(0) @binding(6) var<storage, read> ro: array<i32>;
// The E8M0 bytes, four a word.
@group(0) @binding(7) var<storage, read> scu: array<u32>;

// The E2M1 value of nibble n.
fn e2m1(n: u32) -> f32 {
    let e = (n >> 1u) & 3u;
    let m = f32(n & 1u);
    let mag = select(exp2(f32(e) - 1.0) * (1.0 + 0.5 * m), 0.5 * m, e == 0u);
    return select(mag, -mag, n >= 8u);
}

@compute @workgroup_size(128)
fn coop_mxfp4(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row0 = wg.x * RB;
    let sg = lid / 32u;
    let lane = lid % 32u;
    let wpr = p.k / 8u;
    let spr = p.k / 32u;
    let steps = p.k / KB;
    var cm = coop_mat16x16<f32, C>();
    for (var g = 0u; g < steps; g++) {
        for (var i = 0u; i < 4u; i++) {
            let wi = lid + 128u * i;
            let r = wi / 8u;
            let j = wi % 8u;
            let row = min(row0 + r, p.rows - 1u);
            let q = w[row * wpr + g * 8u + j];
            let si = row * spr + g * 2u + j / 4u;
            let s = i32((scu[si / 4u] >> ((si % 4u) * 8u)) & 0xFFu);
            let f = exp2(f32(s - ro[row]));
            let b = r * KB + j * 8u;
            for (var c = 0u; c < 8u; c++) {
                at[b + c] = f16(e2m1((q >> (4u * c)) & 0xFu) * f);
            }
        }
        workgroupBarrier();
        for (var kk = 0u; kk < 4u; kk++) {
            let a = coopLoadT<coop_mat16x16<f16, A>>(&at[sg * 16u * KB + kk * 16u], KB);
            let bm = coopLoadT<coop_mat16x16<f16, B>>(&xb[(g * KB + kk * 16u) * 16u], 16u);
            cm = coopMultiplyAdd(a, bm, cm);
        }
        workgroupBarrier();
    }
    coopStoreT(cm, &ct[sg * 256u], 16u);
    workgroupBarrier();
    let cr = lane / 2u;
    let ct0 = (lane % 2u) * 4u;
    let row = row0 + sg * 16u + cr;
    if (row < p.rows) {
        let up = exp2(f32(ro[row] - 127));
        let base = sg * 256u + cr * 16u + ct0;
        for (var t = 0u; t < 4u; t++) {
            let tok = ct0 + t;
            if (tok < p.tokens) {
                y[tok * p.rows + row] = (ct[base + t] + ct[base + 8u + t]) * up * down[tok];
            }
        }
    }
}

// Where coop_int4's time goes: the same walk with only the products (the tile decoded once,
// before the loop) and with only the decode (no products; the tile's sum is written so the
// decode stays). Timing only.
@compute @workgroup_size(128)
fn coop_mma_only(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    // Every binding of coop_int4 in the layout, so one bind group fits all entries.
    _ = sc[0];
    _ = down[0];
    _ = xb[0];
    let row0 = wg.x * RB;
    let sg = lid / 32u;
    let wpr = p.k / 8u;
    let groups = p.k / 64u;
    for (var i = 0u; i < 4u; i++) {
        let wi = lid + 128u * i;
        let r = wi / 8u;
        let j = wi % 8u;
        let q = w[min(row0 + r, p.rows - 1u) * wpr + j];
        for (var c = 0u; c < 8u; c++) {
            at[r * KB + j * 8u + c] = f16(i32(q << (28u - 4u * c)) >> 28u);
        }
    }
    workgroupBarrier();
    var cm = coop_mat16x16<f32, C>();
    for (var g = 0u; g < groups; g++) {
        for (var kk = 0u; kk < 4u; kk++) {
            let a = coopLoadT<coop_mat16x16<f16, A>>(&at[sg * 16u * KB + kk * 16u], KB);
            let bm = coopLoadT<coop_mat16x16<f16, B>>(&xb[(g * KB + kk * 16u) * 16u], 16u);
            cm = coopMultiplyAdd(a, bm, cm);
        }
    }
    coopStoreT(cm, &ct[sg * 256u], 16u);
    workgroupBarrier();
    let row = row0 + lid / 2u;
    if (row < p.rows) {
        y[row] = ct[(lid / 32u) * 256u + (lid % 32u)];
    }
}

@compute @workgroup_size(128)
fn coop_decode_only(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    // Every binding of coop_int4 in the layout, so one bind group fits all entries.
    _ = sc[0];
    _ = down[0];
    _ = xb[0];
    let row0 = wg.x * RB;
    let wpr = p.k / 8u;
    let groups = p.k / 64u;
    var s = 0.0;
    for (var g = 0u; g < groups; g++) {
        for (var i = 0u; i < 4u; i++) {
            let wi = lid + 128u * i;
            let r = wi / 8u;
            let j = wi % 8u;
            let q = w[min(row0 + r, p.rows - 1u) * wpr + g * 8u + j];
            for (var c = 0u; c < 8u; c++) {
                at[r * KB + j * 8u + c] = f16(i32(q << (28u - 4u * c)) >> 28u);
            }
        }
        workgroupBarrier();
        s += f32(at[(lid * 37u + g) % 4096u]);
        workgroupBarrier();
    }
    let row = row0 + lid / 2u;
    if (row < p.rows) {
        y[row] = s;
    }
}

// coop_int4 with K split over wg.y: segment wg.y walks groups wg.y·SEG .. (SEG a group count
// in p._p); partial sums only (timing).
@compute @workgroup_size(128)
fn coop_int4_split(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    // Every binding of coop_int4 in the layout, so one bind group fits all entries.
    _ = sc[0];
    _ = down[0];
    _ = xb[0];
    let row0 = wg.x * RB;
    let sg = lid / 32u;
    let lane = lid % 32u;
    let wpr = p.k / 8u;
    let groups = p.k / 64u;
    let g0 = wg.y * p._p;
    let g1 = min(g0 + p._p, groups);
    let cr = lane / 2u;
    let ct0 = (lane % 2u) * 4u;
    var acc = vec4<f32>(0.0);
    let my_row = min(row0 + sg * 16u + cr, p.rows - 1u);
    for (var g = g0; g < g1; g++) {
        for (var i = 0u; i < 4u; i++) {
            let wi = lid + 128u * i;
            let r = wi / 8u;
            let j = wi % 8u;
            let q = w[min(row0 + r, p.rows - 1u) * wpr + g * 8u + j];
            for (var c = 0u; c < 8u; c++) {
                at[r * KB + j * 8u + c] = f16(i32(q << (28u - 4u * c)) >> 28u);
            }
        }
        workgroupBarrier();
        var cm = coop_mat16x16<f32, C>();
        for (var kk = 0u; kk < 4u; kk++) {
            let a = coopLoadT<coop_mat16x16<f16, A>>(&at[sg * 16u * KB + kk * 16u], KB);
            let bm = coopLoadT<coop_mat16x16<f16, B>>(&xb[(g * KB + kk * 16u) * 16u], 16u);
            cm = coopMultiplyAdd(a, bm, cm);
        }
        coopStoreT(cm, &ct[sg * 256u], 16u);
        workgroupBarrier();
        let s = sc[my_row * groups + g];
        let base = sg * 256u + cr * 16u + ct0;
        acc += s * vec4<f32>(ct[base], ct[base + 1u], ct[base + 2u], ct[base + 3u]);
    }
    let row = row0 + sg * 16u + cr;
    if (row < p.rows) {
        for (var t = 0u; t < 4u; t++) {
            y[((wg.y * 8u) + ct0 + t) % 8u * p.rows + row] = acc[t];
        }
    }
}

// v2: one subgroup a workgroup (16 rows), K split over wg.y (p._p groups a segment), the
// tile decoded without int-to-float conversions (two nibbles a time into f16 pairs through
// the bits of 1024 + n) and in an order that keeps the 32 lanes' stores on distinct banks,
// the next group's words requested before this group's products. Segment wg.y writes its
// partial sums (correct alone where one segment covers the row).
var<workgroup> a2: array<f16, 1024>;
var<workgroup> c2: array<f32, 256>;

@compute @workgroup_size(32)
fn coop_int4_v2(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    _ = down[0];
    let row0 = wg.x * 16u;
    let wpr = p.k / 8u;
    let groups = p.k / 64u;
    let g0 = wg.y * p._p;
    let g1 = min(g0 + p._p, groups);
    var acc = vec4<f32>(0.0);
    let cr = lid / 2u;
    let ct0 = (lid % 2u) * 4u;
    let my_row = min(row0 + cr, p.rows - 1u);
    // Lane's words: i-th is row 4 i + lid / 8, word lid % 8 of the group.
    let j = lid % 8u;
    let rl = lid / 8u;
    var q: array<u32, 4>;
    for (var i = 0u; i < 4u; i++) {
        q[i] = w[min(row0 + 4u * i + rl, p.rows - 1u) * wpr + g0 * 8u + j];
    }
    for (var g = g0; g < g1; g++) {
        for (var i = 0u; i < 4u; i++) {
            let r = 4u * i + rl;
            let base = r * 64u + j * 8u;
            for (var kk = 0u; kk < 4u; kk++) {
                // Nibbles k and k + 4 of the word, rotated by the row so lanes of one word
                // index but different rows start on different banks.
                let k = (kk + rl) % 4u;
                let bits = ((q[i] >> (4u * k)) & 0x000F000Fu) ^ 0x64086408u;
                let v = unpack2x16float(bits) - vec2<f32>(1032.0);
                a2[base + k] = f16(v.x);
                a2[base + k + 4u] = f16(v.y);
            }
        }
        // Next group's words, in flight during the products.
        let gn = min(g + 1u, groups - 1u);
        for (var i = 0u; i < 4u; i++) {
            q[i] = w[min(row0 + 4u * i + rl, p.rows - 1u) * wpr + gn * 8u + j];
        }
        let s = sc[my_row * groups + g];
        workgroupBarrier();
        var cm = coop_mat16x16<f32, C>();
        for (var kk = 0u; kk < 4u; kk++) {
            let a = coopLoadT<coop_mat16x16<f16, A>>(&a2[kk * 16u], 64u);
            let bm = coopLoadT<coop_mat16x16<f16, B>>(&xb[(g * 64u + kk * 16u) * 16u], 16u);
            cm = coopMultiplyAdd(a, bm, cm);
        }
        coopStoreT(cm, &c2[0], 16u);
        workgroupBarrier();
        let base = cr * 16u + ct0;
        let hi = vec4<f32>(c2[base], c2[base + 1u], c2[base + 2u], c2[base + 3u]);
        let lo = vec4<f32>(c2[base + 8u], c2[base + 9u], c2[base + 10u], c2[base + 11u]);
        acc += s * (hi + lo);
    }
    let row = row0 + cr;
    if (row < p.rows) {
        for (var t = 0u; t < 4u; t++) {
            let tok = ct0 + t;
            if (tok < p.tokens) {
                y[tok * p.rows + row] = acc[t] * down[tok];
            }
        }
    }
}

// v3: one subgroup a workgroup takes 64 rows (four 16-row tiles), so each step's four B
// fragments are loaded once for four tiles' products (v1 and v2 load B for every 16 rows);
// K split over wg.y as in v2.
var<workgroup> a3: array<f16, 4096>;
var<workgroup> c3: array<f32, 1024>;

@compute @workgroup_size(32)
fn coop_int4_v3(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    _ = down[0];
    let row0 = wg.x * 64u;
    let wpr = p.k / 8u;
    let groups = p.k / 64u;
    let g0 = wg.y * p._p;
    let g1 = min(g0 + p._p, groups);
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    let cr = lid / 2u;
    let ct0 = (lid % 2u) * 4u;
    let j = lid % 8u;
    let rl = lid / 8u;
    for (var g = g0; g < g1; g++) {
        // 64 rows x 8 words: word i of the lane is row 4 i + lid / 8.
        for (var i = 0u; i < 16u; i++) {
            let r = 4u * i + rl;
            let q = w[min(row0 + r, p.rows - 1u) * wpr + g * 8u + j];
            let base = r * 64u + j * 8u;
            for (var kk = 0u; kk < 4u; kk++) {
                let k = (kk + rl) % 4u;
                let v = unpack2x16float(((q >> (4u * k)) & 0x000F000Fu) ^ 0x64086408u) - vec2<f32>(1032.0);
                a3[base + k] = f16(v.x);
                a3[base + k + 4u] = f16(v.y);
            }
        }
        workgroupBarrier();
        let b0 = coopLoadT<coop_mat16x16<f16, B>>(&xb[(g * 64u) * 16u], 16u);
        let b1 = coopLoadT<coop_mat16x16<f16, B>>(&xb[(g * 64u + 16u) * 16u], 16u);
        let b2 = coopLoadT<coop_mat16x16<f16, B>>(&xb[(g * 64u + 32u) * 16u], 16u);
        let b3 = coopLoadT<coop_mat16x16<f16, B>>(&xb[(g * 64u + 48u) * 16u], 16u);
        for (var t = 0u; t < 4u; t++) {
            var cm = coop_mat16x16<f32, C>();
            cm = coopMultiplyAdd(coopLoadT<coop_mat16x16<f16, A>>(&a3[t * 1024u], 64u), b0, cm);
            cm = coopMultiplyAdd(coopLoadT<coop_mat16x16<f16, A>>(&a3[t * 1024u + 16u], 64u), b1, cm);
            cm = coopMultiplyAdd(coopLoadT<coop_mat16x16<f16, A>>(&a3[t * 1024u + 32u], 64u), b2, cm);
            cm = coopMultiplyAdd(coopLoadT<coop_mat16x16<f16, A>>(&a3[t * 1024u + 48u], 64u), b3, cm);
            coopStoreT(cm, &c3[t * 256u], 16u);
        }
        workgroupBarrier();
        let base = cr * 16u + ct0;
        let r = min(row0 + cr, p.rows - 1u);
        acc0 += sc[r * groups + g] * (vec4<f32>(c3[base], c3[base + 1u], c3[base + 2u], c3[base + 3u])
            + vec4<f32>(c3[base + 8u], c3[base + 9u], c3[base + 10u], c3[base + 11u]));
        let r1 = min(r + 16u, p.rows - 1u);
        acc1 += sc[r1 * groups + g] * (vec4<f32>(c3[256u + base], c3[257u + base], c3[258u + base], c3[259u + base])
            + vec4<f32>(c3[264u + base], c3[265u + base], c3[266u + base], c3[267u + base]));
        let r2 = min(r + 32u, p.rows - 1u);
        acc2 += sc[r2 * groups + g] * (vec4<f32>(c3[512u + base], c3[513u + base], c3[514u + base], c3[515u + base])
            + vec4<f32>(c3[520u + base], c3[521u + base], c3[522u + base], c3[523u + base]));
        let r3 = min(r + 48u, p.rows - 1u);
        acc3 += sc[r3 * groups + g] * (vec4<f32>(c3[768u + base], c3[769u + base], c3[770u + base], c3[771u + base])
            + vec4<f32>(c3[776u + base], c3[777u + base], c3[778u + base], c3[779u + base]));
        workgroupBarrier();
    }
    let accs = array<vec4<f32>, 4>(acc0, acc1, acc2, acc3);
    for (var tile = 0u; tile < 4u; tile++) {
        let row = row0 + tile * 16u + cr;
        if (row < p.rows) {
            for (var t = 0u; t < 4u; t++) {
                let tok = ct0 + t;
                if (tok < p.tokens) {
                    y[tok * p.rows + row] = accs[tile][t] * down[tok];
                }
            }
        }
    }
}

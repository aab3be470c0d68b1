// Dense matmuls of 2 to 8 rows of x on the GPU's matrix units (wgpu's cooperative matrices,
// 16x16x16 f16 products summed in f32), for a decode step of several streams: each weight
// is decoded once for every row, and the multiply-adds of the rows run on the matrix units
// instead of the f32 lanes (docs/perf.md#what-3x-and-5x-ask-of-the-gpu).
//
// Exactness: int4 and int8 values are exact in f16, and x reaches the matrix units as two
// f16 parts (`x_halves`): row t is scaled by 2^s_t so its largest entry lies in
// [2^14, 2^15), and B's column t holds the high part (x 2^s_t cut to f16's 11 significant
// bits), column 8 + t the low part f16(x 2^s_t - high). The two carry 22 bits of each
// entry. A product of two f16 is exact in the f32 sum, so C's columns t and 8 + t added are
// the dot product of the 22-bit x; the scales (int4: one f32 a 64-column group, int8: one a row) and 2^-s_t are applied
// in f32.
//
// A workgroup is SGS subgroups of 32 lanes, 16 weight rows each, and walks K in steps of
// 64 columns: the SGS·16 × 64 weight tile is decoded into workgroup memory as f16, each
// subgroup multiplies its 16 rows' tile by B's 64 × 16 slice, and (int4) the step's sums
// are stored and added into each lane's registers under the group's scale.

enable f16;
enable wgpu_cooperative_matrix;

// The context's workgroup size (a power of two up to 256): x_halves' lanes.
override WG: u32 = 256u;
// Subgroups (of 32 lanes) a workgroup of the matmuls.
override SGS: u32 = 4u;
// Weight rows a workgroup: 16 a subgroup.
override RB: u32 = 16u * SGS;

// The words of `MvParams` (matvec_common.wgsl) these entries read: rows of the chunk,
// 16-byte weight units a row, rows of x, the chunk's first row, y's row stride and x's in
// vec4s, and the 64-column scale groups a row.
struct CoopParams {
    rows: u32,
    units: u32,
    n: u32,
    row0: u32,
    y_stride: u32,
    x_stride4: u32,
    groups: u32,
}

@group(0) @binding(0) var<uniform> p: CoopParams;
// B: 64·steps rows of 16 f16 (x_halves' output).
@group(0) @binding(1) var<storage, read> xb: array<f16>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> w: array<u32>;
@group(0) @binding(4) var<storage, read> scale: array<f32>;
// 2^-s_t for each row t of x.
@group(0) @binding(5) var<storage, read> down: array<f32>;

// The decoded weight tile (RB rows of 64) and the subgroups' 16 × 16 sums.
var<workgroup> at: array<f16, 4096>;
var<workgroup> ct: array<f32, 1024>;

// Multiplies subgroup `sg`'s 16 rows of the tile by B's rows 64 g .. 64 g + 63 into `c`.
fn tile_product(sg: u32, g: u32, c: coop_mat16x16<f32, C>) -> coop_mat16x16<f32, C> {
    var cm = c;
    for (var kk = 0u; kk < 4u; kk++) {
        let a = coopLoadT<coop_mat16x16<f16, A>>(&at[sg * 1024u + kk * 16u], 64u);
        let b = coopLoadT<coop_mat16x16<f16, B>>(&xb[(g * 64u + kk * 16u) * 16u], 16u);
        cm = coopMultiplyAdd(a, b, cm);
    }
    return cm;
}

// Writes lane `lid`'s four sums (row lid / 2 of the workgroup's, x rows 4 (lid % 2) ..)
// times `f` and 2^-s_t, where the row and x row exist.
fn write_rows(row0: u32, lid: u32, acc: vec4<f32>, f: f32) {
    let row = row0 + lid / 2u;
    if (row >= p.rows) {
        return;
    }
    for (var i = 0u; i < 4u; i++) {
        let t = (lid % 2u) * 4u + i;
        if (t < p.n) {
            y[t * p.y_stride + p.row0 + row] = acc[i] * f * down[t];
        }
    }
}

// Word `word` of the tile's row r (from row0; rows past the chunk repeat its last), or 0 past
// the row's `wpr` words: a row's last step may hold fewer words than a whole step.
fn weight_word(row0: u32, r: u32, word: u32, wpr: u32) -> u32 {
    let row = min(row0 + r, p.rows - 1u);
    return select(0u, w[row * wpr + min(word, wpr - 1u)], word < wpr);
}

// The high and low parts of C's entries for lane `lid` of a workgroup: its row's four x
// rows, high plus low.
fn lane_sums(lid: u32) -> vec4<f32> {
    let sg = lid / 32u;
    let base = sg * 256u + ((lid % 32u) / 2u) * 16u + (lid % 2u) * 4u;
    let hi = vec4<f32>(ct[base], ct[base + 1u], ct[base + 2u], ct[base + 3u]);
    let lo = vec4<f32>(ct[base + 8u], ct[base + 9u], ct[base + 10u], ct[base + 11u]);
    return hi + lo;
}

// int4 (two's complement nibbles, low nibble = even column, a 16-byte unit of 32 columns,
// one f32 scale a 64-column group): y[t, row0 + r] = W[r] · x[t]. A row's last group may
// hold one unit; its other half decodes as zeros.
@compute @workgroup_size(32u * SGS)
fn coop_int4(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row0 = wg.x * RB;
    let sg = lid / 32u;
    let wpr = p.units * 4u;
    var acc = vec4<f32>(0.0);
    let my_row = min(row0 + lid / 2u, p.rows - 1u);
    for (var g = 0u; g < p.groups; g++) {
        // RB rows × 8 words, 4 words a lane.
        for (var i = 0u; i < 4u; i++) {
            let wi = lid + 32u * SGS * i;
            let r = wi / 8u;
            let j = wi % 8u;
            let q = weight_word(row0, r, g * 8u + j, wpr);
            let b = r * 64u + j * 8u;
            for (var c = 0u; c < 8u; c++) {
                at[b + c] = f16(i32(q << (28u - 4u * c)) >> 28u);
            }
        }
        workgroupBarrier();
        let cm = tile_product(sg, g, coop_mat16x16<f32, C>());
        coopStoreT(cm, &ct[sg * 256u], 16u);
        workgroupBarrier();
        acc += scale[my_row * p.groups + g] * lane_sums(lid);
    }
    write_rows(row0, lid, acc, 1.0);
}

// int8 (one f32 scale a row; 16-byte units of 16 columns): the scale is the row's, so C sums
// the whole row in one product chain and is stored once.
@compute @workgroup_size(32u * SGS)
fn coop_int8(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row0 = wg.x * RB;
    let sg = lid / 32u;
    let wpr = p.units * 4u;
    var cm = coop_mat16x16<f32, C>();
    for (var g = 0u; g < p.groups; g++) {
        // RB rows × 16 words, 8 words a lane.
        for (var i = 0u; i < 8u; i++) {
            let wi = lid + 32u * SGS * i;
            let r = wi / 16u;
            let j = wi % 16u;
            let q = weight_word(row0, r, g * 16u + j, wpr);
            let b = r * 64u + j * 4u;
            for (var c = 0u; c < 4u; c++) {
                at[b + c] = f16(i32(q << (24u - 8u * c)) >> 24u);
            }
        }
        workgroupBarrier();
        cm = tile_product(sg, g, cm);
        workgroupBarrier();
    }
    coopStoreT(cm, &ct[sg * 256u], 16u);
    workgroupBarrier();
    let my_row = min(row0 + lid / 2u, p.rows - 1u);
    write_rows(row0, lid, lane_sums(lid), scale[my_row]);
}

// x_halves: rows of x (f32, x_stride4 vec4s each) into B's high and low parts and 2^-s_t;
// workgroup t takes row t (rows t >= n write zeros, so B's unused columns are zeros). B has
// 64 · groups rows; those past x's width are zeros.
@group(0) @binding(6) var<storage, read> xs: array<f32>;
@group(0) @binding(7) var<storage, read_write> xb_out: array<f16>;
@group(0) @binding(8) var<storage, read_write> down_out: array<f32>;

var<workgroup> peak: array<f32, 256>;

@compute @workgroup_size(WG)
fn x_halves(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wg.x;
    let cols = p.x_stride4 * 4u;
    let kb = p.groups * 64u;
    let live = t < p.n;
    var m = 0.0;
    if (live) {
        for (var k = lid; k < cols; k += WG) {
            m = max(m, abs(xs[t * cols + k]));
        }
    }
    peak[lid] = m;
    workgroupBarrier();
    for (var h = WG / 2u; h > 0u; h /= 2u) {
        if (lid < h) {
            peak[lid] = max(peak[lid], peak[lid + h]);
        }
        workgroupBarrier();
    }
    // m = f 2^e with f in [0.5, 1): x 2^(15 - e) puts the largest entry in [2^14, 2^15),
    // well inside f16's range; e is held within ±100 so the powers stay normal f32.
    let e = clamp(frexp(peak[0]).exp, -100, 100);
    let up = exp2(f32(15 - e));
    for (var k = lid; k < kb; k += WG) {
        var v = 0.0;
        if (live && k < cols) {
            v = xs[t * cols + k] * up;
        }
        // The high part is v cut to 11 significant bits by its bits, not f32(f16(v)): a
        // driver may fold that round trip to v, which leaves a low part of zero.
        let hi = bitcast<f32>(bitcast<u32>(v) & 0xFFFFE000u);
        xb_out[k * 16u + t] = f16(hi);
        xb_out[k * 16u + 8u + t] = f16(v - hi);
    }
    if (lid == 0u) {
        down_out[t] = select(0.0, 1.0 / up, live);
    }
}

// The row-split matvec with x staged in workgroup memory: the `dense_xs` entry here and
// `moe_xs` in matvec_mxfp4.wgsl, for the formats whose unit is 32 columns in four words
// (int4 outside the digit decode, MXFP4; composed after matvec_common.wgsl for those only).
//
// Why: a lane reads its unit's 128 bytes of x as eight 16-byte loads, so from global memory
// each load instruction of a 32-lane block touches one cache line per unit. Nsight Compute on
// the CUDA twin of the kernel (tools/cuda_probe, docs/perf.md, session 9) put the L1 at
// 88-99 % busy and DRAM at 35-45 %. Staged with one pad vec4 after each unit's eight,
// neighbouring units start 4 banks apart and a quarter-block's reads meet no bank conflict
// (without the pad all of them hit the same four banks, which is why an unpadded staging
// measured no gain).
//
// The format file defines `prep_x4` (a vec4 of x as its unit dot wants it, applied while
// staging) and, for XW 1, `word_dot_of(WU, j, xa, xb)` (word j's dot product with its two
// vec4s of prepared x, before the unit's factor) and `unit_factor(WU)`, summed in the order
// its `unit_dot` sums, so both paths give the same bits.

// Units of x staged at a time (the host sizes it to the workgroup memory; > 0 here).
override XT: u32 = 1u;
// (Named: see gw's size in matvec_common.wgsl.)
override XS_LEN: u32 = XT * 9u + 1u;
var<workgroup> xs: array<vec4<f32>, XS_LEN>;
// 0: a unit's eight vec4s of x are read before its rows' dot products (the measured default);
// 1: each word's two are read just before that word's dot products, so 8 values of x stay
// live instead of 32 (NVIDIA's compiler gives the staged MXFP4 expert kernel 128 registers
// against 80 unstaged; not measured yet).
override XW: u32 = 0u;

// x[b .. b + n), prepared, into xs, padded: each lane requests four vec4s before storing
// any, so a tile of a 7168-column row is one memory round trip for 256 lanes, not four.
fn stage_x(b: u32, n: u32) {
    for (var j = r_lid; j < n; j += 4u * WG) {
        let j1 = j + WG;
        let j2 = j + 2u * WG;
        let j3 = j + 3u * WG;
        let a0 = x[b + j];
        let a1 = x[b + min(j1, n - 1u)];
        let a2 = x[b + min(j2, n - 1u)];
        let a3 = x[b + min(j3, n - 1u)];
        xs[j + j / 8u] = prep_x4(a0);
        if (j1 < n) {
            xs[j1 + j1 / 8u] = prep_x4(a1);
        }
        if (j2 < n) {
            xs[j2 + j2 / 8u] = prep_x4(a2);
        }
        if (j3 < n) {
            xs[j3 + j3 / 8u] = prep_x4(a3);
        }
    }
}

// The staged unit whose vec4 0 is at xs[k].
fn xs_unit(k: u32) -> X8 {
    return X8(xs[k], xs[k + 1u], xs[k + 2u], xs[k + 3u], xs[k + 4u], xs[k + 5u], xs[k + 6u], xs[k + 7u]);
}

// `gemv_rows` with x in tiles of XT units, each copied by the whole workgroup; the lanes walk
// their units as there, the next unit's weights requested before this one is computed,
// across tile boundaries too. Every lane of the workgroup calls it (rows past the end repeat
// the last), so the barriers are uniform.
fn gemv_rows_xs(j: RowJob) {
    var acc = Acc(vec4<f32>(0.0), vec4<f32>(0.0));
    let last = j.nrows - 1u;
    var u = j.lane;
    var cur = load_w8(j.wrow, last, min(u, p.units - 1u));
    for (var t0 = 0u; t0 < p.units; t0 += XT) {
        let tn = min(XT, p.units - t0);
        // The previous tile's reads are done before it is overwritten.
        workgroupBarrier();
        stage_x(j.xb + t0 * 8u, tn * 8u);
        workgroupBarrier();
        while (u < t0 + tn) {
            let un = u + LPR;
            let nxt = load_w8(j.wrow, last, min(un, p.units - 1u));
            let k = (u - t0) * 9u;
            if (XW == 1u) {
                acc = step_words(acc, cur, k);
            } else {
                acc = step(acc, cur, xs_unit(k));
            }
            cur = nxt;
            u = un;
        }
    }
    write_sums(acc, RPL, j.lane, j.yb, 1u, j.valid);
}

// `step` reading the staged unit at xs[k] word by word.
fn step_words(acc: Acc, w: W8, k: u32) -> Acc {
    var d = Acc(vec4<f32>(0.0), vec4<f32>(0.0));
    d = words_step(d, w, 0u, xs[k], xs[k + 1u]);
    d = words_step(d, w, 1u, xs[k + 2u], xs[k + 3u]);
    d = words_step(d, w, 2u, xs[k + 4u], xs[k + 5u]);
    d = words_step(d, w, 3u, xs[k + 6u], xs[k + 7u]);
    // Rows past RPL hold zero units: their sums and factors are 0.
    let fa = vec4<f32>(unit_factor(w.w0), unit_factor(w.w1), unit_factor(w.w2), unit_factor(w.w3));
    let fb = vec4<f32>(unit_factor(w.w4), unit_factor(w.w5), unit_factor(w.w6), unit_factor(w.w7));
    return Acc(acc.a + d.a * fa, acc.b + d.b * fb);
}

// Word j's dot products of the RPL rows added to their partial sums.
fn words_step(d: Acc, w: W8, j: u32, xa: vec4<f32>, xb: vec4<f32>) -> Acc {
    var r = d;
    r.a.x += word_dot_of(w.w0, j, xa, xb);
    if (RPL > 1u) {
        r.a.y += word_dot_of(w.w1, j, xa, xb);
    }
    if (RPL > 2u) {
        r.a.z += word_dot_of(w.w2, j, xa, xb);
    }
    if (RPL > 3u) {
        r.a.w += word_dot_of(w.w3, j, xa, xb);
    }
    if (RPL > 4u) {
        r.b.x += word_dot_of(w.w4, j, xa, xb);
    }
    if (RPL > 5u) {
        r.b.y += word_dot_of(w.w5, j, xa, xb);
    }
    if (RPL > 6u) {
        r.b.z += word_dot_of(w.w6, j, xa, xb);
    }
    if (RPL > 7u) {
        r.b.w += word_dot_of(w.w7, j, xa, xb);
    }
    return r;
}

// `dense` with x staged.
@compute @workgroup_size(WG)
fn dense_xs(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    gemv_rows_xs(dense_job(wg, lanes.lid));
}

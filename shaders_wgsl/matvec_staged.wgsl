// The row-split matvec with x staged in workgroup memory: the `dense_xs` entry here and
// `moe_xs` in matvec_mxfp4.wgsl, for the formats whose unit is 32 columns in four words
// (int4 outside the digit decode, MXFP4; composed after matvec_common.wgsl for those only).
//
// Why: a lane reads its unit's 128 bytes of x as eight 16-byte loads, so from global memory
// each load instruction of a 32-lane block touches one cache line per unit: profiling a CUDA
// twin of the kernel showed the L1 busy and DRAM far from it (docs/perf.md#kernels). Staged
// with one pad vec4 after each unit's eight,
// neighbouring units start 4 banks apart and a quarter-block's reads meet no bank conflict
// (without the pad all of them hit the same four banks, which is why an unpadded staging
// measured no gain).
//
// The format file defines `prep_x4` (a vec4 of x as its unit dot wants it, applied while
// staging), so both paths give the same bits.

// Units of x staged at a time (the host sizes it to the workgroup memory; > 0 here).
override XT: u32 = 1u;
// (Named: see gw's size in matvec_common.wgsl.)
override XS_LEN: u32 = XT * 9u + 1u;
var<workgroup> xs: array<vec4<f32>, XS_LEN>;

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
            acc = step(acc, cur, xs_unit((u - t0) * 9u));
            cur = nxt;
            u = un;
        }
    }
    write_sums(acc, RPL, j.lane, j.yb, 1u, j.valid);
}

// `dense` with x staged.
@compute @workgroup_size(WG)
fn dense_xs(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    gemv_rows_xs(dense_job(wg, lanes.lid));
}

// The split-K sum of the chunk kernel (`gemm` in matvec_common.wgsl): a chunk with too few
// tiles to fill the GPU splits its K steps into `segs` segments whose partial outputs land
// in `part`, segment after segment; here y[t · y_stride + row0 + r] = Σ_s part[s][t][r], in
// segment order.

override WG: u32 = 256u;

struct SumParams {
    n: u32,
    rows: u32,
    y_stride: u32,
    row0: u32,
    segs: u32,
    seg_stride: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: SumParams;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(WG)
fn sum_segments(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i < p.n) {
        var acc = part[i];
        for (var s = 1u; s < p.segs; s++) {
            acc += part[s * p.seg_stride + i];
        }
        y[(i / p.rows) * p.y_stride + p.row0 + i % p.rows] = acc;
    }
}

// Batched MoE scatter: out[t] += Σ_j w_j · y[pair_j] over the pairs of token t, in the order
// the experts were listed (the CPU's accumulation order). `rt` holds, from the given
// offsets, the CSR row offsets (rows + 1), the pair ids and the weights' bits.

override WG: u32 = 256u;

struct ScatterParams {
    n: u32,
    cols: u32,
    csr_off: u32,
    pairs_off: u32,
    weights_off: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: ScatterParams;
@group(0) @binding(1) var<storage, read> ypair: array<f32>;
@group(0) @binding(2) var<storage, read> rt: array<u32>;
@group(0) @binding(3) var<storage, read_write> o: array<f32>;

@compute @workgroup_size(WG)
fn scatter(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i < p.n) {
        let t = i / p.cols;
        let c = i % p.cols;
        var acc = o[i];
        let end = rt[p.csr_off + t + 1u];
        var j = rt[p.csr_off + t];
        // Four pairs' outputs requested before any is added (one at a time waited out a
        // memory round trip per expert), then added in the same order as one at a time.
        for (; j + 3u < end; j += 4u) {
            let pr = vec4<u32>(rt[p.pairs_off + j], rt[p.pairs_off + j + 1u], rt[p.pairs_off + j + 2u], rt[p.pairs_off + j + 3u]);
            let y = vec4<f32>(ypair[pr.x * p.cols + c], ypair[pr.y * p.cols + c], ypair[pr.z * p.cols + c], ypair[pr.w * p.cols + c]);
            acc += bitcast<f32>(rt[p.weights_off + j]) * y.x;
            acc += bitcast<f32>(rt[p.weights_off + j + 1u]) * y.y;
            acc += bitcast<f32>(rt[p.weights_off + j + 2u]) * y.z;
            acc += bitcast<f32>(rt[p.weights_off + j + 3u]) * y.w;
        }
        for (; j < end; j++) {
            acc += bitcast<f32>(rt[p.weights_off + j]) * ypair[rt[p.pairs_off + j] * p.cols + c];
        }
        o[i] = acc;
    }
}

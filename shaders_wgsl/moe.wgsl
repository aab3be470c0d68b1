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
        for (var j = rt[p.csr_off + t]; j < rt[p.csr_off + t + 1u]; j++) {
            let pr = rt[p.pairs_off + j];
            let wgt = bitcast<f32>(rt[p.weights_off + j]);
            acc += wgt * ypair[pr * p.cols + c];
        }
        o[i] = acc;
    }
}

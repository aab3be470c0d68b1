// RMSNorm of every `group`-wide slice: one workgroup per slice.

struct NormParams {
    groups: u32,
    group: u32,
    eps: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: NormParams;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> o: array<f32>;

@compute @workgroup_size(WG)
fn rmsnorm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let gi = wg.x + wg.y * nwg.x;
    let g = min(gi, p.groups - 1u);
    let base = g * p.group;
    var ss = 0.0;
    for (var c = lanes.lid; c < p.group; c += WG) {
        let v = x[base + c];
        ss += v * v;
    }
    let tot = wg_sum(ss);
    let s = 1.0 / sqrt(tot / f32(p.group) + p.eps);
    if (gi < p.groups) {
        for (var c = lanes.lid; c < p.group; c += WG) {
            o[base + c] = x[base + c] * s * w[c];
        }
    }
}

// RMSNorm of every `group`-wide slice: one workgroup per slice.
//
// A decode step norms one 7168-wide row in one workgroup, where a loop of one load per
// iteration waits out the memory latency once per element a lane owns (28 here): about
// three times an element-wise pass (docs/perf.md#kernels). So each
// iteration loads UNROLL elements a lane, all requested before any is used.

const UNROLL: u32 = 4u;

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

// Elements c, c + WG, c + 2 WG and c + 3 WG of the slice at `base`, 0 past its end.
fn x4(base: u32, c: u32) -> vec4<f32> {
    let cs = vec4<u32>(c, c + WG, c + 2u * WG, c + 3u * WG);
    let last = p.group - 1u;
    let v = vec4<f32>(x[base + min(cs.x, last)], x[base + min(cs.y, last)], x[base + min(cs.z, last)], x[base + min(cs.w, last)]);
    return select(vec4<f32>(0.0), v, cs < vec4<u32>(p.group));
}

@compute @workgroup_size(WG)
fn rmsnorm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let gi = wg.x + wg.y * nwg.x;
    let g = min(gi, p.groups - 1u);
    let base = g * p.group;
    var ss = vec4<f32>(0.0);
    for (var c = lanes.lid; c < p.group; c += UNROLL * WG) {
        let v = x4(base, c);
        ss += v * v;
    }
    let tot = wg_sum((ss.x + ss.y) + (ss.z + ss.w));
    let s = 1.0 / sqrt(tot / f32(p.group) + p.eps);
    if (gi < p.groups) {
        for (var c = lanes.lid; c < p.group; c += UNROLL * WG) {
            let v = x4(base, c);
            for (var k = 0u; k < UNROLL; k++) {
                let ck = c + k * WG;
                if (ck < p.group) {
                    o[base + ck] = v[k] * s * w[ck];
                }
            }
        }
    }
}

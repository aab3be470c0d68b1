// Elementwise ops over flat activations: add, x·σ(gate), and zero-padded row copies.

override WG: u32 = 256u;

struct EwParams {
    n: u32,
    cols: u32,
    cols_out: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: EwParams;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> o: array<f32>;

fn flat(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * WG;
}

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

@compute @workgroup_size(WG)
fn add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat(gid, nwg);
    if (i < p.n) {
        o[i] = a[i] + b[i];
    }
}

@compute @workgroup_size(WG)
fn sigmoid_gate(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat(gid, nwg);
    if (i < p.n) {
        o[i] = a[i] * sigmoid(b[i]);
    }
}

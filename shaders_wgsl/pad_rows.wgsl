// Copies [rows, cols] into [rows, cols_out] with zero columns on the right, so that a
// matvec reads whole 16-byte units of every input row.

override WG: u32 = 256u;

struct PadParams {
    n: u32,
    cols: u32,
    cols_out: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: PadParams;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> o: array<f32>;

@compute @workgroup_size(WG)
fn pad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i < p.n) {
        let r = i / p.cols_out;
        let c = i % p.cols_out;
        var v = 0.0;
        if (c < p.cols) {
            v = a[r * p.cols + c];
        }
        o[i] = v;
    }
}

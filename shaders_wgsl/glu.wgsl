// Gated linear units, elementwise: situ (K3) and silu (Kimi Linear).

override WG: u32 = 256u;

// Element i is row i / cols, column i % cols; g and u are read at row·stride + offset + column,
// so one buffer holding [gate | up] halves per row serves as both inputs.
struct GluParams {
    n: u32,
    cols: u32,
    beta: f32,
    linear_beta: f32,
    g_stride: u32,
    u_stride: u32,
    u_off: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: GluParams;
@group(0) @binding(1) var<storage, read> g: array<f32>;
@group(0) @binding(2) var<storage, read> u: array<f32>;
@group(0) @binding(3) var<storage, read_write> o: array<f32>;

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

// tanh saturates to ±1 in f32 beyond |v| = 9.1; clamping keeps exp-based drivers finite.
fn tanh_c(v: f32) -> f32 {
    return tanh(clamp(v, -15.0, 15.0));
}

fn gi(i: u32) -> u32 {
    return (i / p.cols) * p.g_stride + i % p.cols;
}

fn ui(i: u32) -> u32 {
    return (i / p.cols) * p.u_stride + p.u_off + i % p.cols;
}

@compute @workgroup_size(WG)
fn situ(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i < p.n) {
        let a = g[gi(i)];
        let b = u[ui(i)];
        o[i] = p.beta * tanh_c(a / p.beta) * sigmoid(a) * (p.linear_beta * tanh_c(b / p.linear_beta));
    }
}

@compute @workgroup_size(WG)
fn silu(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i < p.n) {
        let a = g[gi(i)];
        o[i] = a * sigmoid(a) * u[ui(i)];
    }
}

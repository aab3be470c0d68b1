// f32 weights: a unit is one vec4 (4 columns).

@group(0) @binding(3) var<storage, read> w: array<vec4<f32>>;

const UV: u32 = 1u;

struct Unit {
    v: array<vec4<f32>, UV>,
    s: f32,
}

fn load_unit(wrow: u32, u: u32) -> Unit {
    return Unit(array<vec4<f32>, UV>(w[wrow * p.units + u]), 1.0);
}

fn unit_dot(wrow: u32, u: u32, xb: u32) -> f32 {
    return dot(w[wrow * p.units + u], x[xb + u]);
}

// bf16 weights: a unit is 8 columns in one vec4<u32>; the low half of a word is the even
// column. bf16 widens to f32 exactly by a 16-bit shift.

@group(0) @binding(3) var<storage, read> w: array<vec4<u32>>;

const UV: u32 = 2u;

struct Unit {
    v: array<vec4<f32>, UV>,
    s: f32,
}

fn widen2(a: u32, b: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(vec4<u32>(a << 16u, a & 0xFFFF0000u, b << 16u, b & 0xFFFF0000u));
}

fn load_unit(wrow: u32, u: u32) -> Unit {
    let q = w[wrow * p.units + u];
    return Unit(array<vec4<f32>, UV>(widen2(q.x, q.y), widen2(q.z, q.w)), 1.0);
}

fn unit_dot(wrow: u32, u: u32, xb: u32) -> f32 {
    let q = w[wrow * p.units + u];
    let b = xb + 2u * u;
    return dot(widen2(q.x, q.y), x[b]) + dot(widen2(q.z, q.w), x[b + 1u]);
}

// int8 weights with one f32 scale per row: a unit is 16 columns in one vec4<u32>.

@group(0) @binding(3) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> scale: array<f32>;

const UV: u32 = 4u;

struct Unit {
    v: array<vec4<f32>, UV>,
    s: f32,
}

fn load_unit(wrow: u32, u: u32) -> Unit {
    let q = w[wrow * p.units + u];
    return Unit(
        array<vec4<f32>, UV>(
            vec4<f32>(unpack4xI8(q.x)),
            vec4<f32>(unpack4xI8(q.y)),
            vec4<f32>(unpack4xI8(q.z)),
            vec4<f32>(unpack4xI8(q.w)),
        ),
        scale[wrow],
    );
}

fn unit_dot(wrow: u32, u: u32, xb: u32) -> f32 {
    let q = w[wrow * p.units + u];
    let b = xb + 4u * u;
    let d = dot(vec4<f32>(unpack4xI8(q.x)), x[b]) + dot(vec4<f32>(unpack4xI8(q.y)), x[b + 1u])
        + dot(vec4<f32>(unpack4xI8(q.z)), x[b + 2u]) + dot(vec4<f32>(unpack4xI8(q.w)), x[b + 3u]);
    return d * scale[wrow];
}

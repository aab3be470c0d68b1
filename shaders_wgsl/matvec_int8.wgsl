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

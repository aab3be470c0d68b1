// int4 weights (two's complement nibbles, low nibble = even column) with one f32 scale per
// 64 columns: a unit is 32 columns in one vec4<u32>, so it never straddles a group.

@group(0) @binding(3) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> scale: array<f32>;

const UV: u32 = 8u;

struct Unit {
    v: array<vec4<f32>, UV>,
    s: f32,
}

const SH_LO: vec4<u32> = vec4<u32>(28u, 24u, 20u, 16u);
const SH_HI: vec4<u32> = vec4<u32>(12u, 8u, 4u, 0u);

fn lo4(q: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(q) << SH_LO) >> vec4<u32>(28u));
}

fn hi4(q: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(q) << SH_HI) >> vec4<u32>(28u));
}

fn load_unit(wrow: u32, u: u32) -> Unit {
    let q = w[wrow * p.units + u];
    return Unit(
        array<vec4<f32>, UV>(lo4(q.x), hi4(q.x), lo4(q.y), hi4(q.y), lo4(q.z), hi4(q.z), lo4(q.w), hi4(q.w)),
        scale[wrow * p.groups + u / 2u],
    );
}

fn unit_dot(wrow: u32, u: u32, xb: u32) -> f32 {
    let q = w[wrow * p.units + u];
    let b = xb + 8u * u;
    let d = dot(lo4(q.x), x[b]) + dot(hi4(q.x), x[b + 1u]) + dot(lo4(q.y), x[b + 2u]) + dot(hi4(q.y), x[b + 3u])
        + dot(lo4(q.z), x[b + 4u]) + dot(hi4(q.z), x[b + 5u]) + dot(lo4(q.w), x[b + 6u]) + dot(hi4(q.w), x[b + 7u]);
    return d * scale[wrow * p.groups + u / 2u];
}

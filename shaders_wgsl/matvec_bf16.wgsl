// bf16 weights: a unit is 8 columns in one vec4<u32>; the low half of a word is the even
// column. bf16 widens to f32 exactly by a 16-bit shift.

@group(0) @binding(3) var<storage, read> w: array<vec4<u32>>;

struct XU {
    x0: vec4<f32>,
    x1: vec4<f32>,
}

fn widen2(a: u32, b: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(vec4<u32>(a << 16u, a & 0xFFFF0000u, b << 16u, b & 0xFFFF0000u));
}

const UV: u32 = 2u;

fn load_x(xb: u32, u: u32) -> XU {
    let b = xb + u * UV;
    return XU(x[b], x[b + 1u]);
}

struct WU {
    q: vec4<u32>,
}

fn load_w(wrow: u32, u: u32) -> WU {
    return WU(w[wrow * p.units + u]);
}

struct DU {
    d0: vec4<f32>,
    d1: vec4<f32>,
}

fn decode_unit(wu: WU) -> DU {
    let q = wu.q;
    return DU(widen2(q.x, q.y), widen2(q.z, q.w));
}

fn decoded_dot(du: DU, xv: XU) -> f32 {
    return dot(du.d0, xv.x0) + dot(du.d1, xv.x1);
}

fn unit_dot(wu: WU, xv: XU) -> f32 {
    return decoded_dot(decode_unit(wu), xv);
}

fn stage_unit(wu: WU, r: u32, c: u32) {
    let d = decode_unit(wu);
    stage4(d.d0, r, c);
    stage4(d.d1, r, c + 4u);
}

// int8 weights with one f32 scale per row: a unit is 16 columns in one vec4<u32>.
//
// The decode takes no int-to-float conversions (a quarter-rate instruction on NVIDIA):
// a byte in offset binary ORed into the mantissa of 2^23 is 2^23 + b exactly, so one
// subtraction gives the signed value. Bytes 1 and 3 are placed 8 bits up (256× the value),
// and their x lanes are pre-scaled by 1/256 once per unit, which is exact, so every product
// equals the plain one.

@group(0) @binding(3) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> scale: array<f32>;

struct XU {
    x0: vec4<f32>,
    x1: vec4<f32>,
    x2: vec4<f32>,
    x3: vec4<f32>,
}

const MAGIC: u32 = 0x4B000000u;
const M8: vec4<u32> = vec4<u32>(0xFFu, 0xFF00u, 0xFFu, 0xFF00u);
const C8: vec4<f32> = vec4<f32>(8388736.0, 8421376.0, 8388736.0, 8421376.0);
const XS8: vec4<f32> = vec4<f32>(1.0, 0.00390625, 1.0, 0.00390625);

const UV: u32 = 4u;

fn load_x(xb: u32, u: u32) -> XU {
    let b = xb + u * UV;
    return XU(x[b] * XS8, x[b + 1u] * XS8, x[b + 2u] * XS8, x[b + 3u] * XS8);
}

// Four signed bytes of `q`, bytes 1 and 3 times 256.
fn bytes4(q: u32) -> vec4<f32> {
    let o = q ^ 0x80808080u;
    return bitcast<vec4<f32>>((vec4<u32>(o, o, o >> 16u, o >> 16u) & M8) | vec4<u32>(MAGIC)) - C8;
}

struct WU {
    q: vec4<u32>,
    s: f32,
}

fn load_w(wrow: u32, u: u32) -> WU {
    return WU(w[wrow * p.units + u], scale[wrow]);
}

// A unit's four vec4 of lane-scaled values and its scale.
struct DU {
    d0: vec4<f32>,
    d1: vec4<f32>,
    d2: vec4<f32>,
    d3: vec4<f32>,
    s: f32,
}

fn decode_unit(wu: WU) -> DU {
    let q = wu.q;
    return DU(bytes4(q.x), bytes4(q.y), bytes4(q.z), bytes4(q.w), wu.s);
}

fn decoded_dot(du: DU, xv: XU) -> f32 {
    let d = dot(du.d0, xv.x0) + dot(du.d1, xv.x1) + dot(du.d2, xv.x2) + dot(du.d3, xv.x3);
    return d * du.s;
}

fn unit_dot(wu: WU, xv: XU) -> f32 {
    return decoded_dot(decode_unit(wu), xv);
}

// Plain values: the conversion-free decode with its 256× on bytes 1 and 3 undone (exact),
// then the row scale.
fn stage_unit(wu: WU, r: u32, c: u32) {
    let q = wu.q;
    let f = XS8 * wu.s;
    stage4(bytes4(q.x) * f, r, c);
    stage4(bytes4(q.y) * f, r, c + 4u);
    stage4(bytes4(q.z) * f, r, c + 8u);
    stage4(bytes4(q.w) * f, r, c + 12u);
}

// The few-token kernel's pieces (matvec_few.wgsl): x as `load_x` scales it, a staged unit's
// first four vec4s, and the decoded form's dot product.
fn few_x4(xb: u32, u: u32, q: u32) -> vec4<f32> {
    return x[xb + u * UV + q] * XS8;
}

fn xu_from(v: X8) -> XU {
    return XU(v.x0, v.x1, v.x2, v.x3);
}

fn few_dot(wu: WU, du: DU, xv: XU) -> f32 {
    return decoded_dot(du, xv);
}

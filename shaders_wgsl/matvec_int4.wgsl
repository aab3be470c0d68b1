// int4 weights (two's complement nibbles, low nibble = even column) with one f32 scale per
// 64 columns: a unit is 32 columns in one vec4<u32>, so it never straddles a group.
//
// DEC 1 decodes without int-to-float conversions (a quarter-rate instruction on NVIDIA):
// nibble k of a half-word, in offset binary, is masked in place (16^k times its value)
// and ORed into the mantissa of 2^23, so one subtraction gives 16^k × the signed value
// exactly; x lane k is pre-scaled by 16^-k once per unit (exact), so every product equals
// the plain one. Per column that is one logic op, one add and the multiply-add.

@group(0) @binding(3) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> scale: array<f32>;

alias XU = X8;

const MAGIC: u32 = 0x4B000000u;
const M4: vec4<u32> = vec4<u32>(0xFu, 0xF0u, 0xF00u, 0xF000u);
// 2^23 + 8 · 16^k: the magic plus the offset-binary bias, per lane.
const C4: vec4<f32> = vec4<f32>(8388616.0, 8388736.0, 8390656.0, 8421376.0);
const XS4: vec4<f32> = vec4<f32>(1.0, 0.0625, 0.00390625, 0.000244140625);

const UV: u32 = 8u;

fn load_x(b: u32) -> XU {
    let v = load_x8(b);
    if (DEC == 0u) {
        return v;
    }
    return XU(v.x0 * XS4, v.x1 * XS4, v.x2 * XS4, v.x3 * XS4, v.x4 * XS4, v.x5 * XS4, v.x6 * XS4, v.x7 * XS4);
}

// The four nibbles of the low half-word of `o` (already in offset binary), lane k × 16^k.
fn nib4(o: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>((vec4<u32>(o) & M4) | vec4<u32>(MAGIC)) - C4;
}

fn word_dot(q: u32, xa: vec4<f32>, xb: vec4<f32>) -> f32 {
    let o = q ^ 0x88888888u;
    return dot(nib4(o), xa) + dot(nib4(o >> 16u), xb);
}

const SH_LO: vec4<u32> = vec4<u32>(28u, 24u, 20u, 16u);
const SH_HI: vec4<u32> = vec4<u32>(12u, 8u, 4u, 0u);

fn lo4(q: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(q) << SH_LO) >> vec4<u32>(28u));
}

fn hi4(q: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(q) << SH_HI) >> vec4<u32>(28u));
}

struct WU {
    q: vec4<u32>,
    s: f32,
}

fn load_w(wrow: u32, u: u32) -> WU {
    return WU(w[wrow * p.units + u], scale[wrow * p.groups + u / 2u]);
}

fn unit_dot(wu: WU, xv: XU) -> f32 {
    let q = wu.q;
    var d: f32;
    if (DEC == 0u) {
        d = dot(lo4(q.x), xv.x0) + dot(hi4(q.x), xv.x1) + dot(lo4(q.y), xv.x2) + dot(hi4(q.y), xv.x3)
            + dot(lo4(q.z), xv.x4) + dot(hi4(q.z), xv.x5) + dot(lo4(q.w), xv.x6) + dot(hi4(q.w), xv.x7);
    } else {
        d = word_dot(q.x, xv.x0, xv.x1) + word_dot(q.y, xv.x2, xv.x3) + word_dot(q.z, xv.x4, xv.x5)
            + word_dot(q.w, xv.x6, xv.x7);
    }
    return d * wu.s;
}

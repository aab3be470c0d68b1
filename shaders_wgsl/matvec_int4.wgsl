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

// A unit's eight vec4 of (DEC 1: lane-scaled) values and its scale.
struct DU {
    v: X8,
    s: f32,
}

fn decode_unit(wu: WU) -> DU {
    let q = wu.q;
    if (DEC == 0u) {
        return DU(X8(lo4(q.x), hi4(q.x), lo4(q.y), hi4(q.y), lo4(q.z), hi4(q.z), lo4(q.w), hi4(q.w)), wu.s);
    }
    let o = q ^ vec4<u32>(0x88888888u);
    return DU(
        X8(nib4(o.x), nib4(o.x >> 16u), nib4(o.y), nib4(o.y >> 16u), nib4(o.z), nib4(o.z >> 16u), nib4(o.w), nib4(o.w >> 16u)),
        wu.s,
    );
}

fn decoded_dot(du: DU, xv: XU) -> f32 {
    let v = du.v;
    var d: f32;
    if (DEC == 0u) {
        d = dot(v.x0, xv.x0) + dot(v.x1, xv.x1) + dot(v.x2, xv.x2) + dot(v.x3, xv.x3)
            + dot(v.x4, xv.x4) + dot(v.x5, xv.x5) + dot(v.x6, xv.x6) + dot(v.x7, xv.x7);
    } else {
        // Summed word by word, as the pairs of half-words come from one word.
        d = (dot(v.x0, xv.x0) + dot(v.x1, xv.x1)) + (dot(v.x2, xv.x2) + dot(v.x3, xv.x3))
            + (dot(v.x4, xv.x4) + dot(v.x5, xv.x5)) + (dot(v.x6, xv.x6) + dot(v.x7, xv.x7));
    }
    return d * du.s;
}

fn unit_dot(wu: WU, xv: XU) -> f32 {
    return decoded_dot(decode_unit(wu), xv);
}

// Plain values: the conversion-free decode with its 16^k lane factor undone (exact, a power
// of two), then the group scale, as the CPU dequantizes.
fn stage_unit(wu: WU, r: u32, c: u32) {
    let o = wu.q ^ vec4<u32>(0x88888888u);
    let f = XS4 * wu.s;
    stage4(nib4(o.x) * f, r, c);
    stage4(nib4(o.x >> 16u) * f, r, c + 4u);
    stage4(nib4(o.y) * f, r, c + 8u);
    stage4(nib4(o.y >> 16u) * f, r, c + 12u);
    stage4(nib4(o.z) * f, r, c + 16u);
    stage4(nib4(o.z >> 16u) * f, r, c + 20u);
    stage4(nib4(o.w) * f, r, c + 24u);
    stage4(nib4(o.w >> 16u) * f, r, c + 28u);
}

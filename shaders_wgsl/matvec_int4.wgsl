// int4 weights (two's complement nibbles, low nibble = even column) with one f32 scale per
// 64 columns: a unit is 32 columns in one vec4<u32>, so it never straddles a group.
//
// Two decodes, chosen per pipeline by DIGITS.
//
// The float decode (DIGITS false) takes no int-to-float conversions (a quarter-rate
// instruction on NVIDIA): nibble k of a half-word, in offset binary, is masked in place (16^k times its value)
// and ORed into the mantissa of 2^23, so one subtraction gives 16^k × the signed value
// exactly; x lane k is pre-scaled by 16^-k once per unit (exact), so every product equals
// the plain one. Per column that is one logic op, one add and the multiply-add.
//
// The digit decode (DIGITS true) meets x split into exact integer digits by the `x_planes`
// pass with byte dot products (`planes_dot`).

@group(0) @binding(3) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> scale: array<f32>;

alias XU = X8;

const MAGIC: u32 = 0x4B000000u;
const M4: vec4<u32> = vec4<u32>(0xFu, 0xF0u, 0xF00u, 0xF000u);
// 2^23 + 8 · 16^k: the magic plus the offset-binary bias, per lane.
const C4: vec4<f32> = vec4<f32>(8388616.0, 8388736.0, 8390656.0, 8421376.0);
const XS4: vec4<f32> = vec4<f32>(1.0, 0.0625, 0.00390625, 0.000244140625);

const UV: u32 = 8u;

// true: x is the digit planes of `x_planes` and units meet it through `planes_dot`.
override DIGITS: bool = false;

// The digit decode reads its digits from their layout (`plane_at`).
fn load_x(xb: u32, u: u32) -> XU {
    if (DIGITS) {
        let a = plane_at(xb, u);
        let i = a.x;
        let s = a.y;
        return X8(x[i], x[i + s], x[i + 2u * s], x[i + 3u * s], x[i + 4u * s], x[i + 5u * s], x[i + 6u * s], x[i + 7u * s]);
    }
    let v = load_x8(xb + u * UV);
    return XU(prep_x4(v.x0), prep_x4(v.x1), prep_x4(v.x2), prep_x4(v.x3), prep_x4(v.x4), prep_x4(v.x5), prep_x4(v.x6), prep_x4(v.x7));
}

// A vec4 of plain x as the float decode takes it: lane-scaled by 16^-k (exact); also what
// staging stores (matvec_staged.wgsl; never under the digit decode, whose x is the planes).
fn prep_x4(v: vec4<f32>) -> vec4<f32> {
    return v * XS4;
}

// The four nibbles of the low half-word of `o` (already in offset binary), lane k × 16^k.
fn nib4(o: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>((vec4<u32>(o) & M4) | vec4<u32>(MAGIC)) - C4;
}

struct WU {
    q: vec4<u32>,
    s: f32,
}

fn load_w(wrow: u32, u: u32) -> WU {
    return WU(w[wrow * p.units + u], scale[wrow * p.groups + u / 2u]);
}

// A unit's eight vec4 of lane-scaled values and its scale.
struct DU {
    v: X8,
    s: f32,
}

fn decode_unit(wu: WU) -> DU {
    let o = wu.q ^ vec4<u32>(0x88888888u);
    return DU(
        X8(nib4(o.x), nib4(o.x >> 16u), nib4(o.y), nib4(o.y >> 16u), nib4(o.z), nib4(o.z >> 16u), nib4(o.w), nib4(o.w >> 16u)),
        wu.s,
    );
}

fn decoded_dot(du: DU, xv: XU) -> f32 {
    let v = du.v;
    // Summed word by word, as the pairs of half-words come from one word.
    let d = (dot(v.x0, xv.x0) + dot(v.x1, xv.x1)) + (dot(v.x2, xv.x2) + dot(v.x3, xv.x3))
        + (dot(v.x4, xv.x4) + dot(v.x5, xv.x5)) + (dot(v.x6, xv.x6) + dot(v.x7, xv.x7));
    return d * du.s;
}

fn unit_dot(wu: WU, xv: XU) -> f32 {
    if (DIGITS) {
        return planes_dot(wu, xv);
    }
    return decoded_dot(decode_unit(wu), xv);
}

// The digit planes are stored by blocks of 32 units, vec4 q of the block's units side by
// side: the 32 lanes of a row walk consecutive units, so each of their x loads reads 512
// contiguous bytes, where plain x's 128-byte stride per lane touches 32 cache lines. For
// unit u of the token row whose plain x starts at vec4 xb: the index of its vec4 0, and the
// step to its vec4 q. (Given the unit rather than its x index, it needs no division by
// the row stride, a uniform, which took one in every unit step of the matvec.)
fn plane_at(xb: u32, u: u32) -> vec2<u32> {
    let blk = u / 32u;
    return vec2<u32>(xb + blk * 256u + u % 32u, min(32u, p.units - blk * 32u));
}

// The digit decode: x arrives as `x_planes` wrote it (the host runs that pass first): per unit, x
// scaled by 2^-k so its largest entry is below 2^22, rounded to integers X, and X split
// into three signed byte digits (X = d0 + 256 d1 + 65536 d2). The vec4s of a unit hold d0
// of the even columns of its four words, d0 of the odd ones, then d1, d2 the same way;
// the seventh holds 8 ΣX and 2^k. The nibbles in offset binary (n = w + 8) meet the digits
// in byte dot products; the i32 sum is exact (|Σ n X| < 480 · 2^22 < 2^31), so the only
// rounding is x's, at most 2^-22 of the unit's largest |x|.
fn planes_dot(wu: WU, xv: XU) -> f32 {
    let o = wu.q ^ vec4<u32>(0x88888888u);
    let lo = o & vec4<u32>(0x0F0F0F0Fu);
    let hi = (o >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu);
    let s0 = dot4(lo, bitcast<vec4<u32>>(xv.x0)) + dot4(hi, bitcast<vec4<u32>>(xv.x1));
    let s1 = dot4(lo, bitcast<vec4<u32>>(xv.x2)) + dot4(hi, bitcast<vec4<u32>>(xv.x3));
    let s2 = dot4(lo, bitcast<vec4<u32>>(xv.x4)) + dot4(hi, bitcast<vec4<u32>>(xv.x5));
    let t = s0 + (s1 << 8u) + (s2 << 16u) - bitcast<i32>(xv.x6.x);
    return f32(t) * xv.x6.y * wu.s;
}

// Σ over the four words of their byte dot products.
fn dot4(a: vec4<u32>, b: vec4<u32>) -> i32 {
    return dot4I8Packed(a.x, b.x) + dot4I8Packed(a.y, b.y) + dot4I8Packed(a.z, b.z) + dot4I8Packed(a.w, b.w);
}

// The low signed byte digit of `v` (in -128..127) and what is left above it.
fn digit(v: i32) -> vec2<i32> {
    let d = ((v + 128) & 255) - 128;
    return vec2<i32>(d, (v - d) >> 8u);
}

// x in the digit decode's layout, written into `y` (bound to the planes buffer, which has x's shape):
// one invocation per output word of a unit (32 a unit), per token. Each of a unit's 32
// invocations finds the unit's largest |x| itself (its 8 loads hit L1); one invocation per
// unit with the digits in private arrays took longer than the matvec it feeds.
@compute @workgroup_size(WG)
fn x_planes(@builtin(global_invocation_id) gid: vec3<u32>) {
    let u = gid.x / 32u;
    let j = gid.x % 32u;
    let t = gid.y;
    if (u >= p.units || t >= p.n) {
        return;
    }
    let xb = t * p.x_stride4;
    let b = xb + u * 8u;
    var m = 0.0;
    // A NaN or infinite x must still reach y as NaN, as it does through the f32 decodes
    // (max() may drop a NaN; an ordered compare does not pass it).
    var finite = true;
    for (var k = 0u; k < 8u; k++) {
        let a = abs(x[b + k]);
        finite = finite && all(a <= vec4<f32>(3.4028235e38));
        m = max(m, max(max(a.x, a.y), max(a.z, a.w)));
    }
    if (!finite) {
        m = 0.0;
    }
    // m < 2^e; scaled by 2^(22 - e) every |x| is below 2^22 (e held above -100, so the
    // factors stay finite; smaller units only get more headroom).
    let e = max(frexp(m).exp, -100);
    let up = ldexp(1.0, 22 - e);
    var out = 0u;
    if (j < 24u) {
        // Word j holds digit j / 8 of the even (j / 4 even) or odd columns of weight word
        // j % 4: columns 8 (j % 4) + odd + 2i, i < 4.
        let plane = j / 8u;
        let c0 = 8u * (j % 4u) + (j / 4u) % 2u;
        for (var i = 0u; i < 4u; i++) {
            let a = digit(scaled(b, c0 + 2u * i, m, up));
            let c = digit(a.y);
            var d = a.x;
            if (plane == 1u) {
                d = c.x;
            } else if (plane == 2u) {
                d = c.y;
            }
            out |= (u32(d) & 0xFFu) << (8u * i);
        }
    } else if (j == 24u) {
        var sum = 0;
        for (var k = 0u; k < 32u; k++) {
            sum += scaled(b, k, m, up);
        }
        out = u32(8 * sum);
    } else if (j == 25u) {
        var down = 0.0;
        if (m > 0.0) {
            down = ldexp(1.0, e - 22);
        }
        if (!finite) {
            down = bitcast<f32>(0x7FC00000u);
        }
        out = bitcast<u32>(down);
    }
    let a = plane_at(xb, u);
    y[4u * (a.x + j / 4u * a.y) + j % 4u] = bitcast<f32>(out);
}

// Column k of the unit whose x starts at vec4 b, scaled by `up` and rounded (0 where the
// unit's largest |x|, m, is 0 or not finite).
fn scaled(b: u32, k: u32, m: f32, up: f32) -> i32 {
    if (m > 0.0) {
        return i32(round(x[b + k / 4u][k % 4u] * up));
    }
    return 0;
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

// The few-token kernel's pieces (matvec_few.wgsl): vec4 q of unit u as `load_x` gives it
// (a digit plane, or plain x lane-scaled), a staged unit as XU, and the unit's dot product
// (the digits from the loaded unit, the float decode from its decoded form).
fn few_x4(xb: u32, u: u32, q: u32) -> vec4<f32> {
    if (DIGITS) {
        let a = plane_at(xb, u);
        return x[a.x + q * a.y];
    }
    return prep_x4(x[xb + u * UV + q]);
}

fn xu_from(v: X8) -> XU {
    return v;
}

fn few_dot(wu: WU, du: DU, xv: XU) -> f32 {
    if (DIGITS) {
        return planes_dot(wu, xv);
    }
    return decoded_dot(du, xv);
}

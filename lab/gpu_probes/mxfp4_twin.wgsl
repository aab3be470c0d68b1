// Bench only, not an engine kernel: the one-token MXFP4 matvec of lab/cuda_probe's
// mxfp4_matvec.cu written again in WGSL, line for line, so the Vulkan build of the same
// algorithm can be timed beside the engine's kernel (53 % of the read kernel on 16 experts'
// w1|w3 where the CUDA build reached 65 %, before session 11). Lane groups of LPR
// consecutive lanes share 4 rows and walk the units LPR apart, the next unit's weights
// requested before this one is computed; x staged once in workgroup memory with a pad vec4
// after each unit's eight (XMODE 0) or read from global memory (1). Rows past the end
// repeat the last and are not written. DECODE:
// 0: a bit cast instead of the decode (same loads; timing only);
// 1: the f16 pairs placed by shifts and masks (the engine's until session 11);
// 2: the conversion-free decode (the engine's DEC 2);
// 3, 4: 1 for the first two or three words of a unit, 2 for the rest;
// 5: the nibbles as bytes met in byte dot products (timing only);
// 6: the f16 pairs placed by masks and multiplies (the engine's since session 11);
// 7, 8: 6 with one or two of a word's four pairs decoded without a conversion instruction.

override LPR: u32 = 8u;
override DECODE: u32 = 1u;
override XMODE: u32 = 0u;

const WG: u32 = 256u;

struct Params {
    rows: u32,
    units: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> sc: array<u32>;
@group(0) @binding(3) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

// Up to 128 units (the host checks), nine vec4s each.
var<workgroup> xs: array<vec4<f32>, 1152>;

// Nibbles j and j + 4 of `q` as the f16 pair whose values are their E2M1 values times 2^-14.
fn pair(q: u32, j: u32) -> vec2<f32> {
    let n = q >> (4u * j);
    return widen(((n & 0x00070007u) << 9u) | ((n & 0x00080008u) << 12u));
}

// The f16 pair widened to f32. The host may replace this function (the bench's f16 and
// no-conversion variants), so it stays one line between these markers.
// WIDEN BEGIN
fn widen(h: u32) -> vec2<f32> { return unpack2x16float(h); }
// WIDEN END

// Word q's dot product with its x, times 2^-14 (the f16 placement's factor).
fn word_dot(q: u32, xa: vec4<f32>, xb: vec4<f32>) -> f32 {
    if (DECODE == 0u) {
        let v = bitcast<f32>(q & 0x3F7FFFFFu);
        return v * xa.x + v * xb.x;
    }
    let a = pair(q, 0u);
    let c = pair(q, 1u);
    let e = pair(q, 2u);
    let g = pair(q, 3u);
    return dot(vec4<f32>(a.x, c.x, e.x, g.x), xa) + dot(vec4<f32>(a.y, c.y, e.y, g.y), xb);
}

// DECODE 6: the same f16 pairs built with masks and multiplies (which NVIDIA runs on the
// FMA pipe) instead of shifts and masks: pair j's magnitude bits sit at 4j..4j+2 and
// 16+4j.., its sign bits at 4j+3 and 16+4j+3, and need to reach 9..11 and 15.
fn word_dot_mul(q: u32, xa: vec4<f32>, xb: vec4<f32>) -> f32 {
    let a = widen((q & 0x00070007u) * 512u + (q & 0x00080008u) * 4096u);
    let c = widen((q & 0x00700070u) * 32u + (q & 0x00800080u) * 256u);
    let e = widen((q & 0x07000700u) * 2u + (q & 0x08000800u) * 16u);
    let g = widen(((q & 0x70007000u) >> 3u) | (q & 0x80008000u));
    return dot(vec4<f32>(a.x, c.x, e.x, g.x), xa) + dot(vec4<f32>(a.y, c.y, e.y, g.y), xb);
}

// Nibble k of q as an f32 without a conversion instruction, times 2^-14 as the pairs: its
// magnitude bits placed at 22..24 of an f32 whose exponent gives B = 2^(e-15)(1 + m/2),
// min(B, 2B - 2^-14) covering the subnormal code e = 0, and the sign ORed in. Multiplies
// place the bits where they move left, so NVIDIA can run them on the FMA pipe.
fn direct(q: u32, k: u32) -> f32 {
    var t = q >> (4u * k - 22u);
    if (k <= 5u) {
        t = q * (1u << (22u - 4u * k));
    }
    let b = bitcast<f32>((t & 0x01C00000u) | 0x38000000u);
    let v = min(b, fma(b, 2.0, -1.0 / 16384.0));
    return bitcast<f32>(bitcast<u32>(v) | ((q * (1u << (28u - 4u * k))) & 0x80000000u));
}

// DECODE 7 and 8: `word_dot_mul` with pair 3 (7), or pairs 2 and 3 (8), built by `direct`,
// so fewer values go through the f16-to-f32 conversion.
fn word_dot_mixed(q: u32, xa: vec4<f32>, xb: vec4<f32>) -> f32 {
    let a = widen((q & 0x00070007u) * 512u + (q & 0x00080008u) * 4096u);
    let c = widen((q & 0x00700070u) * 32u + (q & 0x00800080u) * 256u);
    var e = vec2<f32>(direct(q, 2u), direct(q, 6u));
    if (DECODE == 7u) {
        e = widen((q & 0x07000700u) * 2u + (q & 0x08000800u) * 16u);
    }
    let g = vec2<f32>(direct(q, 3u), direct(q, 7u));
    return dot(vec4<f32>(a.x, c.x, e.x, g.x), xa) + dot(vec4<f32>(a.y, c.y, e.y, g.y), xb);
}

// The engine's conversion-free decode (DEC 2 of matvec_mxfp4.wgsl): value/4 of four
// nibbles whose magnitude bits sit at bits 22..24 and sign bits at bit 31.
fn quarter4(t: vec4<u32>, s: vec4<u32>) -> vec4<f32> {
    let b = bitcast<vec4<f32>>((t & vec4<u32>(0x01C00000u)) | vec4<u32>(0x3E000000u));
    let v = min(b, fma(b, vec4<f32>(2.0), vec4<f32>(-0.25)));
    return bitcast<vec4<f32>>(bitcast<vec4<u32>>(v) | (s & vec4<u32>(0x80000000u)));
}

// Word q's dot product through `quarter4`, times 2^-14 as `word_dot`'s.
fn word_dot_exp(q: u32, xa: vec4<f32>, xb: vec4<f32>) -> f32 {
    let v = vec4<u32>(q);
    let lo = quarter4(v << vec4<u32>(22u, 18u, 14u, 10u), v << vec4<u32>(28u, 24u, 20u, 16u));
    let hi = quarter4(vec4<u32>(q << 6u, q << 2u, q >> 2u, q >> 6u), v << vec4<u32>(12u, 8u, 4u, 0u));
    return (dot(lo, xa) + dot(hi, xb)) * (1.0 / 4096.0);
}

// Four nibbles in byte lanes as bytes 12 + E2M1 value times 2 (0..24), by byte-parallel
// integer operations: f = m + e1 (m & 3) + 2 [m = 7] gives 0,1,2,3,4,6,8,12 for the
// magnitude code m, and the sign s turns f into 12 - f as (f ^ 15) + 12 - 15.
fn offset_bytes(n: u32) -> u32 {
    let m = n & 0x07070707u;
    let e1 = (m >> 2u) & 0x01010101u;
    let t = m & (e1 * 3u);
    let seven = ((m + 0x01010101u) >> 2u) & 0x02020202u;
    let f = m + t + seven;
    let sm = ((n >> 3u) & 0x01010101u) * 15u;
    return ((f ^ sm) + 0x0C0C0C0Cu) - sm;
}

struct Unit {
    q: vec4<u32>,
    s: u32,
}

struct X8 {
    x0: vec4<f32>,
    x1: vec4<f32>,
    x2: vec4<f32>,
    x3: vec4<f32>,
    x4: vec4<f32>,
    x5: vec4<f32>,
    x6: vec4<f32>,
    x7: vec4<f32>,
}

fn load(row: u32, u: u32) -> Unit {
    let si = row * p.units + u;
    return Unit(w[si], (sc[si >> 2u] >> ((si & 3u) * 8u)) & 0xFFu);
}

fn unit_dot(a: Unit, v: X8) -> f32 {
    // The scale 2^(s-127), times 2^14 to undo the f16 placement.
    let f = bitcast<f32>(a.s << 23u) * 16384.0;
    if (DECODE == 5u) {
        return digits_dot(a.q, v) * f;
    }
    var d = 0.0;
    if (DECODE == 7u || DECODE == 8u) {
        d = word_dot_mixed(a.q.x, v.x0, v.x1) + word_dot_mixed(a.q.y, v.x2, v.x3) + word_dot_mixed(a.q.z, v.x4, v.x5)
            + word_dot_mixed(a.q.w, v.x6, v.x7);
        return d * f;
    }
    if (DECODE == 6u) {
        d = word_dot_mul(a.q.x, v.x0, v.x1) + word_dot_mul(a.q.y, v.x2, v.x3) + word_dot_mul(a.q.z, v.x4, v.x5)
            + word_dot_mul(a.q.w, v.x6, v.x7);
        return d * f;
    }
    if (DECODE == 2u) {
        d += word_dot_exp(a.q.x, v.x0, v.x1);
        d += word_dot_exp(a.q.y, v.x2, v.x3);
    } else {
        d += word_dot(a.q.x, v.x0, v.x1);
        d += word_dot(a.q.y, v.x2, v.x3);
    }
    if (DECODE == 2u || DECODE == 3u) {
        d += word_dot_exp(a.q.z, v.x4, v.x5);
    } else {
        d += word_dot(a.q.z, v.x4, v.x5);
    }
    if (DECODE >= 2u && DECODE <= 4u) {
        d += word_dot_exp(a.q.w, v.x6, v.x7);
    } else {
        d += word_dot(a.q.w, v.x6, v.x7);
    }
    return d * f;
}

// DECODE 5, timing only (wrong values): the unit's nibbles as offset bytes met in byte
// dot products with three digit planes, which here are x's own bits (the engine's int4
// digit kernel reads planes of the same size).
fn digits_dot(q: vec4<u32>, v: X8) -> f32 {
    let s = digit_word(q.x, v.x0, v.x1) + digit_word(q.y, v.x2, v.x3) + digit_word(q.z, v.x4, v.x5)
        + digit_word(q.w, v.x6, v.x7);
    let t = s.x + (s.y << 8u) + (s.z << 16u) - bitcast<i32>(v.x7.w);
    return f32(t) * v.x7.z;
}

// One word's byte dot products with planes 0, 1 and 2.
fn digit_word(q: u32, xa: vec4<f32>, xb: vec4<f32>) -> vec3<i32> {
    let lo = offset_bytes(q & 0x0F0F0F0Fu);
    let hi = offset_bytes((q >> 4u) & 0x0F0F0F0Fu);
    let pa = bitcast<vec4<u32>>(xa);
    let pb = bitcast<vec4<u32>>(xb);
    return vec3<i32>(
        dot4I8Packed(lo, pa.x) + dot4I8Packed(hi, pa.y),
        dot4I8Packed(lo, pa.z) + dot4I8Packed(hi, pa.w),
        dot4I8Packed(lo, pb.x) + dot4I8Packed(hi, pb.y),
    );
}

fn x_at(u: u32, i: u32) -> vec4<f32> {
    if (XMODE == 0u) {
        return xs[u * 9u + i];
    }
    return x[u * 8u + i];
}

fn x_unit(u: u32) -> X8 {
    return X8(x_at(u, 0u), x_at(u, 1u), x_at(u, 2u), x_at(u, 3u), x_at(u, 4u), x_at(u, 5u), x_at(u, 6u), x_at(u, 7u));
}

@compute @workgroup_size(WG)
fn twin(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (XMODE == 0u) {
        for (var i = lid; i < p.units * 8u; i += WG) {
            xs[i / 8u * 9u + i % 8u] = x[i];
        }
    }
    workgroupBarrier();
    let lane = lid % LPR;
    let row0 = (wg.x * (WG / LPR) + lid / LPR) * 4u;
    let last = p.rows - 1u;
    let r0 = min(row0, last);
    let r1 = min(row0 + 1u, last);
    let r2 = min(row0 + 2u, last);
    let r3 = min(row0 + 3u, last);
    var a0 = 0.0;
    var a1 = 0.0;
    var a2 = 0.0;
    var a3 = 0.0;
    var u = lane;
    let u0 = min(u, p.units - 1u);
    var c0 = load(r0, u0);
    var c1 = load(r1, u0);
    var c2 = load(r2, u0);
    var c3 = load(r3, u0);
    while (u < p.units) {
        let un = u + LPR;
        let m = min(un, p.units - 1u);
        let n0 = load(r0, m);
        let n1 = load(r1, m);
        let n2 = load(r2, m);
        let n3 = load(r3, m);
        let v = x_unit(u);
        a0 += unit_dot(c0, v);
        a1 += unit_dot(c1, v);
        a2 += unit_dot(c2, v);
        a3 += unit_dot(c3, v);
        c0 = n0;
        c1 = n1;
        c2 = n2;
        c3 = n3;
        u = un;
    }
    for (var o = LPR / 2u; o > 0u; o >>= 1u) {
        a0 += subgroupShuffleXor(a0, o);
        a1 += subgroupShuffleXor(a1, o);
        a2 += subgroupShuffleXor(a2, o);
        a3 += subgroupShuffleXor(a3, o);
    }
    if (lane == 0u) {
        if (row0 < p.rows) {
            y[row0] = a0;
        }
        if (row0 + 1u < p.rows) {
            y[row0 + 1u] = a1;
        }
        if (row0 + 2u < p.rows) {
            y[row0 + 2u] = a2;
        }
        if (row0 + 3u < p.rows) {
            y[row0 + 3u] = a3;
        }
    }
}

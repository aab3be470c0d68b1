// Native MXFP4 weights: E2M1 nibbles (low nibble = even column) with one E8M0 exponent per
// 32 columns, decoded here and never on the host. A unit is one scale block: 32 columns in
// one vec4<u32>. E8M0 is the f32 with bit pattern s << 23 (s = 0 gives 0, s = 255 gives
// +inf), exactly as the CPU decodes it.

@group(0) @binding(3) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> scales: array<u32>;
@group(0) @binding(5) var<storage, read> rt: array<u32>;

const UV: u32 = 8u;

struct Unit {
    v: array<vec4<f32>, UV>,
    s: f32,
}

// Two nibbles become one f16 pair by moving the magnitude bits to the f16 exponent and
// mantissa (and the sign to bit 15): the f16 value is the E2M1 value times 2^-14, exactly,
// code 1 landing on the f16 subnormal 2^-15. Nibbles j and j + 4 of the word share a pair.
fn pair(q: u32, j: u32) -> vec2<f32> {
    let n = q >> (4u * j);
    return unpack2x16float(((n & 0x00070007u) << 9u) | ((n & 0x00080008u) << 12u));
}

// Columns 0..3 (first vec4) and 4..7 (second) of one word.
fn word(q: u32) -> array<vec4<f32>, 2> {
    let a = pair(q, 0u);
    let b = pair(q, 1u);
    let c = pair(q, 2u);
    let d = pair(q, 3u);
    return array<vec4<f32>, 2>(vec4<f32>(a.x, b.x, c.x, d.x), vec4<f32>(a.y, b.y, c.y, d.y));
}

// 2^14, undoing the f16 placement.
const F16_BIAS: f32 = 16384.0;

fn load_unit(wrow: u32, u: u32) -> Unit {
    let q = w[wrow * p.units + u];
    let si = wrow * p.groups + u;
    let s = (scales[si >> 2u] >> ((si & 3u) * 8u)) & 0xFFu;
    let sc = bitcast<f32>(s << 23u);
    let a = word(q.x);
    let b = word(q.y);
    let c = word(q.z);
    let d = word(q.w);
    var v = array<vec4<f32>, UV>(a[0], a[1], b[0], b[1], c[0], c[1], d[0], d[1]);
    if (s > 240u) {
        // Where sc · 2^14 would overflow, and for the +inf scale (a zero nibble then gives
        // NaN as on the CPU), the scale is applied per element.
        for (var k = 0u; k < UV; k++) {
            v[k] = (v[k] * F16_BIAS) * sc;
        }
        return Unit(v, 1.0);
    }
    return Unit(v, sc * F16_BIAS);
}

fn word_dot(q: u32, b: u32) -> f32 {
    let a = pair(q, 0u);
    let c = pair(q, 1u);
    let e = pair(q, 2u);
    let g = pair(q, 3u);
    return dot(vec4<f32>(a.x, c.x, e.x, g.x), x[b]) + dot(vec4<f32>(a.y, c.y, e.y, g.y), x[b + 1u]);
}

fn unit_dot(wrow: u32, u: u32, xb: u32) -> f32 {
    let si = wrow * p.groups + u;
    let s = (scales[si >> 2u] >> ((si & 3u) * 8u)) & 0xFFu;
    let b = xb + 8u * u;
    if (s > 240u) {
        let un = load_unit(wrow, u);
        var d = 0.0;
        for (var k = 0u; k < UV; k++) {
            d += dot(un.v[k], x[b + k]);
        }
        return d * un.s;
    }
    let q = w[wrow * p.units + u];
    let d = word_dot(q.x, b) + word_dot(q.y, b + 2u) + word_dot(q.z, b + 4u) + word_dot(q.w, b + 6u);
    return d * (bitcast<f32>(s << 23u) * F16_BIAS);
}

// Batched experts: work item item0 + wg.x = (expert slot, pair, 1) from `rt`, wg.y the row
// group. The pair's input row comes from the gather table at rt[map_off + pair]; the output
// is row `pair` of y ([pairs, rows]). Pairs are grouped by expert, so the workgroups that
// run together share the expert's rows through L2.
@compute @workgroup_size(WG)
fn moe(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let lane = lanes.lid % LPR;
    let row = (wg.y * (WG / LPR) + lanes.lid / LPR) * RPL;
    let rr = min(row, p.rows - 1u);
    let nrows = min(RPL, p.rows - rr);
    let item = p.item0 + wg.x;
    let slot = rt[3u * item];
    let pr = rt[3u * item + 1u];
    let xb = rt[p.map_off + pr] * p.x_stride4;
    gemv_rows(slot * p.rows + rr, nrows, xb, lane, pr * p.y_stride + rr, select(0u, nrows, row < p.rows));
}

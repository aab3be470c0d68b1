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

// Batched experts: work item item0 + wg.y = (expert slot, first pair, pair count ≤ TOK) from `rt`;
// the pair's input row comes from the gather table at rt[map_off + pair]; the output is
// row `pair` of y ([pairs, rows]).
@compute @workgroup_size(WG)
fn moe(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let lane = lanes.lid % LPR;
    let row = (wg.x * (WG / LPR) + lanes.lid / LPR) * RPL;
    let rr = min(row, p.rows - 1u);
    let nrows = min(RPL, p.rows - rr);
    let item = p.item0 + wg.y;
    let slot = rt[3u * item];
    let first = rt[3u * item + 1u];
    let nt = rt[3u * item + 2u];
    var xoff: array<u32, TMAX>;
    var yoff: array<u32, TMAX>;
    for (var t = 0u; t < TOK; t++) {
        let pr = first + min(t, nt - 1u);
        xoff[t] = rt[p.map_off + pr] * p.x_stride4;
        yoff[t] = pr * p.y_stride + rr;
    }
    let acc = lane_partials(slot * p.rows + rr, nrows, xoff, lane);
    finish(acc, lane, select(0u, nrows, row < p.rows), yoff, nt);
}
